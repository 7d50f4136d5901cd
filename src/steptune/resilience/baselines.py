"""Baseline recovery policies for the cluster simulator, re-implemented from their papers. SIMULATED.

Each is a ``sim.Policy``; docs/resilience.md lists every fidelity choice. In brief:

- ``ReCycle`` (SOSP'24): a fail-stop loses the whole stage worker (its TP group); the stage's
  microbatches are rerouted to the same stage of the DP peers. Their forward and input-gradient
  work runs in the peers' steady state; the weight gradients are deferred into the 1F1B bubbles
  (decoupled backprop) up to ``absorb`` x the idle time. A stage with no surviving peer forces a
  checkpoint restart. Blind to fail-slow.
- ``Oobleck`` (SOSP'23): node-granular loss (the failed device's whole node leaves), the hit pipeline
  is re-instantiated from a template on its remaining devices (same stages, the largest power-of-two
  TP degree that fits heads and memory, a balanced partition), the global batch is redistributed by
  pipeline throughput. Blind to fail-slow.
- ``Greyhound`` (ATC'25, FALCON): change-point detection on iteration time (sees a fail-slow only if
  it raises the step by >= 10%), validation stalls on false alarms, ski-rental escalation S1 ignore ->
  S2 DP microbatch redistribution -> S3 layer repartition -> S4 checkpoint restart without the slow
  replica. Fail-stop: checkpoint restart (it is not a fail-stop system).
- ``Adaptra``: on a detected slowdown, re-schedules the pipeline (deeper warm-up so upstream stages
  keep working through a slow stage's delays); no device, layer or batch changes. Fail-stop: restart.
- ``Strengthened``: ReCycle or Oobleck for fail-stop plus Greyhound's detection and DP
  redistribution for fail-slow (the "strengthened" baselines of the ResiHP paper).
- ``MalleusLite``: on every change, an asynchronous full re-plan (device grouping, layer partition,
  batch counts: ResiHP's planner from the first plan with no ski-rental gate) that lands
  ``planning_s`` after detection; fail-stop: checkpoint restart.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from dataclasses import replace

from steptune.pipeline.costs import StageCosts
from steptune.pipeline.listsched import ListPolicy, list_schedule
from steptune.pipeline.simulate import simulate
from steptune.resilience.plan import (
    ClusterState,
    ExecutionPlan,
    ReconfigCosts,
    StageMemory,
    plan_pp,
    progressive_replan,
    rebalanced,
)
from steptune.resilience.sim import (
    CheckpointRestart,
    Decision,
    Memoized,
    Oracle,
    SimContext,
    pipeline_time,
    reconfig_cost,
    restart_plan,
)

__all__ = [
    "Adaptra",
    "Greyhound",
    "MalleusLite",
    "Oobleck",
    "ReCycle",
    "Strengthened",
    "adaptra_step_time",
    "baseline",
    "oracle",
    "recycle_step_time",
]

_INF = math.inf
Price = Callable[[ExecutionPlan], float]


def _dead(plan: ExecutionPlan, speeds: tuple[float, ...]) -> frozenset[int]:
    return frozenset(d for g in plan.tp_groups for d in g if speeds[d] <= 0)


def _stage_costs(
    plan: ExecutionPlan, r: int, speeds: tuple[float, ...], ctx: SimContext
) -> tuple[list[float], list[float], list[float]]:
    """Per stage of replica ``r``: F, B, W seconds of one microbatch (inf for a stage with a dead device)."""
    f, b, w, start = [], [], [], 0
    for s, n in enumerate(plan.layer_partition[r]):
        g = plan.group(r, s)
        v = len(g) * min(speeds[d] for d in g)
        sl = slice(start, start + n)
        for out, src in ((f, ctx.layer_f), (b, ctx.layer_b), (w, ctx.layer_w)):
            out.append(sum(src[sl]) / v if v > 0 else _INF)
        start += n
    return f, b, w


def _improve_counts(plan: ExecutionPlan, price: Price, *, max_moves: int = 256) -> ExecutionPlan:
    """Greedy DP redistribution: move one microbatch at a time from a replica to another while the
    priced step time drops (Greyhound S2 minimizes the spread of per-replica times the same way)."""
    best, best_t = plan, price(plan)
    for _ in range(max_moves):
        cands = []
        for src in range(best.num_replicas):
            if best.microbatches[src] == 0:
                continue
            for dst in range(best.num_replicas):
                if dst != src:
                    mb = list(best.microbatches)
                    mb[src] -= 1
                    mb[dst] += 1
                    cand = replace(best, microbatches=tuple(mb))
                    cands.append((price(cand), cand))
        if not cands:
            break
        t, cand = min(cands, key=lambda x: x[0])
        if t >= best_t * (1 - 1e-9):
            break
        best, best_t = cand, t
    return best if best == plan else replace(best, version=plan.version + 1)


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
        key = (plan, tuple(speeds[d] for g in plan.tp_groups for d in g))
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
    return out


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


# Greyhound ---------------------------------------------------------------------------------------


class Greyhound:
    """Fail-slow: BOCD on iteration time, then ski-rental escalation S2 -> S3 -> S4. Fail-stop: restart."""

    name = "greyhound"

    def __init__(
        self,
        *,
        detect_slow_steps: float = 2.0,
        detect_stop_steps: float = 2.0,
        level_change: float = 0.10,
        false_alarm_s_per_step: float = 0.0,
        stages: tuple[str, ...] = ("dp", "pp", "restart"),
    ) -> None:
        self.detect_slow_steps = detect_slow_steps
        self.detect_stop_steps = detect_stop_steps
        self.level_change = level_change
        self.false_alarm_s_per_step = false_alarm_s_per_step
        self.stages = stages
        self._restart = CheckpointRestart(detect_stop_steps=detect_stop_steps)
        self.reset()

    def reset(self) -> None:
        self._view: tuple[float, ...] | None = None
        self._onset = 0.0
        self._level = 0

    def on_step(
        self,
        t: float,
        step: int,
        observed: tuple[float, ...],
        plan: ExecutionPlan,
        state: ClusterState,
        ctx: SimContext,
    ) -> Decision:
        if _dead(plan, observed):
            self.reset()
            return self._restart.on_step(t, step, observed, plan, state, ctx)
        if observed != self._view:
            self._view, self._onset, self._level = observed, t, 0
        price: Price = lambda p: ctx.step_time(p, observed)  # noqa: E731
        t_now = price(plan)
        ones = tuple(1.0 for _ in observed)
        visible = t_now >= (1 + self.level_change) * ctx.step_time(plan, ones)
        if not visible and min(observed[d] for g in plan.tp_groups for d in g) >= 1.0:
            # Healthy again (the step fell back): S2 in reverse, free.
            new = _improve_counts(plan, price)
            return Decision(new) if new != plan else Decision(plan)
        if not visible:
            return Decision(plan)  # BOCD does not see a change under its level threshold
        while self._level < len(self.stages):
            what = self.stages[self._level]
            cand, cost, restart = self._candidate(what, plan, observed, state, ctx, price)
            t_new = price(cand) if cand is not None else _INF
            if cand is None or t_new >= t_now * (1 - 1e-9):
                self._level += 1  # this level cannot help: consider the next one
                continue
            # Ski rental: pay the slowdown until it has cost as much as the next strategy.
            rent = (t - self._onset) * (1 - t_new / t_now)
            if rent + 1e-9 < cost:
                return Decision(plan)
            self._level += 1
            self._onset = t
            assert cand is not None
            return Decision(cand, cost, restart=restart)
        return Decision(plan)

    def _candidate(
        self,
        what: str,
        plan: ExecutionPlan,
        observed: tuple[float, ...],
        state: ClusterState,
        ctx: SimContext,
        price: Price,
    ) -> tuple[ExecutionPlan | None, float, bool]:
        if what == "dp":
            new = _improve_counts(plan, price)
            return (new if new != plan else None), ctx.job.reconfig.dp_s, False
        if what == "pp":
            speeds = [
                min(
                    len(plan.group(r, s)) * min(observed[d] for d in plan.group(r, s))
                    for r in range(plan.num_replicas)
                )
                for s in range(plan.num_stages)
            ]
            mem = None
            if math.isfinite(state.memory_bytes):
                caps = tuple(
                    min(len(plan.group(r, s)) for r in range(plan.num_replicas)) * state.memory_bytes
                    for s in range(plan.num_stages)
                )
                mem = StageMemory(layer_bytes=state.layer_bytes, capacity=caps)
            try:
                part = plan_pp(state.layer_costs, speeds, memory=mem, prefer=plan.layer_partition[0])
            except ValueError:
                return None, 0.0, False
            cand = replace(plan, version=plan.version + 1, layer_partition=(part,) * plan.num_replicas)
            cand = _improve_counts(cand, price)
            return cand, reconfig_cost(plan, cand, ctx.job.reconfig), False
        # S4: restart from the checkpoint without the replica(s) holding the slowest device.
        slow = min(observed[d] for g in plan.tp_groups for d in g)
        drop = tuple(0.0 if observed[d] <= slow else observed[d] for d in range(len(observed)))
        cand = restart_plan(plan, drop)
        if cand is None:
            return None, 0.0, True
        return _improve_counts(cand, price), ctx.job.restart_cost_s, True


# Adaptra -----------------------------------------------------------------------------------------


class Adaptra:
    """Pipeline rescheduling around a detected slow stage; fail-stop: checkpoint restart."""

    name = "adaptra"

    def __init__(
        self, *, detect_slow_steps: float = 1.0, detect_stop_steps: float = 2.0, max_extra: int = 3
    ) -> None:
        self.detect_slow_steps = detect_slow_steps
        self.detect_stop_steps = detect_stop_steps
        self.max_extra = max_extra
        self._restart = CheckpointRestart(detect_stop_steps=detect_stop_steps)
        self.reset()

    def reset(self) -> None:
        self._adapted = False

    def on_step(
        self,
        t: float,
        step: int,
        observed: tuple[float, ...],
        plan: ExecutionPlan,
        state: ClusterState,
        ctx: SimContext,
    ) -> Decision:
        if _dead(plan, observed):
            return self._restart.on_step(t, step, observed, plan, state, ctx)
        self._adapted = min(observed[d] for g in plan.tp_groups for d in g) < 1.0
        return Decision(plan)

    def step_time(self, plan: ExecutionPlan, speeds: tuple[float, ...], ctx: SimContext) -> float:
        if _dead(plan, speeds):
            return _INF
        if not self._adapted:
            return ctx.step_time(plan, speeds)
        out = 0.0
        for r in range(plan.num_replicas):
            f, b, w = _stage_costs(plan, r, speeds, ctx)
            fb = tuple(x + y for x, y in zip(b, w, strict=True))
            out = max(out, self._replica(tuple(f), fb, plan.microbatches[r]))
        return out

    def _replica(self, f: tuple[float, ...], fb: tuple[float, ...], m: int) -> float:
        return _rescheduled(f, fb, m, self.max_extra)


@functools.lru_cache(maxsize=8192)
def _rescheduled(f: tuple[float, ...], fb: tuple[float, ...], m: int, max_extra: int) -> float:
    """Best of 1F1B and deeper warm-ups (list schedules) for one replica's stage times."""
    t = pipeline_time(f, fb, m)
    slowest = max(x + y for x, y in zip(f, fb, strict=True))
    fastest = min(x + y for x, y in zip(f, fb, strict=True))
    if m > 0 and slowest > fastest * (1 + 1e-9):  # equal stages: nothing to absorb
        n = len(f)
        zero = (0.0,) * n
        costs = StageCosts(f=f, i=fb, w=zero, act_bytes=zero, out_bytes=zero, static_bytes=zero)
        for extra in range(1, max_extra + 1):
            sched = list_schedule(
                costs, tuple(range(n)), m, ListPolicy(extra_inflight=extra, split_backward=False)
            )
            t = min(t, simulate(sched, costs, with_spans=False).makespan)
    return t


