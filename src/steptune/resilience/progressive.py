"""ResiHP's progressive TP -> PP -> DP adaptation, as one pure function over an ExecutionPlan.

``progressive_replan`` tries TP exclusion, then a PP repartition, then DP microbatch counts, each behind the
``should_apply`` ski-rental gate on the step-time model of ``steptime``, and returns one line per decision.
Contract: nothing here touches torch.distributed and the arguments are never mutated; the result is the
input plan itself if nothing changed, else a new plan with version + 1. Heuristic: the PP candidate set
and the per-group greedy TP gating (each step uses the exact planner of its axis).
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Sequence
from dataclasses import dataclass

from steptune.resilience.plan import (
    _REL,
    ClusterState,
    ExecutionPlan,
    ReconfigCosts,
    StageMemory,
    water_fill,
)
from steptune.resilience.planners import plan_pp, plan_tp, should_apply
from steptune.resilience.steptime import _Groups, _rebalance, _step_time

__all__ = ["progressive_replan"]


def _min_degree(state: ClusterState, part: Sequence[int], stage: int) -> int:
    start = sum(part[:stage])
    nbytes = sum(state.layer_bytes[start : start + part[stage]])
    if nbytes == 0 or math.isinf(state.memory_bytes):
        return 1
    return max(1, math.ceil(nbytes / state.memory_bytes * (1 - _REL)))


def _live_members(
    state: ClusterState, group: tuple[int, ...], part: Sequence[int], stage: int
) -> tuple[int, ...]:
    """steptune's TP step: keep every live member (uneven shares absorb slowness; a member too slow for
    one unit gets none). Raises ValueError if none is left or the survivors cannot hold the stage."""
    live = tuple(d for d in group if state.speeds[d] > 0)
    start = sum(part[:stage])
    nbytes = sum(state.layer_bytes[start : start + part[stage]])
    if not live or nbytes > state.group_capacity(live) * (1 + _REL):
        raise ValueError(f"{len(live)} live member(s) cannot hold the stage's {nbytes:.3g} bytes")
    return live


def _layers_moved(old: Sequence[int], new: Sequence[int]) -> int:
    def owner(p: Sequence[int]) -> list[int]:
        return [s for s, n in enumerate(p) for _ in range(n)]

    return sum(a != b for a, b in zip(owner(old), owner(new), strict=True))


def _not_worth(t0: float, t1: float, cost: float, dur: float) -> str:
    return f"would cut the step {t0:.4g} -> {t1:.4g} s: not worth {cost:.4g} s over {dur:.4g} s"


def _who(d: int, speeds: Sequence[float]) -> str:
    return f"device {d} ({'dead' if speeds[d] <= 0 else f'speed {speeds[d]:.2f}'})"


@dataclass(kw_only=True, slots=True)
class _Work:
    """The plan being built; replicas may be dropped, ``ids`` keeps their original indices."""

    ids: list[int]
    tp: _Groups
    part: list[tuple[int, ...]]
    mb: list[int]
    total: int
    per_replica: bool = False
    """Also consider a partition per replica (needs layer-wise DP gradient sync)."""

    def step(
        self, state: ClusterState, tp: _Groups | None = None, part: list[tuple[int, ...]] | None = None
    ) -> float:
        return _rebalance(
            state, self.tp if tp is None else tp, self.part if part is None else part, self.total
        )[1]


def _tp_step(state: ClusterState, w: _Work, dur: float, costs: ReconfigCosts, log: list[str]) -> None:
    sp = state.speeds

    def dead(g: tuple[int, ...]) -> bool:
        return any(sp[d] <= 0 for d in g)

    jobs = [(r0, s) for r, r0 in enumerate(w.ids) for s in range(len(w.tp[r]))]
    # Groups holding a dead device first: until they change every plan is infinitely slow.
    for r0, s in sorted(jobs, key=lambda j: (not dead(w.tp[w.ids.index(j[0])][j[1]]), j)):
        if r0 not in w.ids:
            continue
        r = w.ids.index(r0)
        g, name = w.tp[r][s], f"group (dp{r0},pp{s})"
        try:
            if state.tp_shares:
                new = _live_members(state, g, w.part[r], s)
            else:
                new = plan_tp(g, sp, num_heads=state.num_heads, min_degree=_min_degree(state, w.part[r], s))
        except ValueError as e:
            if not dead(g):
                raise
            log.append(f"DP: dropping replica dp{r0}: {name} lost a device and {e}")
            del w.ids[r], w.tp[r], w.part[r], w.mb[r]
            if not w.ids:
                raise ValueError(
                    "no DP replica survives; replace devices and restart from a checkpoint"
                ) from e
            continue
        if new == g:
            continue
        cand = [list(x) for x in w.tp]
        cand[r][s] = new
        gone = ", ".join(_who(d, sp) for d in g if d not in new)
        what = f"{len(g)} -> {len(new)} devices, excluding {gone}"
        if dead(g):
            w.tp = cand
            log.append(f"TP: {name} {what} (forced)")
            continue
        t0, t1 = w.step(state), w.step(state, tp=cand)
        if should_apply(t0, t1, dur, costs.tp_s):
            w.tp = cand
            log.append(f"TP: {name} {what}; step {t0:.4g} -> {t1:.4g} s")
        else:
            log.append(f"TP: kept {name}: {what} {_not_worth(t0, t1, costs.tp_s, dur)}")


def _pp_step(state: ClusterState, w: _Work, dur: float, costs: ReconfigCosts, log: list[str]) -> None:
    speeds = [[state.group_throughput(g) for g in groups] for groups in w.tp]
    caps = [[state.group_capacity(g) for g in groups] for groups in w.tp]

    def mem(c: Sequence[float]) -> StageMemory | None:
        if math.isinf(state.memory_bytes):
            return None
        return StageMemory(layer_bytes=state.layer_bytes, capacity=tuple(c))

    # A shared partition must fit every replica's stage and is paced, per stage, by the slowest replica.
    shared_mem = mem([min(c) for c in zip(*caps, strict=True)])
    options = []
    cur = w.part[0] if len(set(w.part)) == 1 else None
    shared_speeds = tuple(min(x) for x in zip(*speeds, strict=True))
    for v in dict.fromkeys([shared_speeds, *map(tuple, speeds)]):  # distinct, in order
        with contextlib.suppress(ValueError):  # memory may admit no shared partition
            options.append(plan_pp(state.layer_costs, v, memory=shared_mem, prefer=cur))
    if cur is not None:
        options.append(cur)  # fits: step 1 kept every stage within its memory
    cands = [[o] * len(w.tp) for o in options]
    if w.per_replica and len(w.tp) > 1:
        with contextlib.suppress(ValueError):
            own = [
                plan_pp(state.layer_costs, v, memory=mem(c), prefer=p)
                for v, c, p in zip(speeds, caps, w.part, strict=True)
            ]
            if own not in cands:
                cands.append(own)
    if cands:
        # Prefer the current partition on ties: moving layers is never free.
        new = min(cands, key=lambda c: (w.step(state, part=c), c != w.part, c))
    else:
        new = [
            plan_pp(state.layer_costs, v, memory=mem(c), prefer=p)
            for v, c, p in zip(speeds, caps, w.part, strict=True)
        ]
    if new == w.part:
        return
    moved = max(_layers_moved(a, b) for a, b in zip(w.part, new, strict=True))
    cost = costs.pp_s + costs.pp_per_layer_s * moved
    t0, t1 = w.step(state), w.step(state, part=new)
    if len(set(new)) == 1:
        what = f"{w.part[0]} -> {new[0]} on all replicas"
    else:
        what = "per replica: " if w.per_replica else "per replica (memory admits no shared partition): "
        what += ", ".join(f"dp{i} {p}" for i, p in zip(w.ids, new, strict=True))
    if should_apply(t0, t1, dur, cost):
        w.part = new
        log.append(f"PP: {what}, {moved} layers move; step {t0:.4g} -> {t1:.4g} s")
    else:
        log.append(f"PP: kept {w.part[0]}: {what} {_not_worth(t0, t1, cost, dur)}")


def _dp_step(state: ClusterState, w: _Work, dur: float, costs: ReconfigCosts, log: list[str]) -> None:
    new, t1 = _rebalance(state, w.tp, w.part, w.total)
    lost = sum(w.mb) != w.total  # a dropped replica's microbatches must go somewhere
    t0 = math.inf if lost else _step_time(state, w.tp, w.part, w.mb)
    if new == w.mb or t1 >= t0:
        return  # equal step time: a different tie is no change worth making
    what = f"microbatches {tuple(w.mb)} -> {tuple(new)} on replicas {', '.join(f'dp{i}' for i in w.ids)}"
    if lost or should_apply(t0, t1, dur, costs.dp_s):
        w.mb = new
        log.append(f"DP: {what}; step {t0:.4g} -> {t1:.4g} s")
    else:
        log.append(f"DP: kept {what} {_not_worth(t0, t1, costs.dp_s, dur)}")


def progressive_replan(
    state: ClusterState,
    plan: ExecutionPlan,
    *,
    expected_fault_duration_s: float,
    reconfig_costs: ReconfigCosts,
    per_replica_partitions: bool = False,
) -> tuple[ExecutionPlan, list[str]]:
    """ResiHP's scheduler: TP exclusion, then PP repartition, then DP counts, each behind ``should_apply``.

    Each gate compares modelled step times after the (nearly free) DP rebalance, with and without
    the step. Step 1 (TP): per group, ``plan_tp`` under the memory floor of its current layers; groups
    holding a dead device go first and are forced, and one with no feasible degree drops its replica.
    Step 2 (PP): one partition for all replicas, the best modelled among the current one and
    ``plan_pp`` for the per-stage slowest speeds and for each replica's speeds; per-replica partitions
    only when memory admits no shared one, or, with ``per_replica_partitions`` (a runtime whose DP
    gradient sync is per layer, not per stage), when one per replica models faster. Step 3 (DP):
    exact counts for equal microbatches (the runtime assigns concrete microbatches with ``plan_dp``
    and ``migrate``).
    Returns the plan with version + 1 (the input plan itself if nothing changed) and one line per decision.
    """
    total = sum(plan.microbatches)
    plan.validate(state.num_layers, total)
    if max(d for g in plan.tp_groups for d in g) >= len(state.speeds):
        raise ValueError(f"plan uses device ids beyond the {len(state.speeds)} speeds in the cluster state")
    w = _Work(
        ids=list(range(plan.num_replicas)),
        tp=[[plan.group(r, s) for s in range(plan.num_stages)] for r in range(plan.num_replicas)],
        part=list(plan.layer_partition),
        mb=list(plan.microbatches),
        total=total,
        per_replica=per_replica_partitions,
    )
    log: list[str] = []
    for step in (_tp_step, _pp_step, _dp_step):
        step(state, w, expected_fault_duration_s, reconfig_costs, log)
    groups = tuple(g for gs in w.tp for g in gs)
    shares = None
    if state.tp_shares:
        counts = tuple(water_fill(g, state.speeds, state.num_heads) for g in groups)
        if any(len(set(c)) > 1 for c in counts):
            shares = counts
            log.append("TP shares (units per member): " + ", ".join(
                f"{g} {c}" for g, c in zip(groups, counts, strict=True) if len(set(c)) > 1
            ))  # fmt: skip
    if (groups, tuple(w.part), tuple(w.mb), shares) == (
        plan.tp_groups, plan.layer_partition, plan.microbatches, plan.tp_shares
    ):  # fmt: skip
        return plan, [*log, "no change"]
    out = ExecutionPlan(
        version=plan.version + 1, tp_groups=groups, layer_partition=tuple(w.part), microbatches=tuple(w.mb),
        tp_shares=shares,
    )  # fmt: skip
    out.validate(state.num_layers, total)
    assert all(state.speeds[d] > 0 for g in groups for d in g), "planner left a dead device in the plan"
    return out, log
