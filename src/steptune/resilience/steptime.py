"""The step-time model that prices an ``ExecutionPlan``.

A replica running ``m >= 1`` microbatches takes ``sum_s t_s + (m - 1) * max_s t_s`` (1F1B fill/drain, then
the bottleneck stage paces the steady state), where ``t_s`` is stage ``s``'s layer cost over its TP group's
throughput; the step is the slowest replica (synchronous DP). A stage on a dead device, or one whose layers
do not fit its group's memory, costs inf. ``estimate_step_time`` and ``rebalanced`` price plans with it;
microbatch counts for equal costs are exact (``_rebalance``). Pure functions, like ``planners``.
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Sequence
from dataclasses import replace

from steptune.resilience.plan import _REL, ClusterState, ExecutionPlan

__all__ = ["estimate_step_time", "rebalanced"]

_Groups = list[list[tuple[int, ...]]]


def _stage_times(state: ClusterState, groups: Sequence[tuple[int, ...]], part: Sequence[int]) -> list[float]:
    out, start = [], 0
    for g, n in zip(groups, part, strict=True):
        speed = state.group_throughput(g)
        fits = sum(state.layer_bytes[start : start + n]) <= state.group_capacity(g) * (1 + _REL)
        out.append(sum(state.layer_costs[start : start + n]) / speed if speed > 0 and fits else math.inf)
        start += n
    return out


def _step_time(state: ClusterState, tp: _Groups, part: Sequence[Sequence[int]], mb: Sequence[int]) -> float:
    out = 0.0
    for groups, p, m in zip(tp, part, mb, strict=True):
        t = _stage_times(state, groups, p)
        if math.isinf(max(t)):
            return math.inf  # a dead device or an OOM stage: the plan cannot run at all
        out = max(out, sum(t) + (m - 1) * max(t) if m > 0 else 0.0)
    return out


def _rebalance(
    state: ClusterState, tp: _Groups, part: Sequence[Sequence[int]], total: int
) -> tuple[list[int], float]:
    """Optimal counts for equal microbatches (take the earliest finish slot each time), and the step."""
    times = [_stage_times(state, g, p) for g, p in zip(tp, part, strict=True)]
    if any(math.isinf(max(t)) for t in times):
        return [0] * len(tp), math.inf
    counts = [0] * len(tp)
    heap = [(sum(t), r) for r, t in enumerate(times)]
    heapq.heapify(heap)
    for _ in range(total):
        _, r = heapq.heappop(heap)
        counts[r] += 1
        heapq.heappush(heap, (sum(times[r]) + counts[r] * max(times[r]), r))
    return counts, _step_time(state, tp, part, counts)


def estimate_step_time(state: ClusterState, plan: ExecutionPlan) -> float:
    """Modelled step time of ``plan`` (module docstring); inf if a stage cannot run: a dead device with
    work (every member under k x min p; one holding units under ``tp_shares``) or a stage that OOMs."""
    tp = [[plan.group(r, s) for s in range(plan.num_stages)] for r in range(plan.num_replicas)]
    return _step_time(state, tp, plan.layer_partition, plan.microbatches)


def rebalanced(state: ClusterState, plan: ExecutionPlan) -> ExecutionPlan:
    """``plan`` with the microbatch counts that minimize the modelled step (same version if unchanged)."""
    tp = [[plan.group(r, s) for s in range(plan.num_stages)] for r in range(plan.num_replicas)]
    counts, t = _rebalance(state, tp, plan.layer_partition, sum(plan.microbatches))
    if tuple(counts) == plan.microbatches or math.isinf(t):
        return plan
    return replace(plan, version=plan.version + 1, microbatches=tuple(counts))
