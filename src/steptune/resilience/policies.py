"""The simulator's own recovery policies: no-op, checkpoint-restart and ResiHP (SIMULATED).

Each is a :class:`~steptune.resilience.sim.Policy`: at every step boundary it sees the device speeds it
has detected and returns a :class:`~steptune.resilience.sim.Decision` (a plan and the stall it pays).
``Memoized`` caches the simulator's step-time prices per (plan, speeds); ``try_replan`` is ResiHP's
progressive TP -> PP -> DP replan with its gate, shared with steptune's policy and the oracle. The
re-implemented baselines (ReCycle, Oobleck, Greyhound, Adaptra, ...) live in ``baselines/``.
"""

from __future__ import annotations

import math
from dataclasses import replace

from steptune.resilience.plan import ClusterState, ExecutionPlan, ReconfigCosts
from steptune.resilience.planners import should_apply
from steptune.resilience.progressive import progressive_replan
from steptune.resilience.sim import Decision, SimContext, SimJob, reconfig_cost
from steptune.resilience.simload import PREDICTION_SIGMA
from steptune.resilience.steptime import rebalanced

__all__ = ["CheckpointRestart", "Memoized", "NoOp", "ResiHPPolicy", "restart_plan", "try_replan"]


class NoOp:
    """Never adapts: a fail-stop halts the job for good, a fail-slow slows every step."""

    name = "noop"
    detect_stop_steps = math.inf
    detect_slow_steps = math.inf

    def on_step(
        self,
        t: float,
        step: int,
        observed: tuple[float, ...],
        plan: ExecutionPlan,
        state: ClusterState,
        ctx: SimContext,
    ) -> Decision:
        return Decision(plan)


class CheckpointRestart:
    """On a detected fail-stop: restart from the last checkpoint without the dead device's replica.

    The removed replica's microbatches go to the survivors (the global batch is kept). Blind to fail-slow.
    """

    name = "ckpt-restart"
    detect_slow_steps = math.inf

    def __init__(self, *, detect_stop_steps: float = 2.0) -> None:
        self.detect_stop_steps = detect_stop_steps

    def on_step(
        self,
        t: float,
        step: int,
        observed: tuple[float, ...],
        plan: ExecutionPlan,
        state: ClusterState,
        ctx: SimContext,
    ) -> Decision:
        new = restart_plan(plan, observed)
        if new is None or new == plan:
            return Decision(plan)  # nothing dead, or nothing left to restart on: the job stays down
        return Decision(new, ctx.job.restart_cost_s, restart=True)


def restart_plan(plan: ExecutionPlan, speeds: tuple[float, ...]) -> ExecutionPlan | None:
    """Checkpoint-restart's plan: drop every replica holding a device of speed 0, keep the global
    batch (split evenly over the survivors). ``plan`` itself if none is dead; None if none survives."""
    keep = [
        r
        for r in range(plan.num_replicas)
        if all(speeds[d] > 0 for s in range(plan.num_stages) for d in plan.group(r, s))
    ]
    if len(keep) == plan.num_replicas:
        return plan
    if not keep:
        return None
    q, rem = divmod(sum(plan.microbatches), len(keep))
    return ExecutionPlan(
        version=plan.version + 1,
        tp_groups=tuple(plan.group(r, s) for r in keep for s in range(plan.num_stages)),
        layer_partition=tuple(plan.layer_partition[r] for r in keep),
        microbatches=tuple(q + (i < rem) for i in range(len(keep))),
    )


def try_replan(
    state: ClusterState,
    src: ExecutionPlan,
    duration_s: float,
    costs: ReconfigCosts,
    per_replica: bool = False,
) -> ExecutionPlan | None:
    """``progressive_replan`` from ``src``, or None when no replica can survive."""
    try:
        return progressive_replan(
            state,
            src,
            expected_fault_duration_s=duration_s,
            reconfig_costs=costs,
            per_replica_partitions=per_replica,
        )[0]
    except ValueError:
        return None


