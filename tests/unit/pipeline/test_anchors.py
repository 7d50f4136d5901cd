"""Anchor schedules: deadlock freedom, memory bounds, exact bubble sizes, and torch 2.13 parity.

Two tiny executors live here on purpose, independent of steptune's simulator: a unit-time one that
runs the head of every device whose dependencies are done (stuck means deadlock), and an event one
with random per-stage costs.
"""

from __future__ import annotations

import random

import pytest

from steptune.pipeline.anchors import (
    ANCHORS,
    anchor,
    dualpipe_v,
    gpipe,
    interleaved_1f1b,
    one_f_one_b,
    zb_h1,
    zb_v,
)
from steptune.pipeline.schedule import Action, ActionKind, Schedule, ScheduleError

F, I, W, B = ActionKind.F, ActionKind.I, ActionKind.W, ActionKind.B  # noqa: E741
DEVICE_COUNTS = (2, 3, 4, 8)


def _cases() -> list[tuple[str, int, int]]:
    """(anchor, P, M) for every anchor, P in DEVICE_COUNTS and M below, at and above P where allowed."""
    cases = []
    for p in DEVICE_COUNTS:
        for m in sorted({1, 2, p - 1, p, p + 1, 2 * p, 3 * p, 2 * p + 3}):
            for name in ANCHORS:
                if name == "dualpipe_v" and m < 2 * p:
                    continue
                if name == "interleaved_1f1b" and m % max(1, m // p):
                    continue
                cases.append((name, p, m))
    return cases


CASES = _cases()


# --- executors -------------------------------------------------------------------------------------


def _done_key(a: Action) -> tuple[int, str, int]:
    # I and B both produce the input gradient that the previous stage waits for.
    return (a.stage, {F: "F", I: "G", B: "G", W: "W"}[a.kind], a.microbatch)


def _deps(a: Action, num_stages: int) -> list[tuple[int, str, int]]:
    s, m = a.stage, a.microbatch
    if a.kind is F:
        return [(s - 1, "F", m)] if s > 0 else []
    if a.kind in (I, B):
        return [(s, "F", m)] + ([(s + 1, "G", m)] if s < num_stages - 1 else [])
    return [(s, "G", m)]  # W needs its I


def run_unit_time(sched: Schedule) -> int:
    """Each step, every device whose head action has its dependencies done runs it. Returns the
    number of steps; raises AssertionError naming the blocked heads on deadlock."""
    done: set[tuple[int, str, int]] = set()
    heads = [0] * sched.num_devices
    steps = 0
    while any(h < len(o) for h, o in zip(heads, sched.orders, strict=True)):
        ready = [
            d
            for d, o in enumerate(sched.orders)
            if heads[d] < len(o) and all(k in done for k in _deps(o[heads[d]], sched.num_stages))
        ]
        blocked = {d: str(o[heads[d]]) for d, o in enumerate(sched.orders) if heads[d] < len(o)}
        assert ready, f"{sched.name} deadlocks; blocked heads per device: {blocked}"
        for d in ready:
            done.add(_done_key(sched.orders[d][heads[d]]))
            heads[d] += 1
        steps += 1
    return steps


def simulate(sched: Schedule, cost) -> float:
    """Event simulation of static orders: start = max(device free, dependencies finished)."""
    finish: dict[tuple[int, str, int], float] = {}
    start_of: dict[Action, float] = {}
    free = [0.0] * sched.num_devices
    heads = [0] * sched.num_devices
    remaining = sum(len(o) for o in sched.orders)
    while remaining:
        progressed = False
        for d, order in enumerate(sched.orders):
            while heads[d] < len(order):
                a = order[heads[d]]
                deps = _deps(a, sched.num_stages)
                if any(k not in finish for k in deps):
                    break
                start = max([free[d], *(finish[k] for k in deps)])
                free[d] = finish[_done_key(a)] = start + cost(a)
                start_of[a] = start
                heads[d] += 1
                remaining -= 1
                progressed = True
        assert progressed, f"{sched.name} deadlocks under the event simulation"
    for a, start in start_of.items():  # every dependency finished before its consumer started
        assert all(finish[k] <= start for k in _deps(a, sched.num_stages)), a
    return max(free)


def peak_in_flight(sched: Schedule, released_by: set[ActionKind]) -> list[int]:
    """Per device, the most (stage, microbatch) forwards not yet followed by one of ``released_by``."""
    peaks = []
    for order in sched.orders:
        live = peak = 0
        for a in order:
            live += (a.kind is F) - (a.kind in released_by)
            peak = max(peak, live)
        peaks.append(peak)
    return peaks


# --- every anchor ----------------------------------------------------------------------------------


@pytest.mark.parametrize(("name", "p", "m"), CASES)
def test_anchor_is_valid_and_deadlock_free(name, p, m):
    sched = anchor(name, p, m)
    sched.validate()
    assert sched.num_devices == p and sched.num_microbatches == m
    assert run_unit_time(sched) >= len(max(sched.orders, key=len))


@pytest.mark.parametrize("name", list(ANCHORS))
def test_random_costs_never_deadlock(name):
    rng = random.Random(0)
    for p in DEVICE_COUNTS:
        for m in (2 * p, 3 * p):
            sched = anchor(name, p, m)
            # Unequal costs per stage and kind, and per-action jitter: a static order must hold up.
            base = {(s, k): rng.uniform(0.2, 3.0) for s in range(sched.num_stages) for k in ActionKind}
            makespan = simulate(sched, lambda a, base=base: base[a.stage, a.kind] * rng.uniform(0.5, 1.5))
            busy = max(sum(base[a.stage, a.kind] * 0.5 for a in o) for o in sched.orders)
            assert makespan >= busy


def test_unit_time_checker_catches_a_cycle():
    # Device 1 wants microbatch 1 first, but device 0 sends it only after backward 0 came back.
    orders = (
        (Action(0, F, 0), Action(0, B, 0), Action(0, F, 1), Action(0, B, 1)),
        (Action(1, F, 1), Action(1, F, 0), Action(1, B, 0), Action(1, B, 1)),
    )
    bad = Schedule(
        name="cyclic", num_stages=2, num_microbatches=2, placement=(0, 1), orders=orders
    ).validate()
    with pytest.raises(AssertionError, match="deadlocks"):
        run_unit_time(bad)
    with pytest.raises(AssertionError, match="deadlocks"):
        simulate(bad, lambda a: 1.0)


def test_names_placements_and_partition():
    expect = {
        "gpipe": ("gpipe", (0, 1, 2, 3)),
        "1f1b": ("1f1b", (0, 1, 2, 3)),
        "interleaved_1f1b": ("interleaved_1f1b_v2", (0, 1, 2, 3, 0, 1, 2, 3)),
        "zb_h1": ("zb_h1", (0, 1, 2, 3)),
        "zb_v": ("zb_v", (0, 1, 2, 3, 3, 2, 1, 0)),
        "dualpipe_v": ("dualpipe_v", (0, 1, 2, 3, 3, 2, 1, 0)),
    }
    for key, (name, placement) in expect.items():
        partition = tuple(range(1, len(placement) + 1))
        sched = anchor(key, 4, 8, partition=partition)
        assert (sched.name, sched.placement, sched.partition) == (name, placement, partition)
        assert Schedule.from_csv(sched.to_csv()).orders == sched.orders
    assert interleaved_1f1b(2, 4, num_chunks=3).placement == (0, 1, 0, 1, 0, 1)
    with pytest.raises(ScheduleError, match="partition"):
        gpipe(4, 8, partition=(1, 2))


def test_user_errors_say_what_to_change():
    with pytest.raises(ScheduleError, match=r"multiple of num_devices, e.g. 8 or 12"):
        interleaved_1f1b(4, 9)
    with pytest.raises(ScheduleError, match="use one_f_one_b"):
        interleaved_1f1b(4, 8, num_chunks=1)
    with pytest.raises(ScheduleError, match=r"num_microbatches >= 2 \* num_devices = 8"):
        dualpipe_v(4, 7)
    with pytest.raises(ScheduleError, match="at least 1 device"):
        one_f_one_b(0, 4)
    with pytest.raises(ScheduleError, match="at least 1 microbatch"):
        zb_v(4, 0)
    with pytest.raises(ScheduleError, match="choose one of gpipe, 1f1b"):
        anchor("zb_h2", 4, 8)
    assert isinstance(ScheduleError("x"), ValueError)


# --- memory bounds ---------------------------------------------------------------------------------


@pytest.mark.parametrize("p", DEVICE_COUNTS)
@pytest.mark.parametrize("m", [1, 3, 8, 17])
def test_in_flight_bounds(p, m):
    bound_1f1b = [min(p - d, m) for d in range(p)]
    assert peak_in_flight(gpipe(p, m), {B}) == [m] * p
    assert peak_in_flight(one_f_one_b(p, m), {B}) == bound_1f1b
    # ZB-H1 keeps 1F1B's forward/input-gradient pattern, so activations between F and I follow 1F1B.
    # Its W's run d steps late on device d (the paper's choice), so up to P microbatches wait for W
    # on every device: more than 1F1B's P-d on devices d > 0, but never more than 1F1B's peak (device
    # 0), which is the bound the paper claims.
    zb = zb_h1(p, m)
    assert peak_in_flight(zb, {I}) == bound_1f1b
    assert peak_in_flight(zb, {W}) == [min(p, m)] * p
    # ZB-V stages are half a 1F1B stage, so 2P stage-microbatches is 1F1B's peak of P.
    assert max(peak_in_flight(zb_v(p, m), {W})) <= 2 * p
    if m >= 2 * p:
        assert peak_in_flight(zb_v(p, m), {W}) == [2 * p] * p
        # DualPipeV holds one more half-size chunk than ZB-V (fused B's release at B).
        assert peak_in_flight(dualpipe_v(p, m), {W, B}) == [2 * p + 1] * p


@pytest.mark.parametrize("p", DEVICE_COUNTS)
@pytest.mark.parametrize(("v", "m"), [(2, 1), (2, 8), (2, 12), (3, 8), (3, 24)])
def test_interleaved_in_flight_is_the_warmup_plus_one(p, v, m):
    if m % max(1, m // p):
        pytest.skip("not a valid microbatch count for this P")
    group = m // max(1, m // p)
    expect = [min((v - 1) * group + 2 * (p - 1 - d) + 1, v * m) for d in range(p)]
    assert peak_in_flight(interleaved_1f1b(p, m, num_chunks=v), {B}) == expect


# --- exact bubbles with uniform costs (no communication) -------------------------------------------


def _uniform(f: float, i: float, w: float):
    return lambda a: {F: f, I: i, W: w, B: i + w}[a.kind]


@pytest.mark.parametrize("p", DEVICE_COUNTS)
def test_uniform_cost_makespans_match_the_papers(p):
    for m in (p, 2 * p, 3 * p):
        unit = _uniform(1, 1, 1)  # F = I = W, so B = 2F
        half = _uniform(0.5, 0.5, 0.5)  # two chunks per device: each stage costs half
        third = _uniform(1 / 3, 1 / 3, 1 / 3)
        # 1F1B and GPipe: bubble (P-1)(F+B).
        assert simulate(gpipe(p, m), unit) == simulate(one_f_one_b(p, m), unit) == 3 * (m + p - 1)
        # Interleaved: bubble (P-1)(F+B)/v.
        assert simulate(interleaved_1f1b(p, m), half) == pytest.approx(3 * m + 3 * (p - 1) / 2)
        assert simulate(interleaved_1f1b(p, m, num_chunks=3), third) == pytest.approx(3 * m + (p - 1))
        # ZB-H1: bubble (P-1)(F+I-W), a third of 1F1B's.
        assert simulate(zb_h1(p, m), unit) == 3 * m + (p - 1)
        if m >= 2 * p:
            # ZB-V and DualPipeV: only the unavoidable (P-1) forward hops before the last device starts.
            assert simulate(zb_v(p, m), half) == simulate(dualpipe_v(p, m), half) == 3 * m + (p - 1) / 2


def test_dualpipe_v_overlap_pairs_are_recorded():
    sched = dualpipe_v(4, 10)
    pairs = sched.meta["overlap_f_b"]
    assert pairs, "DualPipeV overlaps F and B in its main phase"
    for d, pos in pairs:
        f, b = sched.orders[d][pos : pos + 2]
        assert f.kind is F and b.kind is B and f.stage != b.stage


# --- parity with torch.distributed.pipelining 2.13 -------------------------------------------------


def _flatten_torch(row) -> list[str]:
    from torch.distributed.pipelining.schedules import _ComputationType as T

    out = []
    for a in row:
        if a is None:  # a deliberate idle step
            continue
        if a.computation_type == T.OVERLAP_F_B:  # our IR: its forward, then its backward
            out += [str(sub) for sub in a.sub_actions]
        elif a.computation_type in (T.FORWARD, T.BACKWARD_INPUT, T.BACKWARD_WEIGHT, T.FULL_BACKWARD):
            out.append(str(a))  # drops REDUCE_GRAD and communication
    return out


def torch_orders(schedule: str, p: int, m: int, stages_per_rank: int | None = None) -> list[list[str]]:
    vis = pytest.importorskip("torch.distributed.pipelining._schedule_visualizer")
    ops = vis.get_schedule_ops(schedule, p, m, num_stages_per_rank=stages_per_rank)
    return [_flatten_torch(row) for row in ops]


def torch_zb1p_one_stage(p: int, m: int) -> list[list[str]]:
    """torch's ScheduleInterleavedZeroBubble with one stage per rank, built on a mock stage (the
    visualizer insists on two)."""
    from unittest import mock

    from torch.distributed.pipelining import ScheduleInterleavedZeroBubble
    from torch.distributed.pipelining.stage import PipelineStage

    stage = mock.create_autospec(PipelineStage, instance=True)
    stage.group_rank, stage.group_size, stage.num_stages, stage.submod = 0, p, p, None
    sched = ScheduleInterleavedZeroBubble([stage], m)
    return [_flatten_torch(sched.pipeline_order[r]) for r in range(p)]


def ours(sched: Schedule) -> list[list[str]]:
    return [[str(a) for a in order] for order in sched.orders]


def _assert_same_or_both_reject(torch_fn, ours_fn):
    try:
        expected = torch_fn()
    except ValueError:
        with pytest.raises(ScheduleError):
            ours_fn()
        return
    assert ours(ours_fn()) == expected


@pytest.mark.parametrize("p", DEVICE_COUNTS)
def test_gpipe_matches_torch(p):
    for m in (1, 3, 2 * p):
        assert ours(gpipe(p, m)) == torch_orders("GPipe", p, m)


@pytest.mark.parametrize("p", DEVICE_COUNTS)
def test_1f1b_matches_torch_except_its_last_rank_numbering(p):
    for m in (p, 2 * p + 1):
        expected, got = torch_orders("1F1B", p, m), ours(one_f_one_b(p, m))
        assert got[:-1] == expected[:-1]
        # torch 2.13's Schedule1F1B._get_pipeline_order numbers the last rank's forwards 1..M (its
        # executed _step_microbatches is right): the last stage must run F0 B0 F1 B1 ...
        assert got[-1] == [f"{p - 1}{k}{j}" for j in range(m) for k in "FB"]
        shifted = [Action.parse(a) for a in expected[-1]]
        shifted = [str(Action(a.stage, a.kind, a.microbatch - (a.kind is F))) for a in shifted]
        assert got[-1] in (expected[-1], shifted)  # the second form once torch fixes it
    with pytest.raises(ValueError):  # torch needs M >= P; we allow fewer microbatches
        torch_orders("1F1B", p, p - 1)
    run_unit_time(one_f_one_b(p, p - 1))


@pytest.mark.parametrize("p", DEVICE_COUNTS)
@pytest.mark.parametrize("v", [2, 3])
def test_interleaved_1f1b_matches_torch(p, v):
    for m in sorted({2, 3, p, 2 * p, 10, 11}):
        _assert_same_or_both_reject(
            lambda m=m: torch_orders("Interleaved1F1B", p, m, v),
            lambda m=m: interleaved_1f1b(p, m, num_chunks=v),
        )


@pytest.mark.parametrize("p", DEVICE_COUNTS)
def test_zb_h1_matches_torch_zb1p_with_one_stage_per_rank(p):
    for m in sorted({2, p, 2 * p, 3 * p}):
        assert ours(zb_h1(p, m)) == torch_zb1p_one_stage(p, m)
    # torch's ZB1P also requires M % (M // P) == 0 (it groups microbatches for its chunks); with one
    # stage per rank the grouping changes nothing, so we accept any M.
    with pytest.raises(ValueError):
        torch_zb1p_one_stage(p, 2 * p + 1)
    run_unit_time(zb_h1(p, 2 * p + 1))


@pytest.mark.parametrize("p", DEVICE_COUNTS)
def test_zb_v_matches_torch(p):
    for m in sorted({1, 3, p, 2 * p - 1, 2 * p, 2 * p + 3}):
        assert ours(zb_v(p, m)) == torch_orders("ZBVZeroBubble", p, m)


@pytest.mark.parametrize("p", DEVICE_COUNTS)
def test_dualpipe_v_matches_torch(p):
    for m in (2 * p - 1, 2 * p, 2 * p + 1, 3 * p):
        _assert_same_or_both_reject(lambda m=m: torch_orders("DualPipeV", p, m), lambda m=m: dualpipe_v(p, m))
    # Every torch OVERLAP_F_B becomes one recorded pair.
    vis = pytest.importorskip("torch.distributed.pipelining._schedule_visualizer")
    num_overlaps = sum(
        a is not None and str(a).endswith("OVERLAP_F_B")
        for row in vis.get_schedule_ops("DualPipeV", p, 3 * p)
        for a in row
    )
    assert len(dualpipe_v(p, 3 * p).meta["overlap_f_b"]) == num_overlaps
