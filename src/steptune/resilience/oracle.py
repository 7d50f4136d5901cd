"""The oracle: sees every change at once and switches for free to the best simulated plan, so no
policy should beat it (the bench checks ``above_oracle``). SIMULATED."""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import replace

from steptune.resilience.plan import ClusterState, ExecutionPlan, ReconfigCosts
from steptune.resilience.policies import Memoized, try_replan
from steptune.resilience.replans import shares_only, uniform_repartition
from steptune.resilience.sim import Decision, SimContext, SimJob, improve_counts

__all__ = ["Oracle", "PriceFn"]


PriceFn = Callable[[ExecutionPlan, tuple[float, ...], SimContext], float]


class Oracle(Memoized):
    """Sees every change at once and switches for free to the best simulated plan: an upper bound.

    Candidates: the current plan, and ``progressive_replan`` from the current and from the first plan
    (so recovered devices come back), each with free and with the job's reconfiguration costs, with one
    partition for all replicas and with one per replica; and the same with uneven TP shares (steptune's),
    free only. With
    ``extra_prices`` (other mechanisms' step times, e.g. ReCycle's rerouting or Adaptra's
    rescheduling, from ``baselines.oracle``) a plan runs at the best of all of them, so the bound
    also covers policies whose mechanism is not a plan change. Every plan, uneven shares included, may
    also run rescheduled or with part of its slow workers' microbatches rerouted to DP peers (steptune
    does both).
    """

    name = "oracle"
    detect_stop_steps = 0.0
    detect_slow_steps = 0.0
    assignment_error = 0.0
    """Assigns each step's microbatches by their exact costs (``run(workload=)``)."""

    def __init__(self, *, extra_prices: tuple[PriceFn, ...] = ()) -> None:
        super().__init__()
        self.extra_prices = extra_prices
        self._prices: dict[tuple[SimJob, ExecutionPlan, tuple[float, ...]], float] = {}

    def reset(self) -> None:
        super().reset()
        self._prices = {}

    def step_time(self, plan: ExecutionPlan, speeds: tuple[float, ...], ctx: SimContext) -> float:
        key = (ctx.job, plan, tuple(speeds))
        if key not in self._prices:
            # Rescheduled even when healthy: deeper warm-ups pay on uneven partitions (0.8-1.2% on the bench's
            # jobs), which no policy does without a fault, but Adaptra and steptune keep doing for a while
            # after one; a bound must cover that (a review, 2026-12-05, after a healthy-only gate let them
            # beat it)
            prices = [ctx.rescheduled_step_time(plan, speeds)]
            # Plans with uneven TP shares are steptune's alone; no baseline mechanism runs on them.
            if plan.tp_shares is None:
                prices += [float(f(plan, speeds, ctx)) for f in self.extra_prices]
            from steptune.resilience.reroute import best_moves  # prices with this module's model

            prices.append(best_moves(plan, speeds, ctx)[0])  # steptune's (partial) rerouting
            self._prices[key] = min(prices)
        return self._prices[key]

    def _decide(
        self, observed: tuple[float, ...], plan: ExecutionPlan, state: ClusterState, ctx: SimContext
    ) -> Decision:
        free = ReconfigCosts(tp_s=0.0, pp_s=0.0)
        cands = [plan, ctx.base_plan]
        shared = replace(state, tp_shares=True)  # steptune's uneven shares
        for st, all_costs in ((state, (free, ctx.job.reconfig)), (shared, (free, ctx.job.reconfig))):
            for src in (plan, ctx.base_plan):
                for costs in all_costs:
                    for per_replica in (False, True):  # steptune replans each replica's partition
                        cand = try_replan(st, src, math.inf, costs, per_replica)
                        if cand is not None:
                            cands.append(cand)
        # Greyhound's S3 (one repartition for all replicas), and greedy microbatch moves priced exactly
        # (the planner's DP step assigns by speed; with slow links the DP sync term matters too).
        cands += [c for src in (plan, ctx.base_plan) if (c := uniform_repartition(state, src)) is not None]
        cands += [shares_only(shared, src) for src in (plan, ctx.base_plan)]  # steptune's, for rerouting
        # Oobleck's: each hit replica rebuilt from the survivors at a lower TP degree, dropping whole nodes
        # (its own rule) or only the dead devices (a sweep: Oobleck beat the oracle 3.5x when the TP members
        # of stage 0 died in every replica, and by 4% when two nodes died); and all hit replicas but one, left
        # with its dead workers for rerouting to price (steptune, rebuilding three and rerouting around the
        # fourth, ran 3% above an oracle that only rebuilt them all)
        from steptune.resilience.baselines._common import _dead
        from steptune.resilience.baselines.failstop import rebuilds

        for src in (plan, ctx.base_plan):
            if dead := _dead(src, observed):
                cands += rebuilds(src, state, dead, ctx.gpus_per_node, all_but_one=True)
        # The moves are priced by the plain step time (per-replica cached; the other mechanisms' prices
        # would re-simulate every move), the final pick by the best of all prices.
        cands += [improve_counts(c, lambda p: ctx.step_time(p, observed)) for c in cands]
        # Many candidates are the same plan under another version number: price each plan once.
        unique = dict.fromkeys(replace(c, version=plan.version) for c in cands)
        best = min(unique, key=lambda p: self.step_time(p, observed, ctx))
        return Decision(best if best == plan else replace(best, version=plan.version + 1))