Option = tuple[float, float, object]
"""A way to run a plan: (step time, stall of switching to it, mechanism: steptune's rerouting moves)."""


class Memoized:
    """A policy whose decision depends only on (job, plan, observed speeds): decide once, reuse."""

    def __init__(self) -> None:
        self._memo: dict[tuple[SimJob, ExecutionPlan, tuple[float, ...]], Decision] = {}

    def reset(self) -> None:
        self._memo.clear()

    def on_step(
        self,
        t: float,
        step: int,
        observed: tuple[float, ...],
        plan: ExecutionPlan,
        state: ClusterState,
        ctx: SimContext,
    ) -> Decision:
        key = (ctx.job, plan, observed)
        if key not in self._memo:
            self._memo[key] = self._decide(observed, plan, state, ctx)
        return self._memo[key]

    def _decide(
        self, observed: tuple[float, ...], plan: ExecutionPlan, state: ClusterState, ctx: SimContext
    ) -> Decision:
        raise NotImplementedError


class ResiHPPolicy(Memoized):
    """ResiHP: on a change in the detected speeds, ``progressive_replan`` and stall its reconfiguration.

    A detected fail-stop is a permanent fault; a fail-slow is expected to last ``expected_slow_s``
    (Greyhound's mean communication fail-slow, 24 min) for the ski-rental gates. Surviving replicas
    hold the optimizer state, so nothing is rolled back. A replan that finds no surviving replica
    leaves the job down. When every device in the plan is healthy again and an excluded device has
    recovered, it replans from the first plan, under the same ski-rental gate.
    """

    name = "resihp"
    tp_shares = False
    """Plan with steptune's uneven TP shares (``SteptunePolicy``) instead of ResiHP's exclusion."""
    assignment_error: float | None = PREDICTION_SIGMA
    """Workload-aware DP assignment (``run(workload=)``): microbatches go to replicas by the predictor's
    cost estimate, with the predictor's error."""

    def __init__(
        self,
        *,
        detect_stop_steps: float = 2.0,
        detect_slow_steps: float = 2.0,
        expected_slow_s: float = 24 * 60.0,
        false_alarm_s_per_step: float = 0.0,
        per_replica_partitions: bool = False,
    ) -> None:
        self.per_replica_partitions = per_replica_partitions
        """Replan with a layer partition per replica (a runtime with layer-wise gradient sync)."""
        self.detect_stop_steps = detect_stop_steps
        self.detect_slow_steps = detect_slow_steps
        self.expected_slow_s = expected_slow_s
        self.false_alarm_s_per_step = false_alarm_s_per_step
        """Expected validation stall of false fail-slow alarms per step (the sim adds it to every step)."""
        super().__init__()

    def _decide(
        self, observed: tuple[float, ...], plan: ExecutionPlan, state: ClusterState, ctx: SimContext
    ) -> Decision:
        if self.tp_shares:
            state = replace(state, tp_shares=True)
        # The per-device view (a slow link shows as a slower device); prices use ``observed``.
        used = [state.speeds[d] for g in plan.tp_groups for d in g]
        if min(used) >= 1.0 and plan.tp_shares is None:
            return self._readmit(plan, state, observed, ctx)
        dur = math.inf if min(used) <= 0 else self.expected_slow_s
        if min(used) >= 1.0:  # healthy again, on steptune's uneven shares (ResiHP readmits above)
            dur = self._readmit_horizon_s()
        # Candidates: the gated progressive plan and the ungated one; the iteration-time predictor
        # (the pipeline simulator's critical path, not the planner's closed form) and the ski-rental
        # horizon pick among them. No candidate means no replica survives: down until devices return.
        cands = [plan]
        for costs, horizon in ((ctx.job.reconfig, dur), (ReconfigCosts(tp_s=0.0, pp_s=0.0), math.inf)):
            cand = try_replan(state, plan, horizon, costs, self.per_replica_partitions)
            if cand is not None and cand not in cands:
                cands.append(cand)
        cands += self._more_candidates(cands, plan, observed, state, ctx)
        t_now = self._running_on(plan, observed, ctx)[0]

        def total(o: Option) -> tuple[float, float]:
            t_c, cost, _ = o
            if math.isinf(dur) or math.isinf(t_now):
                return (t_c, cost)
            return (cost + dur / t_now * t_c, 0.0)  # seconds to run the fault's steps

        best = {c: min(self._options(plan, c, observed, ctx), key=total) for c in cands}
        new = min(cands, key=lambda c: total(best[c]))  # replans come back as version + 1 already
        self._picked(plan, observed, best[new][2])
        return Decision(new, best[new][1])

    def _options(
        self, plan: ExecutionPlan, new: ExecutionPlan, observed: tuple[float, ...], ctx: SimContext
    ) -> list[Option]:
        """The ways to run ``new`` after ``plan``: (step time under ``observed``, switching stall,
        mechanism). ResiHP has one: the plan as its runtime runs it, for ``reconfig_cost``."""
        return [(ctx.step_time(new, observed), reconfig_cost(plan, new, ctx.job.reconfig), None)]

    def _running_on(self, plan: ExecutionPlan, observed: tuple[float, ...], ctx: SimContext) -> Option:
        """The free option of ``plan`` itself: running on as it is."""
        return min((o for o in self._options(plan, plan, observed, ctx) if o[1] == 0), key=lambda o: o[0])

    def _picked(self, plan: ExecutionPlan, observed: tuple[float, ...], mechanism: object) -> None:
        """The decision from (``plan``, ``observed``) runs with ``mechanism`` (steptune keeps it)."""

    def _readmit_horizon_s(self) -> float:
        """The ski-rental horizon for undoing a fault's changes once it is over: ResiHP uses the fault's
        (``expected_slow_s``); steptune the time until the next fault (unbounded)."""
        return self.expected_slow_s

    def _more_candidates(
        self,
        cands: list[ExecutionPlan],
        plan: ExecutionPlan,
        observed: tuple[float, ...],
        state: ClusterState,
        ctx: SimContext,
    ) -> list[ExecutionPlan]:
        """Plans to weigh besides ResiHP's progressive replans: none (steptune adds some)."""
        return []

    def _readmit(
        self, plan: ExecutionPlan, state: ClusterState, observed: tuple[float, ...], ctx: SimContext
    ) -> Decision:
        """Every device in the plan is healthy: undo what the faults made the plan do.

        Candidates: the replan from the first plan under the observed speeds (takes back recovered
        devices, restores the layer partition) and the current plan with balanced microbatch counts.
        Switch to the one with the fastest simulated step if it is faster and the gain over
        ``expected_slow_s`` (the horizon a fail-slow decision used) pays for the reconfiguration, the
        same ski-rental rule as in the other direction.
        """
        cands = [rebalanced(state, plan)]
        base_devices = {d for g in ctx.base_plan.tp_groups for d in g}
        in_plan = {d for g in plan.tp_groups for d in g}
        back = any(state.speeds[d] >= 1.0 for d in base_devices - in_plan)
        if back or set(plan.layer_partition) != set(ctx.base_plan.layer_partition):
            new = try_replan(state, ctx.base_plan, math.inf, ctx.job.reconfig, self.per_replica_partitions)
            if new is not None:
                cands.append(new)
        now = self._running_on(plan, observed, ctx)
        best, best_o = plan, now
        for c in (plan, *(replace(c, version=plan.version + 1) for c in cands)):
            for o in self._options(plan, c, observed, ctx):
                if o[0] < best_o[0] and should_apply(now[0], o[0], self._readmit_horizon_s(), o[1]):
                    best, best_o = c, o
        self._picked(plan, observed, best_o[2])
        return Decision(best, best_o[1])
