"""Helpers shared by the baseline policies."""

from __future__ import annotations

import math
from collections.abc import Callable

from steptune.resilience.plan import ExecutionPlan
from steptune.resilience.sim import SimContext

_INF = math.inf
Price = Callable[[ExecutionPlan], float]


def _dead(plan: ExecutionPlan, speeds: tuple[float, ...]) -> frozenset[int]:
    return frozenset(d for g in plan.tp_groups for d in g if speeds[d] <= 0)


def _stage_costs(
    plan: ExecutionPlan, r: int, speeds: tuple[float, ...], ctx: SimContext
) -> tuple[list[float], list[float], list[float]]:
    """Per stage of replica ``r``: F, B, W seconds of one microbatch (inf for a stage with a dead device).
    With a comm model, TP collectives and P2P go into F and B (as in ``sim``'s own step time)."""
    f, b, w, start = [], [], [], 0
    part = plan.layer_partition[r]
    groups = plan.tp_groups[r * plan.num_stages : (r + 1) * plan.num_stages]
    extra = ctx.comm.stage_extra(groups, part, speeds) if ctx.comm is not None else None
    for s, n in enumerate(part):
        g = plan.group(r, s)
        v = len(g) * min(speeds[d] for d in g)
        sl = slice(start, start + n)
        for out, src in ((f, ctx.layer_f), (b, ctx.layer_b), (w, ctx.layer_w)):
            out.append(sum(src[sl]) / v if v > 0 else _INF)
        start += n
    if extra is not None:
        f = [x + y for x, y in zip(f, extra[0], strict=True)]
        b = [x + y for x, y in zip(b, extra[1], strict=True)]
    return f, b, w
