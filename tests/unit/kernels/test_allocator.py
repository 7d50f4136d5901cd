"""The elastic allocator on simulated traffic: it follows the bottleneck both ways, keeps the minimums, waits
`min_interval_s` between changes, does not flap on a noisy stationary stream (hysteresis plus a noise
guard), and handles a single worker."""

import itertools
import math
import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from steptune.kernels.allocator import AllocatorConfig, ElasticAllocator

pytestmark = pytest.mark.timeout(60)


def drive(alloc, start, end, traffic, step=1.0):
    """Feed evenly spaced arrivals and service samples; traffic = {kind: (per second, service seconds)}."""
    due = dict.fromkeys(traffic, 0.0)
    t = start
    while t < end:
        for kind, (rate, service) in traffic.items():
            due[kind] += rate * step
            while due[kind] >= 1.0:
                due[kind] -= 1.0
                alloc.observe_arrival(kind, t)
                alloc.observe_service(kind, service, t)
        alloc.decide(t)
        t += step
    return t


def test_follows_the_bottleneck_to_profiling_and_back():
    alloc = ElasticAllocator(8)
    assert alloc.num_validate == 4
    # Validation needs 1 worker of work, profiling 4: the best split is 2 + 6 (bottleneck 4/6).
    t = drive(alloc, 0.0, 600.0, {"validate": (1.0, 1.0), "profile": (0.5, 8.0)})
    assert alloc.num_validate == 2
    assert alloc.roles() == ["validate"] * 2 + ["profile"] * 6
    assert alloc.history[0] == (0.0, 4, "initial")
    assert all("profile-bound" in reason for _, _, reason in alloc.history[1:])
    assert alloc.utilization(2, t) == pytest.approx(4 / 6, rel=0.05)
    # Candidates now pour in and few pass: validation needs 3 workers, profiling 0.2.
    drive(alloc, t, 1800.0, {"validate": (3.0, 1.0), "profile": (0.1, 2.0)})
    assert alloc.num_validate == 7
    assert "validate-bound" in alloc.history[-1][2]


def test_never_goes_below_the_minimums():
    cfg = AllocatorConfig(min_validate=2, min_profile=3)
    alloc = ElasticAllocator(8, cfg)
    drive(alloc, 0.0, 600.0, {"validate": (0.01, 0.1), "profile": (5.0, 10.0)})
    assert alloc.num_validate == 2
    drive(alloc, 600.0, 1800.0, {"validate": (10.0, 5.0), "profile": (0.001, 0.1)})
    assert alloc.num_validate == 5
    assert all(2 <= k <= 5 for _, k, _ in alloc.history)


def test_changes_are_at_least_min_interval_apart():
    cfg = AllocatorConfig(min_interval_s=45.0, window_s=10.0)
    alloc = ElasticAllocator(16, cfg)
    t = 0.0
    for phase in range(6):  # swing the bottleneck every 100 s
        heavy_profile = phase % 2 == 0
        traffic = {"validate": (1.0, 1.0), "profile": (1.0, 12.0 if heavy_profile else 0.1)}
        t = drive(alloc, t, t + 100.0, traffic, step=0.5)
    times = [when for when, _, _ in alloc.history]
    assert len(times) >= 4
    assert times[1] - times[0] >= 45.0  # the first change also waits, from the first timestamp
    assert all(b - a >= 45.0 for a, b in itertools.pairwise(times))


def _noisy_changes(cfg, seed, num_workers, traffic, end=3600.0):
    """Changes in an hour of Poisson arrivals with exponential service times (decide every second)."""
    rng = random.Random(seed)
    alloc = ElasticAllocator(num_workers, cfg)
    t = 0.0
    while t < end:
        for kind, rate, mean in traffic:
            for _ in range(_poisson(rng, rate)):
                alloc.observe_arrival(kind, t)
                alloc.observe_service(kind, rng.expovariate(1 / mean), t)
        alloc.decide(t)
        t += 1.0
    return len(alloc.history) - 1


def _poisson(rng, lam):
    n, p, limit = 0, 1.0, math.exp(-lam)
    while (p := p * rng.random()) > limit:
        n += 1
    return n


UNGUARDED = AllocatorConfig(hysteresis=0.0, min_interval_s=0.0, noise_z=0.0)
# A clear optimum (k_v = 2 of 8: validation needs 1 worker, profiling 4) and the worst case for flapping,
# the tie between k_v = 2 and 3 of 4 (validation needs 1 worker, profiling 0.5).
CLEAR = (8, (("validate", 1.0, 1.0), ("profile", 0.5, 8.0)))
TIE = (4, (("validate", 1.0, 1.0), ("profile", 0.5, 1.0)))


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize(("workload", "most"), [(CLEAR, 4), (TIE, 8)], ids=["clear", "tie"])
def test_no_flapping_on_a_noisy_stationary_stream(seed, workload, most):
    steady = _noisy_changes(AllocatorConfig(), seed, *workload)
    twitchy = _noisy_changes(UNGUARDED, seed, *workload)
    assert steady <= most  # the clear case includes the moves from the initial k_v = 4 to 2
    assert twitchy >= 10 * steady  # the stream really is noisy enough to flap without the guards


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_noise_guard_cuts_changes_that_hysteresis_lets_through(seed):
    guarded = _noisy_changes(AllocatorConfig(), seed, *TIE)
    point_estimates = _noisy_changes(AllocatorConfig(noise_z=0.0), seed, *TIE)
    assert point_estimates >= 3 * guarded


