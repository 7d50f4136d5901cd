"""Planner: TP exclusion, PP repartition, DP assignment and migration, the gate, progressive replanning."""

import itertools
import math
from collections.abc import Iterator, Sequence

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from steptune.pipeline.costs import balanced_partition
from steptune.resilience.plan import ClusterState, ExecutionPlan, ReconfigCosts, StageMemory
from steptune.resilience.planners import Move, makespan, migrate, plan_dp, plan_pp, plan_tp, should_apply
from steptune.resilience.progressive import progressive_replan
from steptune.resilience.replans import initial_plan
from steptune.resilience.steptime import estimate_step_time
from steptune.resilience.workload import features

pytestmark = pytest.mark.timeout(60)


def _speeds(n: int, **slow: float) -> tuple[float, ...]:
    """n healthy devices, with e.g. d9=0.45 overriding device 9."""
    return tuple(slow.get(f"d{i}", 1.0) for i in range(n))


def _bottleneck(costs: Sequence[float], speeds: Sequence[float], part: Sequence[int]) -> float:
    bounds = np.concatenate(([0], np.cumsum(part)))
    return max(sum(costs[a:b]) / v for a, b, v in zip(bounds[:-1], bounds[1:], speeds, strict=True))


def _compositions(n: int, k: int) -> Iterator[tuple[int, ...]]:
    for cuts in itertools.combinations(range(1, n), k - 1):
        edges = (0, *cuts, n)
        yield tuple(b - a for a, b in itertools.pairwise(edges))


# TP -------------------------------------------------------------------------------------------------


def test_tp_halves_the_group_to_exclude_a_strongly_degraded_device() -> None:
    group = (8, 9, 10, 11)
    # 2 healthy devices (2 x 1.0) beat 4 paced by the slow one (4 x 0.45 = 1.8).
    assert plan_tp(group, _speeds(16, d9=0.45), num_heads=32) == (8, 10)
    # 4 x 0.9 = 3.6 beats 2: keep everyone.
    assert plan_tp(group, _speeds(16, d9=0.9), num_heads=32) == group


def test_tp_never_keeps_a_dead_device() -> None:
    assert plan_tp((0, 1), _speeds(4, d1=0.0), num_heads=8) == (0,)
    assert plan_tp((0, 1, 2, 3), _speeds(4, d2=0.0), num_heads=8) == (0, 1)
    with pytest.raises(ValueError, match="drop the replica"):
        plan_tp((0, 1), _speeds(2, d0=0.0, d1=0.0), num_heads=8)


def test_tp_respects_head_divisibility_and_the_memory_floor() -> None:
    healthy = _speeds(4)
    assert plan_tp((0, 1, 2, 3), healthy, num_heads=6) == (0, 1)  # 4 does not divide 6
    assert len(plan_tp((0, 1, 2, 3), healthy, num_heads=3)) == 1
    # A memory floor of 2 forbids dropping to one device even though 1 x 1.0 > 2 x 0.3.
    assert plan_tp((0, 1), _speeds(2, d1=0.3), num_heads=8, min_degree=2) == (0, 1)
    with pytest.raises(ValueError, match="min_degree"):
        plan_tp((0, 1), _speeds(2, d1=0.0), num_heads=8, min_degree=2)


# PP -------------------------------------------------------------------------------------------------


def test_pp_is_exact_against_brute_force() -> None:
    rng = np.random.default_rng(0)
    for _ in range(300):
        num_l, num_s = int(rng.integers(1, 9)), int(rng.integers(1, 5))
        if num_s > num_l:
            continue
        costs = list(rng.uniform(0.1, 2.0, num_l))
        speeds = list(rng.choice([0.25, 0.5, 1.0, 2.0], num_s))
        mem = None
        if rng.random() < 0.5:
            mem = StageMemory(
                layer_bytes=tuple(rng.uniform(1, 3, num_l)), capacity=tuple(rng.uniform(2, 8, num_s))
            )
        feasible = [
            p
            for p in _compositions(num_l, num_s)
            if mem is None
            or all(b <= c for b, c in zip(_stage_sums(mem.layer_bytes, p), mem.capacity, strict=True))
        ]
        if not feasible:
            with pytest.raises(ValueError, match="memory"):
                plan_pp(costs, speeds, memory=mem)
            continue
        prefer = feasible[int(rng.integers(len(feasible)))] if rng.random() < 0.5 else None
        got = plan_pp(costs, speeds, memory=mem, prefer=prefer)
        assert got in feasible
        best = min(_bottleneck(costs, speeds, p) for p in feasible)
        assert _bottleneck(costs, speeds, got) == pytest.approx(best, rel=1e-9)
        if prefer is not None:  # and among the optimal ones, the fewest layers moved
            optimal = [p for p in feasible if _bottleneck(costs, speeds, p) <= best * (1 + 1e-9)]
            assert _moved(prefer, got) == min(_moved(prefer, p) for p in optimal)