def adaptra_step_time(plan: ExecutionPlan, speeds: tuple[float, ...], ctx: SimContext) -> float:
    """Adaptra's rescheduled step (no device, layer or batch change)."""
    if _dead(plan, speeds):
        return _INF
    out = 0.0
    for r in range(plan.num_replicas):
        f, b, w = _stage_costs(plan, r, speeds, ctx)
        fb = tuple(x + y for x, y in zip(b, w, strict=True))
        out = max(out, _rescheduled(tuple(f), fb, plan.microbatches[r], 3))
    return out


def oracle() -> Oracle:
    """The bound for the bench: best plan, priced at the best of 1F1B, ReCycle's rerouting and
    Adaptra's rescheduling, every change seen at once and switched for free."""
    return Oracle(extra_prices=(recycle_step_time, adaptra_step_time))


# Strengthened ReCycle / Oobleck ------------------------------------------------------------------


class Strengthened:
    """A fail-stop baseline plus Greyhound's fail-slow detection and DP redistribution."""

    def __init__(
        self,
        inner: ReCycle | Oobleck,
        *,
        detect_slow_steps: float = 2.0,
        level_change: float = 0.10,
        false_alarm_s_per_step: float = 0.0,
    ) -> None:
        self.inner = inner
        self.name = f"strengthened-{inner.name}"
        self.detect_stop_steps = inner.detect_stop_steps
        self.detect_slow_steps = detect_slow_steps
        self.level_change = level_change
        self.false_alarm_s_per_step = false_alarm_s_per_step
        self._memo: dict[tuple[ExecutionPlan, tuple[float, ...]], ExecutionPlan] = {}

    def reset(self) -> None:
        self.inner.reset()
        self._memo = {}

    def _price(self, ctx: SimContext, speeds: tuple[float, ...]) -> Price:
        hook = getattr(self.inner, "step_time", None)
        if hook is None:
            return lambda p: ctx.step_time(p, speeds)
        return lambda p: float(hook(p, speeds, ctx))

    def step_time(self, plan: ExecutionPlan, speeds: tuple[float, ...], ctx: SimContext) -> float:
        return self._price(ctx, speeds)(plan)

    def on_step(
        self,
        t: float,
        step: int,
        observed: tuple[float, ...],
        plan: ExecutionPlan,
        state: ClusterState,
        ctx: SimContext,
    ) -> Decision:
        d = self.inner.on_step(t, step, observed, plan, state, ctx)
        if d.plan != plan or d.stall_s > 0:
            return d
        key = (plan, observed)
        if key not in self._memo:
            price = self._price(ctx, observed)
            ones = tuple(1.0 if x > 0 else 0.0 for x in observed)
            t_now = price(plan)
            visible = t_now >= (1 + self.level_change) * self._price(ctx, ones)(plan)
            healthy = all(observed[x] >= 1.0 or observed[x] <= 0 for g in plan.tp_groups for x in g)
            self._memo[key] = _improve_counts(plan, price) if visible or healthy else plan
        new = self._memo[key]
        return Decision(new, ctx.job.reconfig.dp_s if new != plan else 0.0)


