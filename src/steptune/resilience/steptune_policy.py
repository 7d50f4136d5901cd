"""steptune's recovery policy: ResiHP plus uneven TP shares, Adaptra's rescheduling, simulator-priced
candidates, per-replica layer partitions and partial rerouting to DP peers (SIMULATED; see
docs/resilience.md, "steptune's policy")."""

from __future__ import annotations

import math
from dataclasses import replace

from steptune.resilience.plan import ClusterState, ExecutionPlan, ReconfigCosts
from steptune.resilience.policies import Option, ResiHPPolicy, try_replan
from steptune.resilience.replans import shares_only, uniform_repartition
from steptune.resilience.sim import Decision, SimContext, improve_counts, reconfig_cost, runs_slow

__all__ = ["SteptunePolicy"]


class SteptunePolicy(ResiHPPolicy):
    """steptune: ResiHP's detector, ski-rental gates and PP/DP steps, with uneven TP shares in place of
    TP exclusion. A TP group keeps every live member and splits its heads (with their MLP slices) by
    speed (``plan.water_fill``), so a slow member works on less instead of leaving, and the survivors of a
    fail-stop keep their whole throughput (3 of 4 run at 32/11 = 2.9 devices where ResiHP keeps 2).
    Re-splitting a group's shares costs ``tp_s`` like a membership change. Live counterpart:
    ``tensorpar``'s ``tp_policy="uneven"``."""

    name = "steptune"
    tp_shares = True
    _adapted = False
    _moves: dict[tuple[int, int], int] | None = None
    _state: ClusterState

    def __init__(self, *, reroute: bool = True, **kwargs: float | bool) -> None:
        self.reroute = reroute
        """Weigh rerouting part of slow or dead workers' microbatches to DP peers (``reroute``)."""
        super().__init__(**kwargs)  # type: ignore[arg-type]
        self.reset()

    def reset(self) -> None:
        super().reset()
        self._adapted = False
        self._moves = None
        self._pick: dict[tuple[ExecutionPlan, tuple[float, ...]], object] = {}
        self._rerouted: dict[tuple[object, ...], float] = {}
        self._best: dict[
            tuple[ExecutionPlan, tuple[float, ...]], tuple[float, dict[tuple[int, int], int]]
        ] = {}

    def on_step(
        self,
        t: float,
        step: int,
        observed: tuple[float, ...],
        plan: ExecutionPlan,
        state: ClusterState,
        ctx: SimContext,
    ) -> Decision:
        self._state = state  # what ``_options`` prices a plan without rerouting by
        decision = super().on_step(t, step, observed, plan, state, ctx)
        self._adapted = runs_slow(decision.plan, state)  # reschedule as Adaptra does
        # Part of the slow or dead workers' microbatches rerouted to DP peers (``reroute``), or none:
        # the decision picked the moves with the plan (``_options``); they stay until the next one.
        moves = self._pick.get((plan, observed), self._moves)
        if decision.plan == plan:
            # Same plan, new moves: a new version, so the sim stalls (``pp_s``) once.
            decision = (
                Decision(replace(plan, version=plan.version + 1), decision.stall_s)
                if moves != self._moves
                else Decision(plan)
            )
        self._moves = moves  # type: ignore[assignment]
        return decision

    def _readmit_horizon_s(self) -> float:
        # Health lasts until the next fault: at Llama 3's rate (419 interruptions in 54 days on 16K
        # GPUs) about 8 days on 256 GPUs, unbounded next to a stall of seconds.
        return math.inf

    def _picked(self, plan: ExecutionPlan, observed: tuple[float, ...], mechanism: object) -> None:
        self._pick[(plan, observed)] = mechanism

    def _options(
        self, plan: ExecutionPlan, new: ExecutionPlan, observed: tuple[float, ...], ctx: SimContext
    ) -> list[Option]:
        """``new`` run without rerouting (rescheduled as Adaptra does), with its best moves, and (for the
        plan in place) with the current moves. Changing the moves is a new schedule and P2P set-up at a
        safe point: it stalls ``pp_s`` as ReCycle's rerouting does, on top of a TP change (a repartition's
        own ``pp_s`` covers it). Without rerouting a plan is priced as ``step_time`` will charge it."""
        base = reconfig_cost(plan, new, ctx.job.reconfig)
        # New moves on the same layer partition pay ``pp_s`` on top of any TP change; a repartition's
        # own ``pp_s`` already covers the new schedule.
        rerouting = base if new.layer_partition != plan.layer_partition else base + ctx.job.reconfig.pp_s
        mechanisms: list[dict[tuple[int, int], int] | None] = [None]
        if self.reroute:
            moves = self._reroute(new, observed, ctx)[1]
            if moves:
                mechanisms.append(moves)
        if new == plan and self._moves and self._moves not in mechanisms:
            mechanisms.append(self._moves)
        return [
            (
                self._mechanism_time(new, observed, ctx, m),
                base if m == self._moves else rerouting,
                m,
            )
            for m in mechanisms
        ]

    def _mechanism_time(
        self,
        plan: ExecutionPlan,
        speeds: tuple[float, ...],
        ctx: SimContext,
        moves: dict[tuple[int, int], int] | None,
    ) -> float:
        if not moves:  # as ``step_time`` will charge it
            slow = runs_slow(plan, self._state)
            return (ctx.rescheduled_step_time if slow else ctx.step_time)(plan, speeds)
        key = (plan, speeds, tuple(sorted(moves.items())))
        if key not in self._rerouted:
            from steptune.resilience.reroute import rerouted_step_time

            self._rerouted[key] = rerouted_step_time(plan, speeds, ctx, moves)
        return self._rerouted[key]

    def _reroute(
        self, plan: ExecutionPlan, speeds: tuple[float, ...], ctx: SimContext
    ) -> tuple[float, dict[tuple[int, int], int]]:
        from steptune.resilience.reroute import best_moves  # reroute prices with this module's model

        key = (plan, speeds)
        if key not in self._best:
            self._best[key] = best_moves(plan, speeds, ctx)
        return self._best[key]

    def _more_candidates(
        self,
        cands: list[ExecutionPlan],
        plan: ExecutionPlan,
        observed: tuple[float, ...],
        state: ClusterState,
        ctx: SimContext,
    ) -> list[ExecutionPlan]:
        # One repartition for all replicas (Greyhound's S3), and each candidate's microbatch counts
        # improved by greedy moves priced by the iteration-time predictor (the simulator), not by the
        # planner's per-device speed, which misjudges slow links.
        more = [c for c in (uniform_repartition(state, plan),) if c is not None]
        # The plan as it is with uneven shares around the fault: cheapest to switch to, and with part
        # of the hit workers' microbatches rerouted (``_options``) often the fastest.
        more.append(shares_only(state, plan))
        # ResiHP's replans again with a layer partition per replica (Oobleck-style heterogeneous
        # pipelines: the healthy replicas keep their split while the hit one rebalances). The live
        # counterpart syncs gradients layer-wise (``pipelined``), so replicas may hold different splits.
        if not self.per_replica_partitions:
            used = [state.speeds[d] for g in plan.tp_groups for d in g]
            dur = math.inf if min(used) <= 0 else self.expected_slow_s
            for costs, horizon in ((ctx.job.reconfig, dur), (ReconfigCosts(tp_s=0.0, pp_s=0.0), math.inf)):
                cand = try_replan(state, plan, horizon, costs, per_replica=True)
                if cand is not None:
                    more.append(cand)

        from steptune.resilience.baselines._common import _dead
        from steptune.resilience.baselines.failstop import rebuilds

        dead = _dead(plan, observed)
        # ResiHP's own replan, TP exclusion in place of shares, while a used device's link is slow and
        # nobody is dead: a member behind a very slow link paces every TP all-reduce whatever its share,
        # so only leaving the group helps (a sweep: 0.728x of ResiHP at one link at 0.055 of its
        # bandwidth, TP4 PP2 DP2). Weighed for every fault, the greedy choice of it lost 0.2-0.7% in 11
        # fail-stop and mixed bench rows.
        slow_link = ctx.comm is not None and ctx.comm.slow_link(plan.tp_groups, observed)
        if state.tp_shares and not dead and slow_link:
            cand = try_replan(replace(state, tp_shares=False), plan, self.expected_slow_s, ctx.job.reconfig)
            if cand is not None:
                more.append(cand)

        # Oobleck's rebuild: a hit replica rebuilt at a lower TP degree from its survivors (whole nodes
        # dropped, or only the dead devices). Without it a stage whose every TP member died halted the job
        # (the TP members of stage 0 dead in every replica: 1.92e4 tokens/s against Oobleck's 1.28e5).
        if dead:
            more += rebuilds(plan, state, dead, ctx.gpus_per_node)

        def price(p: ExecutionPlan) -> float:
            return ctx.step_time(p, observed)

        more += [improve_counts(c, price) for c in (*cands, *more)]
        return [replace(c, version=plan.version + 1) for c in more if c != plan and c not in cands]

    def step_time(self, plan: ExecutionPlan, speeds: tuple[float, ...], ctx: SimContext) -> float:
        if self._moves:
            return self._mechanism_time(plan, speeds, ctx, self._moves)
        if self._adapted:
            return ctx.rescheduled_step_time(plan, speeds)
        return ctx.step_time(plan, speeds)