def _moved(old: Sequence[int], new: Sequence[int]) -> int:
    def owner(p: Sequence[int]) -> list[int]:
        return [s for s, n in enumerate(p) for _ in range(n)]

    return sum(a != b for a, b in zip(owner(old), owner(new), strict=True))


def _stage_sums(values: Sequence[float], part: Sequence[int]) -> list[float]:
    bounds = np.concatenate(([0], np.cumsum(part)))
    return [sum(values[a:b]) for a, b in itertools.pairwise(bounds)]


def test_pp_moves_layers_off_a_slow_stage() -> None:
    assert plan_pp([1.0] * 12, [1.0, 1.0, 1.0]) == (4, 4, 4)
    assert plan_pp([1.0] * 12, [1.0, 0.5, 1.0]) == (5, 2, 5)


def test_pp_prefers_the_current_partition_among_optimal_ones() -> None:
    costs = [1.0] * 10  # bottleneck 4: (4,3,3), (2,4,4), ... are all optimal
    assert sorted(plan_pp(costs, [1.0] * 3)) == [3, 3, 4]  # balanced by default
    assert plan_pp(costs, [1.0] * 3, prefer=(2, 4, 4)) == (2, 4, 4)  # nothing moves
    # A slow last stage: (4,4,1), (4,3,2) and (3,4,2) all reach 4; only (3,4,2) moves one layer.
    assert plan_pp([1.0] * 9, [1.0, 1.0, 0.5]) == (4, 4, 1)
    assert plan_pp([1.0] * 9, [1.0, 1.0, 0.5], prefer=(3, 3, 3)) == (3, 4, 2)


def test_pp_matches_balanced_partition_on_equal_speeds() -> None:
    rng = np.random.default_rng(1)
    costs = list(rng.uniform(0.5, 1.5, 24))
    ours = plan_pp(costs, [2.0] * 4)
    theirs = balanced_partition(costs, 4)
    assert _bottleneck(costs, [1.0] * 4, ours) == pytest.approx(_bottleneck(costs, [1.0] * 4, theirs))


def test_pp_respects_the_memory_cap_and_rejects_an_impossible_one() -> None:
    costs = [1.0] * 8
    # Unconstrained, the fast stage 0 would take 6 of 8 layers; memory caps it at 4.
    assert plan_pp(costs, [3.0, 1.0]) == (6, 2)
    mem = StageMemory(layer_bytes=(10.0,) * 8, capacity=(40.0, 80.0))
    part = plan_pp(costs, [3.0, 1.0], memory=mem)
    assert part == (4, 4)
    assert all(n * 10.0 <= c for n, c in zip(part, mem.capacity, strict=True))
    with pytest.raises(ValueError, match="fits memory"):
        plan_pp(costs, [1.0, 1.0], memory=StageMemory(layer_bytes=(10.0,) * 8, capacity=(30.0, 30.0)))
    with pytest.raises(ValueError, match="exclude dead devices"):
        plan_pp(costs, [1.0, 0.0])


@settings(max_examples=60, deadline=None)
@given(
    costs=st.lists(st.floats(0.01, 10.0), min_size=1, max_size=24),
    speeds=st.lists(st.floats(0.05, 4.0), min_size=1, max_size=6),
)
def test_pp_never_loses_to_the_even_split(costs: list[float], speeds: list[float]) -> None:
    speeds = speeds[: len(costs)]
    q, rem = divmod(len(costs), len(speeds))
    even = [q + (s < rem) for s in range(len(speeds))]
    part = plan_pp(costs, speeds)
    assert sum(part) == len(costs) and min(part) >= 1
    assert _bottleneck(costs, speeds, part) <= _bottleneck(costs, speeds, even) * (1 + 1e-9)


