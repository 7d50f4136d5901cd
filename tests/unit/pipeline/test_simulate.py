"""The pipeline simulator against closed forms, plus deadlock, memory and speed checks."""

import random
import time

import pytest

from steptune.core.specs import LinkSpec
from steptune.pipeline.anchors import gpipe, interleaved_1f1b, one_f_one_b, zb_h1
from steptune.pipeline.costs import StageCosts
from steptune.pipeline.fuzz import random_schedule
from steptune.pipeline.schedule import Action, Schedule, ScheduleError
from steptune.pipeline.simulate import makespan, simulate


def equal_costs(num_stages, f=1.0, i=1.0, w=1.0, act=1.0, link=None, static=0.0):
    n = num_stages
    return StageCosts(
        f=(f,) * n,
        i=(i,) * n,
        w=(w,) * n,
        act_bytes=(act,) * n,
        out_bytes=(1.0,) * n,
        static_bytes=(static,) * n,
        link=link,
    )


@pytest.mark.parametrize("p,m", [(2, 4), (4, 8), (4, 16), (8, 32), (3, 7)])
def test_1f1b_bubble_closed_form(p, m):
    # The textbook model (torch's runtime): a fused B sends its gradient when it ends
    r = simulate(one_f_one_b(p, m), equal_costs(p, f=1.0, i=1.0, w=1.0), send_after_i=False)
    # fused B = I + W = 2; per microbatch 3 units; (m + p - 1) slots of (F + B)
    assert r.makespan == pytest.approx((m + p - 1) * 3.0)
    assert r.bubble_fraction == pytest.approx((p - 1) / (m + p - 1))
    # steptune's executor sends it after the I part: as fast as the same order with B written as I;W
    ours = simulate(one_f_one_b(p, m), equal_costs(p, f=1.0, i=1.0, w=1.0))
    assert ours.makespan == pytest.approx(simulate(_split_b(one_f_one_b(p, m)), equal_costs(p)).makespan)
    assert ours.makespan < r.makespan


def _split_b(schedule):
    """The same orders with each fused B written as I then W."""
    from dataclasses import replace

    from steptune.pipeline.schedule import Action, ActionKind

    def split(a):
        if a.kind is not ActionKind.B:
            return (a,)
        return (Action(a.stage, ActionKind.I, a.microbatch), Action(a.stage, ActionKind.W, a.microbatch))

    return replace(
        schedule, orders=tuple(tuple(x for a in order for x in split(a)) for order in schedule.orders)
    )


@pytest.mark.parametrize("p,m", [(2, 4), (4, 8)])
def test_gpipe_same_time_more_memory(p, m):
    c = equal_costs(p, act=10.0, static=5.0)
    g, o = simulate(gpipe(p, m), c), simulate(one_f_one_b(p, m), c)
    assert g.makespan == pytest.approx(o.makespan)
    assert g.peak_memory[0] == pytest.approx(5.0 + 10.0 * m)  # every microbatch in flight
    assert o.peak_memory[0] == pytest.approx(5.0 + 10.0 * p)  # at most p in flight on device 0
    assert o.peak_memory[p - 1] == pytest.approx(5.0 + 10.0)


@pytest.mark.parametrize("p,v,m", [(2, 2, 4), (4, 2, 8), (4, 4, 16), (4, 2, 16)])
def test_interleaved_bubble_closed_form(p, v, m):
    s = p * v
    c = equal_costs(s, f=1.0 / v, i=1.0 / v, w=1.0 / v)  # the same model cut into v chunks per device
    r = simulate(interleaved_1f1b(p, m, num_chunks=v), c, send_after_i=False)  # the textbook model
    ideal = 3.0 * m
    assert (r.makespan - ideal) / ideal == pytest.approx((p - 1) / (v * m))


@pytest.mark.parametrize("p,m", [(2, 4), (4, 8), (4, 12), (8, 16)])
def test_zb_h1_closed_form(p, m):
    # With F = I = W the ZB-H1 bubble is (p-1)(F + I - W) = (p-1) units: a third of 1F1B's.
    r = simulate(zb_h1(p, m), equal_costs(p))
    assert r.makespan == pytest.approx(3.0 * m + (p - 1) * 1.0)
    o = simulate(one_f_one_b(p, m), equal_costs(p))
    assert max(r.peak_memory) <= max(o.peak_memory) + 1e-9  # same activation bound as 1F1B


def test_zero_cost_comm_limit_and_comm_delays():
    p, m = 4, 8
    base = simulate(one_f_one_b(p, m), equal_costs(p))
    free = simulate(one_f_one_b(p, m), equal_costs(p, link=LinkSpec(name="x", bandwidth=1e30, latency=0.0)))
    assert free.makespan == pytest.approx(base.makespan)
    slow = simulate(one_f_one_b(p, m), equal_costs(p, link=LinkSpec(name="x", bandwidth=1e30, latency=0.25)))
    # the first forward and the last backward each cross p-1 links
    assert slow.makespan >= base.makespan + 2 * (p - 1) * 0.25 - 1e-9
    assert any(b.cause.endswith("via comm") for b in slow.bubbles)


