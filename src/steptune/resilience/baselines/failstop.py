"""Fail-stop baselines: ReCycle (reroute to DP peers) and Oobleck (node loss, pipeline templates)."""

from __future__ import annotations

import math
from dataclasses import replace

from steptune.resilience.baselines._common import _INF, _dead, _stage_costs
from steptune.resilience.plan import ClusterState, ExecutionPlan, StageMemory
from steptune.resilience.planners import plan_pp
from steptune.resilience.policies import Memoized, restart_plan
from steptune.resilience.sim import Decision, SimContext, dp_sync_s, pipeline_time, reconfig_cost
from steptune.resilience.steptime import rebalanced

__all__ = ["Oobleck", "ReCycle", "oobleck_reinstantiate", "rebuilds", "recycle_step_time"]


# ReCycle -----------------------------------------------------------------------------------------


class ReCycle:
    """Reroute a failed stage worker's microbatches to its DP peers; bubbles absorb the extra work."""

    name = "recycle"
    detect_slow_steps = _INF

    def __init__(self, *, absorb: float = 1.0, detect_stop_steps: float = 2.0) -> None:
        if not 0 <= absorb <= 1:
            raise ValueError(f"absorb {absorb} is the usable fraction of bubble time: use 0..1")
        self.absorb = absorb
        self.detect_stop_steps = detect_stop_steps
        self.reset()

    def reset(self) -> None:
        self._known: frozenset[int] = frozenset()
        self._cache: dict[tuple[ExecutionPlan, tuple[float, ...]], float] = {}

    def on_step(
        self,
        t: float,
        step: int,
        observed: tuple[float, ...],
        plan: ExecutionPlan,
        state: ClusterState,
        ctx: SimContext,
    ) -> Decision:
        dead = _dead(plan, observed)
        if dead == self._known:
            return Decision(plan)
        self._known = dead
        if any(not self._alive_replicas(plan, s, observed) for s in range(plan.num_stages)):
            # Every DP peer of some stage is gone: nothing to reroute to. Restart from a checkpoint.
            new = restart_plan(plan, observed)
            if new is None:
                return Decision(plan)
            self._known = frozenset()
            return Decision(new, ctx.job.restart_cost_s, restart=True)
        # A new adaptive schedule (precomputed by ReCycle's planner) and rerouted P2P: one safe point.
        return Decision(replace(plan, version=plan.version + 1), ctx.job.reconfig.pp_s)

    @staticmethod
    def _alive_replicas(plan: ExecutionPlan, s: int, speeds: tuple[float, ...]) -> list[int]:
        return [r for r in range(plan.num_replicas) if all(speeds[d] > 0 for d in plan.group(r, s))]

    def step_time(self, plan: ExecutionPlan, speeds: tuple[float, ...], ctx: SimContext) -> float:
        if not _dead(plan, speeds) <= self._known:
            return _INF  # a failure ReCycle has not reacted to yet: the step cannot finish
        key = (plan, tuple(speeds))
        if key not in self._cache:
            self._cache[key] = self._step(plan, speeds, ctx)
        return self._cache[key]

    def _step(self, plan: ExecutionPlan, speeds: tuple[float, ...], ctx: SimContext) -> float:
        return recycle_step_time(plan, speeds, ctx, absorb=self.absorb)


def recycle_step_time(
    plan: ExecutionPlan, speeds: tuple[float, ...], ctx: SimContext, *, absorb: float = 1.0
) -> float:
    """ReCycle's step with every dead stage worker's microbatches rerouted to its DP peers."""
    if not _dead(plan, speeds):
        return ctx.step_time(plan, speeds)  # nothing rerouted: the plain 1F1B step
    num_r, num_s = plan.num_replicas, plan.num_stages
    alive = [ReCycle._alive_replicas(plan, s, speeds) for s in range(num_s)]
    if any(not a for a in alive):
        return _INF
    costs = [_stage_costs(plan, r, speeds, ctx) for r in range(num_r)]
    # Microbatches of dead stage workers, shared evenly by the surviving peers of that stage.
    extra = [
        sum(plan.microbatches[r] for r in range(num_r) if r not in alive[s]) / len(alive[s])
        for s in range(num_s)
    ]
    out = 0.0
    for r in range(num_r):
        f = list(costs[r][0])
        b = list(costs[r][1])
        w = list(costs[r][2])
        # A dead stage's work for r's own microbatches runs on peers: price it at their mean.
        for s in range(num_s):
            if math.isinf(f[s]):
                for mine, k in ((f, 0), (b, 1), (w, 2)):
                    mine[s] = sum(costs[p][k][s] for p in alive[s]) / len(alive[s])
        m = plan.microbatches[r]
        if m == 0:
            continue
        # Rerouted microbatches' F and input-gradient B run in the peer's steady state (stretching
        # its per-microbatch time); their weight gradients W are deferred into the bubbles.
        e = [extra[s] if r in alive[s] else 0.0 for s in range(num_s)]
        fs = [f[s] * (m + e[s]) / m for s in range(num_s)]
        bs = [(m * (b[s] + w[s]) + e[s] * b[s]) / m for s in range(num_s)]
        base = pipeline_time(fs, bs, m)
        over = 0.0
        for s in range(num_s):
            if e[s] > 0:
                idle = base - m * (fs[s] + bs[s])
                over = max(over, e[s] * w[s] - absorb * idle)
        out = max(out, base + over)
    return out + dp_sync_s(plan, speeds, ctx)