# DP -------------------------------------------------------------------------------------------------


def _costs(microbatches: list[list[int]]) -> list[float]:
    """A predictor-shaped cost: linear in tokens plus quadratic in sum of squared lengths."""
    return [1e-5 * n + 2e-9 * q for n, q in map(features, microbatches)]


def test_lpt_beats_token_equal_round_robin() -> None:
    # 8K tokens each: equal token counts, very different attention cost.
    shapes = [[8192], [4096, 4096], [2048] * 4, [1024] * 8, [8192], [512] * 16, [8192], [4096, 4096]]
    costs = _costs(shapes)
    speeds = [1.0, 1.0, 1.0]
    rr = [[i for i in range(len(costs)) if i % 3 == r] for r in range(3)]
    lpt = plan_dp(costs, speeds)
    assert sorted(i for r in lpt for i in r) == list(range(len(costs)))
    assert makespan(lpt, costs, speeds) < 0.9 * makespan(rr, costs, speeds)


def test_dp_gives_the_slow_replica_less_work() -> None:
    costs = [1.0] * 12
    out = plan_dp(costs, [1.0, 0.5])
    assert [len(x) for x in out] == [8, 4]
    assert makespan(out, costs, [1.0, 0.5]) == pytest.approx(8.0)
    assert plan_dp(costs, [1.0, 0.0])[1] == []  # a dead replica gets nothing


def test_migration_moves_work_from_slow_to_fast_only_above_delta() -> None:
    progress = [0.0, 0.0]
    remaining = [[1.0, 1.0, 1.0, 1.0], [1.0, 1.0, 1.0, 1.0]]
    speeds = [0.5, 1.0]  # finishes at 8 s and 4 s: a 4 s gap
    moves = migrate(progress, remaining, speeds, delta=1.0)
    assert moves and all(m.src == 0 and m.dst == 1 for m in moves)
    after = [8.0 - 2.0 * len(moves), 4.0 + len(moves)]
    assert max(after) < 8.0 and abs(after[0] - after[1]) <= 2.0
    assert migrate(progress, remaining, speeds, delta=4.5) == []  # gap below delta: stay put
    # Fail-stop eviction: every pending microbatch of a dead replica moves, whatever delta.
    evicted = migrate([0.0, 0.0, 0.0], [[2.0, 1.0], [], []], [0.0, 1.0, 1.0], delta=100.0)
    assert sorted((m.item, m.dst) for m in evicted) == [(0, 1), (1, 2)]
    assert isinstance(evicted[0], Move)


# Gate -----------------------------------------------------------------------------------------------


def test_gate_applies_only_when_the_saving_over_the_fault_beats_the_cost() -> None:
    # 600 s at 10 s/step = 60 steps; saving 2 s each = 120 s.
    assert should_apply(10.0, 8.0, 600.0, 100.0)
    assert not should_apply(10.0, 8.0, 600.0, 150.0)
    assert not should_apply(10.0, 10.0, 1e9, 0.0)  # no gain
    assert should_apply(math.inf, 8.0, 0.0, 1e6)  # the current plan cannot run
    assert should_apply(10.0, 9.99, math.inf, 1e6)  # permanent fault
    with pytest.raises(ValueError):
        should_apply(0.0, 1.0, 1.0, 1.0)


# Plans and progressive replanning ----------------------------------------------------------------


def _toy(**slow: float) -> ClusterState:
    return ClusterState(speeds=_speeds(16, **slow), layer_costs=(0.1,) * 16, num_heads=32)


def test_plan_text_form_digest_and_validation() -> None:
    plan = initial_plan(_toy(), tp=2, pp=4, dp=2, global_microbatches=16)
    assert plan.layer_partition == ((4, 4, 4, 4),) * 2 and plan.microbatches == (8, 8)
    assert plan.group(1, 2) == (12, 13)
    again = ExecutionPlan.from_json(plan.to_json())
    assert again == plan and again.digest() == plan.digest()
    with pytest.raises(ValueError, match="sum to 17"):
        plan.validate(17, 16)
    with pytest.raises(ValueError, match="global 15"):
        plan.validate(16, 15)
    with pytest.raises(ValueError, match="reuses a device"):
        ExecutionPlan(
            version=0, tp_groups=((0, 1), (1, 2)), layer_partition=((1, 1),), microbatches=(1,)
        ).validate(2, 1)
    with pytest.raises(ValueError, match="list of integers"):
        ExecutionPlan.from_json(
            '{"version":0,"tp_groups":[["a"]],"layer_partition":[[1]],"microbatches":[1]}'
        )