def test_demand_error_is_poisson_and_never_zero_for_an_unseen_kind():
    alloc = ElasticAllocator(4)
    for _ in range(100):
        alloc.observe_arrival("validate", 0.0)
        alloc.observe_service("validate", 2.0, 0.0)
    window = 60.0 * -math.expm1(-30.0 / 60.0)  # the decay weights' integral over the 30 s observed
    d_v, d_p = alloc.demand(30.0)
    assert alloc.demand_error("validate", 30.0) == pytest.approx(0.1 * d_v)  # √100 of 100 arrivals
    assert d_p == 0.0
    assert alloc.demand_error("profile", 30.0) == pytest.approx(2.0 / window)  # one arrival's worth


def test_single_worker_is_any_and_never_changes():
    alloc = ElasticAllocator(1)
    drive(alloc, 0.0, 300.0, {"validate": (1.0, 1.0), "profile": (2.0, 9.0)})
    assert alloc.roles() == ["any"]
    assert alloc.roles(0) == ["any"]
    assert alloc.decide(301.0) is None
    assert [k for _, k, _ in alloc.history] == [1]


def test_estimates_and_priors():
    alloc = ElasticAllocator(4)
    assert alloc.service_time("profile", 0.0) == 1.0  # nothing known: 1 s
    drive(alloc, 0.0, 10.0, {"validate": (2.0, 3.0)})
    assert alloc.rate("validate", 10.0) == pytest.approx(2.0, rel=0.1)  # unbiased well before one window
    assert alloc.rate("profile", 10.0) == 0.0
    assert alloc.service_time("profile", 10.0) == 3.0  # borrowed from validation
    alloc.observe_service("profile", 7.0, 10.0)
    assert alloc.service_time("profile", 10.0) == 7.0
    # Old samples fade with the time constant: after one window a new sample outweighs the old 1/e : 1.
    alloc.observe_service("profile", 1.0, 70.0)
    expected = (7.0 * math.exp(-1) + 1.0) / (math.exp(-1) + 1.0)
    assert alloc.service_time("profile", 70.0) == pytest.approx(expected)


@pytest.mark.parametrize(("initial", "expected"), [(3, None), (2, None), (1, 2)])
def test_ties_keep_the_current_split_else_move_least(initial, expected):
    """Validation needs exactly twice the profiling work: k_v = 2 and 3 of 4 tie (1 is worse)."""
    alloc = ElasticAllocator(4, AllocatorConfig(hysteresis=0.0, noise_z=0.0), initial_validate=initial)
    for _ in range(50):
        alloc.observe_arrival("validate", 0.0)
        alloc.observe_arrival("validate", 0.0)
        alloc.observe_arrival("profile", 0.0)
    alloc.observe_service("validate", 1.0, 0.0)
    alloc.observe_service("profile", 1.0, 0.0)
    assert alloc.utilization(2, 30.0) == alloc.utilization(3, 30.0) < alloc.utilization(1, 30.0)
    assert alloc.decide(30.0) == expected


@pytest.mark.parametrize(
    ("args", "match"),
    [
        ((0,), "at least 1"),
        ((3, AllocatorConfig(min_validate=2, min_profile=2)), "lower the minimums"),
        ((4, None, 4), r"initial_validate=4: pass a value in \[1, 3\]"),
        ((4, AllocatorConfig(hysteresis=1.0)), "fraction"),
        ((4, AllocatorConfig(window_s=0.0)), "time constant"),
        ((4, AllocatorConfig(noise_z=-1.0)), "standard errors"),
    ],
)
def test_bad_configuration_says_what_to_change(args, match):
    with pytest.raises(ValueError, match=match):
        ElasticAllocator(*args)


def test_bad_observations_say_what_to_change():
    alloc = ElasticAllocator(4)
    with pytest.raises(ValueError, match="'validate' or 'profile'"):
        alloc.observe_arrival("ncu", 0.0)
    alloc.observe_arrival("validate", 5.0)
    with pytest.raises(ValueError, match="monotonic clock"):
        alloc.observe_arrival("validate", 4.0)
    with pytest.raises(ValueError, match="non-negative"):
        alloc.observe_service("profile", -1.0, 6.0)
    with pytest.raises(ValueError, match=r"\[0, 4\]"):
        alloc.roles(5)


events = st.lists(
    st.tuples(
        st.sampled_from(["validate", "profile", "decide"]),
        st.floats(0.0, 30.0),
        st.floats(0.0, 100.0),
    ),
    max_size=200,
)


@settings(max_examples=100, deadline=None)
@given(
    events=events,
    num_workers=st.integers(2, 12),
    min_validate=st.integers(0, 3),
    min_profile=st.integers(0, 3),
)
def test_decisions_stay_in_bounds_and_apart(events, num_workers, min_validate, min_profile):
    min_validate = min(min_validate, num_workers)
    min_profile = min(min_profile, num_workers - min_validate)
    cfg = AllocatorConfig(min_validate=min_validate, min_profile=min_profile, min_interval_s=5.0)
    alloc = ElasticAllocator(num_workers, cfg)
    t = 0.0
    for what, dt, seconds in events:
        t += dt
        if what == "decide":
            k = alloc.decide(t)
            assert k is None or min_validate <= k <= num_workers - min_profile
            assert min_validate <= alloc.num_validate <= num_workers - min_profile
        else:
            alloc.observe_arrival(what, t)
            alloc.observe_service(what, seconds, t)
    times = [when for when, _, _ in alloc.history]
    assert all(b - a >= 5.0 for a, b in itertools.pairwise(times))
    assert len(alloc.roles()) == num_workers