# Oobleck -----------------------------------------------------------------------------------------


class Oobleck(Memoized):
    """Node-granular loss, pipeline re-instantiated from a template, batch redistributed."""

    name = "oobleck"
    detect_slow_steps = _INF

    def __init__(self, *, detect_stop_steps: float = 2.0) -> None:
        self.detect_stop_steps = detect_stop_steps
        super().__init__()

    def _decide(
        self, observed: tuple[float, ...], plan: ExecutionPlan, state: ClusterState, ctx: SimContext
    ) -> Decision:
        dead = _dead(plan, observed)
        new = oobleck_reinstantiate(plan, state, dead, ctx.gpus_per_node) if dead else None
        if new is None:
            return Decision(plan)
        return Decision(new, reconfig_cost(plan, new, ctx.job.reconfig))


def rebuilds(
    plan: ExecutionPlan,
    state: ClusterState,
    dead: frozenset[int],
    gpus_per_node: int,
    *,
    all_but_one: bool = False,
) -> list[ExecutionPlan]:
    """Oobleck's rebuilds of the replicas ``dead`` hits, dropping whole nodes (its own rule) or only the dead
    devices; with ``all_but_one`` also each variant that leaves one hit replica as it is (its dead workers
    for rerouting to price)."""
    keeps = [dead]
    if all_but_one:
        devs = [
            {d for s in range(plan.num_stages) for d in plan.group(r, s)} for r in range(plan.num_replicas)
        ]
        hit = [r for r in range(plan.num_replicas) if dead & devs[r]]
        keeps += [dead - devs[r] for r in hit if len(hit) > 1]
    out = []
    for rebuilt in keeps:
        for per_node in {gpus_per_node, 1}:
            if (c := oobleck_reinstantiate(plan, state, frozenset(rebuilt), per_node)) is not None:
                out.append(c)
    return out


def oobleck_reinstantiate(
    plan: ExecutionPlan, state: ClusterState, dead: frozenset[int], gpus_per_node: int
) -> ExecutionPlan | None:
    """Drop the nodes holding ``dead`` devices; rebuild each hit replica from a template; rebalance."""
    lost_nodes = {d // gpus_per_node for d in dead}
    num_s = plan.num_stages
    groups: list[tuple[int, ...]] = []
    parts: list[tuple[int, ...]] = []
    for r in range(plan.num_replicas):
        mine = [plan.group(r, s) for s in range(num_s)]
        devs = [d for g in mine for d in g if d // gpus_per_node not in lost_nodes]
        if len(devs) == sum(len(g) for g in mine):
            groups += mine
            parts.append(plan.layer_partition[r])
            continue
        k = 1 << max(0, (len(devs) // num_s).bit_length() - 1) if len(devs) >= num_s else 0
        while k >= 1:
            if state.num_heads % k == 0:
                mem = None
                if math.isfinite(state.memory_bytes):
                    mem = StageMemory(
                        layer_bytes=state.layer_bytes, capacity=(k * state.memory_bytes,) * num_s
                    )
                try:
                    part = plan_pp(state.layer_costs, [float(k)] * num_s, memory=mem)
                except ValueError:
                    break  # a smaller degree has less memory: the template does not fit
                groups += [tuple(devs[s * k : (s + 1) * k]) for s in range(num_s)]
                parts.append(part)
                break
            k //= 2
    if not parts:
        return None
    total = sum(plan.microbatches)
    q, rem = divmod(total, len(parts))
    new = ExecutionPlan(
        version=plan.version + 1,
        tp_groups=tuple(groups),
        layer_partition=tuple(parts),
        microbatches=tuple(q + (i < rem) for i in range(len(parts))),
    )
    out = rebalanced(state, new)
    return replace(out, version=plan.version + 1)