def test_progressive_replan_on_a_16_device_toy() -> None:
    state = _toy(d5=0.45, d12=0.0)  # slow device 5 in (dp0,pp2), dead device 12 in (dp1,pp2)
    plan = initial_plan(state, tp=2, pp=4, dp=2, global_microbatches=16)
    assert math.isinf(estimate_step_time(state, plan))
    new, decisions = progressive_replan(
        state, plan, expected_fault_duration_s=600.0, reconfig_costs=ReconfigCosts(tp_s=1.0, pp_s=2.0)
    )
    new.validate(16, 16)
    assert new.version == plan.version + 1 and new.digest() != plan.digest()
    assert new.group(0, 2) == (4,) and new.group(1, 2) == (13,)
    assert all(d not in (5, 12) for g in new.tp_groups for d in g)
    text = "\n".join(decisions)
    assert "group (dp1,pp2) 2 -> 1 devices, excluding device 12 (dead)" in text
    assert "group (dp0,pp2) 2 -> 1 devices, excluding device 5 (speed 0.45)" in text
    # Both replicas lost half of stage 2: one shared partition moves layers off it.
    assert len(set(new.layer_partition)) == 1 and new.layer_partition[0][2] < 4
    assert estimate_step_time(state, new) < estimate_step_time(_toy(), plan) * 1.5
    # Replanning the same state again changes nothing.
    same, again = progressive_replan(
        state, new, expected_fault_duration_s=600.0, reconfig_costs=ReconfigCosts(tp_s=1.0, pp_s=2.0)
    )
    assert same is new and again[-1] == "no change"


def test_gate_blocks_costly_steps_but_dp_still_rebalances() -> None:
    state = _toy(d5=0.45)
    plan = initial_plan(state, tp=2, pp=4, dp=2, global_microbatches=16)
    new, decisions = progressive_replan(
        state, plan, expected_fault_duration_s=60.0, reconfig_costs=ReconfigCosts(tp_s=1e4, pp_s=1e4)
    )
    assert new.tp_groups == plan.tp_groups and new.layer_partition == plan.layer_partition
    assert new.microbatches[0] < new.microbatches[1] and sum(new.microbatches) == 16
    assert any(d.startswith("TP: kept group (dp0,pp2)") for d in decisions)
    assert estimate_step_time(state, new) < estimate_step_time(state, plan)


def test_a_replica_without_a_feasible_tp_group_is_dropped() -> None:
    state = ClusterState(speeds=_speeds(4, d2=0.0), layer_costs=(0.1,) * 4, num_heads=8)
    plan = initial_plan(state, tp=1, pp=2, dp=2, global_microbatches=8)
    new, decisions = progressive_replan(
        state, plan, expected_fault_duration_s=600.0, reconfig_costs=ReconfigCosts(tp_s=1.0, pp_s=1.0)
    )
    assert new.num_replicas == 1 and new.microbatches == (8,) and new.tp_groups == ((0,), (1,))
    assert decisions[0].startswith("DP: dropping replica dp1")


def test_memory_keeps_tp_from_shrinking_below_what_the_stage_needs() -> None:
    # Each stage holds 4 layers of 10 B; one device holds 25 B, so TP 2 -> 1 would OOM.
    state = ClusterState(
        speeds=_speeds(8, d1=0.3),
        layer_costs=(0.1,) * 8,
        num_heads=8,
        layer_bytes=(10.0,) * 8,
        memory_bytes=25.0,
    )
    plan = initial_plan(state, tp=2, pp=2, dp=2, global_microbatches=8)
    new, _ = progressive_replan(
        state, plan, expected_fault_duration_s=1e6, reconfig_costs=ReconfigCosts(tp_s=0.0, pp_s=0.0)
    )
    assert new.group(0, 0) == (0, 1)
    assert all(n * 10.0 <= 2 * 25.0 for p in new.layer_partition for n in p)
