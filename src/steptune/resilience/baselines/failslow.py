"""Fail-slow baselines: Greyhound, Adaptra, the strengthened fail-stop systems, Malleus-lite."""

from __future__ import annotations

from dataclasses import replace

from steptune.resilience.baselines._common import _INF, Price, _dead, _stage_costs
from steptune.resilience.baselines.failstop import Oobleck, ReCycle
from steptune.resilience.plan import ClusterState, ExecutionPlan, ReconfigCosts
from steptune.resilience.policies import CheckpointRestart, Memoized, restart_plan
from steptune.resilience.progressive import progressive_replan
from steptune.resilience.replans import uniform_repartition
from steptune.resilience.sim import (
    Decision,
    SimContext,
    dp_sync_s,
    improve_counts,
    reconfig_cost,
    rescheduled_time,
    runs_slow,
)

__all__ = ["Adaptra", "Greyhound", "MalleusLite", "Strengthened", "adaptra_step_time"]


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
            new = improve_counts(plan, price)
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
            new = improve_counts(plan, price)
            return (new if new != plan else None), ctx.job.reconfig.dp_s, False
        if what == "pp":
            cand = uniform_repartition(state, plan)
            if cand is None:
                return None, 0.0, False
            cand = improve_counts(cand, price)
            return cand, reconfig_cost(plan, cand, ctx.job.reconfig), False
        # S4: restart from the checkpoint without the replica(s) holding the slowest device.
        # The per-device view (a slow link shows as a slow device); link factors stay as they are.
        seen = state.speeds
        slow = min(seen[d] for g in plan.tp_groups for d in g)
        n = len(seen)
        drop = tuple(0.0 if seen[d] <= slow else observed[d] for d in range(n)) + observed[n:]
        cand = restart_plan(plan, drop)
        if cand is None:
            return None, 0.0, True
        return improve_counts(cand, price), ctx.job.restart_cost_s, True


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
        self._adapted = runs_slow(plan, state)  # incl. slow links
        return Decision(plan)

    def step_time(self, plan: ExecutionPlan, speeds: tuple[float, ...], ctx: SimContext) -> float:
        if _dead(plan, speeds):
            return _INF
        if not self._adapted:
            return ctx.step_time(plan, speeds)
        return adaptra_step_time(plan, speeds, ctx, max_extra=self.max_extra)


def adaptra_step_time(
    plan: ExecutionPlan, speeds: tuple[float, ...], ctx: SimContext, *, max_extra: int = 3
) -> float:
    """Adaptra's rescheduled step (no device, layer or batch change): per replica the best of 1F1B and
    warm-ups up to ``max_extra`` microbatches deeper, plus the DP sync."""
    if _dead(plan, speeds):
        return _INF
    out = 0.0
    for r in range(plan.num_replicas):
        f, b, w = _stage_costs(plan, r, speeds, ctx)
        fb = tuple(x + y for x, y in zip(b, w, strict=True))
        out = max(out, rescheduled_time(tuple(f), fb, plan.microbatches[r], max_extra))
    return out + dp_sync_s(plan, speeds, ctx)


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
            self._memo[key] = improve_counts(plan, price) if visible or healthy else plan
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