# Malleus-lite ------------------------------------------------------------------------------------


class MalleusLite(Memoized):
    """Asynchronous full re-plan on every change of the measured straggling rates; fail-stop: restart."""

    name = "malleus-lite"

    def __init__(
        self, *, planning_s: float = 30.0, detect_slow_steps: float = 1.0, detect_stop_steps: float = 2.0
    ) -> None:
        self.detect_slow_steps = detect_slow_steps
        self.detect_slow_delay_s = planning_s
        self.detect_stop_steps = detect_stop_steps
        super().__init__()

    def _decide(
        self, observed: tuple[float, ...], plan: ExecutionPlan, state: ClusterState, ctx: SimContext
    ) -> Decision:
        if _dead(plan, observed):
            new = restart_plan(plan, observed)
            return Decision(plan) if new is None else Decision(new, ctx.job.restart_cost_s, restart=True)
        alive_base = all(observed[d] > 0 for g in ctx.base_plan.tp_groups for d in g)
        try:
            new = progressive_replan(
                state,
                ctx.base_plan if alive_base else plan,
                expected_fault_duration_s=_INF,
                reconfig_costs=ReconfigCosts(tp_s=0.0, pp_s=0.0),
            )[0]
        except ValueError:
            return Decision(plan)
        if ctx.step_time(new, observed) >= ctx.step_time(plan, observed) * (1 - 1e-9):
            return Decision(plan)
        new = replace(new, version=plan.version + 1)
        return Decision(new, reconfig_cost(plan, new, ctx.job.reconfig))


def baseline(name: str, **kwargs: float) -> object:
    """A fresh baseline policy by name (see ``BASELINES``)."""
    makers: dict[str, Callable[[], object]] = {
        "recycle": lambda: ReCycle(**kwargs),
        "oobleck": lambda: Oobleck(**kwargs),
        "greyhound": lambda: Greyhound(**kwargs),
        "adaptra": lambda: Adaptra(**kwargs),
        "strengthened-recycle": lambda: Strengthened(ReCycle(), **kwargs),
        "strengthened-oobleck": lambda: Strengthened(Oobleck(), **kwargs),
        "malleus-lite": lambda: MalleusLite(**kwargs),
    }
    if name not in makers:
        raise ValueError(f"unknown baseline {name!r}; choose one of {sorted(makers)}")
    return makers[name]()