def test_bubble_attribution_accounts_for_all_idle_time():
    p, m = 4, 8
    costs = StageCosts(
        f=(1.0, 1.0, 1.0, 3.0),
        i=(1.0,) * 4,
        w=(1.0,) * 4,
        act_bytes=(1.0,) * 4,
        out_bytes=(1.0,) * 4,
        static_bytes=(0.0,) * 4,
    )
    r = simulate(one_f_one_b(p, m), costs)
    for d in range(p):
        assert r.bubble_by_device()[d] == pytest.approx(r.idle(d))
    # device 0 waits on the slow last stage: its bubbles name backward dependencies
    assert any("B" in b.cause for b in r.bubbles if b.device == 0)


def test_cyclic_order_is_a_clear_error():
    bad = Schedule(
        name="bad",
        num_stages=2,
        num_microbatches=1,
        placement=(0, 1),
        orders=((Action.parse("0B0"), Action.parse("0F0")), (Action.parse("1F0"), Action.parse("1B0"))),
    ).validate()
    with pytest.raises(ScheduleError, match=r"deadlocks.*device 0 at 0B0 waits for 0F0"):
        simulate(bad, equal_costs(2))


def test_thousands_of_nodes_in_milliseconds():
    c = equal_costs(32)
    seconds = []
    for _ in range(3):  # best of three fresh schedules (each compiles its program): a shared box is noisy
        sched = interleaved_1f1b(16, 64, num_chunks=2)
        assert sum(len(o) for o in sched.orders) >= 4000
        t0 = time.perf_counter()
        simulate(sched, c, with_spans=False)
        seconds.append(time.perf_counter() - t0)
    assert min(seconds) < 0.5, seconds


def test_a_send_does_not_hold_back_its_own_device():
    # 2 stages on 2 devices, split backward: 1I0 sends its gradient to device 0 over a slow link, and
    # 1W0 (same device) starts when 1I0 ends, not when the gradient lands; likewise 0I0 after 0F0's send.
    sched = Schedule(
        name="split",
        num_stages=2,
        num_microbatches=1,
        placement=(0, 1),
        orders=tuple(
            tuple(Action.parse(x) for x in o) for o in (("0F0", "0I0", "0W0"), ("1F0", "1I0", "1W0"))
        ),
    ).validate()
    r = simulate(sched, equal_costs(2, link=LinkSpec(name="x", bandwidth=1e30, latency=5.0)))
    one_i, one_w = Action.parse("1I0"), Action.parse("1W0")
    assert r.start[one_w] == pytest.approx(r.end[one_i])
    # device 0's input-gradient step waits for the gradient: 0F0 (1) + link (5) + 1F0 (1) + 1I0 (1) + link (5)
    assert r.start[Action.parse("0I0")] == pytest.approx(13.0)
    assert r.makespan == pytest.approx(15.0)


@pytest.mark.parametrize("seed", range(3))
def test_makespan_is_simulate_without_the_extras(seed):
    rng = random.Random(seed)
    for _ in range(40):
        d = rng.randint(1, 4)
        s = d + rng.randint(0, 3)
        sched = random_schedule(rng, num_devices=d, num_stages=s, num_microbatches=rng.randint(1, 6))
        link = LinkSpec(name="x", bandwidth=rng.uniform(1, 10), latency=rng.uniform(0, 0.5))
        costs = StageCosts(
            f=tuple(rng.uniform(0.5, 2) for _ in range(s)),
            i=tuple(rng.uniform(0.5, 2) for _ in range(s)),
            w=tuple(rng.uniform(0.2, 1) for _ in range(s)),
            act_bytes=(1.0,) * s,
            out_bytes=tuple(rng.uniform(0, 3) for _ in range(s)),
            static_bytes=(0.0,) * s,
            link=link if rng.random() < 0.7 else None,
            overhead=rng.choice([0.0, 0.05]),
        )
        r = simulate(sched, costs, with_spans=False)
        assert makespan(sched, costs) == r.makespan
        # the makespan is a longest path: it never beats any device's own busy time
        assert r.makespan >= max(r.busy) - 1e-9
        f = costs.f

        def twice(a, f=f):
            return 2 * (f[a.stage] if a.kind.value == "F" else 1.0)

        assert makespan(sched, costs, durations=twice) == simulate(sched, costs, durations=twice).makespan


def test_makespan_is_fast_on_a_reused_schedule():
    sched = one_f_one_b(16, 128)
    c = equal_costs(16)
    makespan(sched, c)  # builds the program once
    t0 = time.perf_counter()
    for _ in range(10):
        makespan(sched, c)
    per_call = (time.perf_counter() - t0) / 10
    t0 = time.perf_counter()
    simulate(sched, c, with_spans=False)
    assert per_call < (time.perf_counter() - t0) / 2


def test_programs_are_freed_with_their_schedules():
    import gc
    import importlib

    sim = importlib.import_module("steptune.pipeline.simulate")  # the package's `simulate` is the function

    gc.collect()
    before = len(sim._programs)
    kept = one_f_one_b(4, 3)
    first = sim.program(kept)
    for m in range(1, 40):
        makespan(one_f_one_b(4, m), equal_costs(4))  # each schedule dies at the end of its statement
    gc.collect()
    assert len(sim._programs) == before + 1  # only the one still referenced
    assert sim.program(kept) is first
    # an equal but distinct schedule object gets its own program, never a stale one
    twin = one_f_one_b(4, 3)
    assert sim.program(twin) is not first and sim.program(twin).actions == first.actions
