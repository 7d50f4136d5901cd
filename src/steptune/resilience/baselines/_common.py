"""Helpers shared by the baseline policies."""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import replace

from steptune.resilience.plan import (
    ExecutionPlan,
)
from steptune.resilience.sim import (
    SimContext,
)

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
