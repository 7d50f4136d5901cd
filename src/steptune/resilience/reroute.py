"""Rerouting a stage worker's microbatches to its DP peers: ReCycle's mechanism and steptune's partial form.

ReCycle sends every microbatch of a dead stage worker (replica r, stage s) to the workers that hold
the same layers in the other replicas. Their forward and input-gradient passes stretch the peers'
steady state; their weight-gradient passes are deferred into the pipeline bubbles.

steptune generalizes it. A live but slow stage worker (a fail-slow device, or a TP group that lost a
member and runs on uneven shares) keeps ``m - k`` of its ``m`` microbatches and hands ``k`` to its
peers. ``best_moves`` picks ``k`` per worker under the speeds it is given. ``k = m`` for every dead
worker and 0 elsewhere is ReCycle exactly (``recycle_step_time``).

Pricing, the same for both (ReCycle's, per replica):
- a sender's stage costs, per microbatch, the mix of its own time (``m - k`` microbatches) and its
  receivers' mean time (``k`` microbatches run there);
- a receiver of ``e`` extra microbatches stretches its forward by ``(m + e) / m`` and its backward by
  ``e`` input-gradient passes. The ``e`` weight-gradient passes fill the stage's idle time; what does
  not fit (``absorb`` is the usable fraction) adds to the replica's time;
- the replica's time is the 1F1B makespan of those stage costs; the step is the slowest replica plus
  the DP gradient sync.

Not priced (in ReCycle's favour as much as ours): the cross-replica activation transfers and the
receivers' extra activation memory. SIMULATED only: steptune's live runtime does not reroute yet.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Mapping

from steptune.resilience.plan import ExecutionPlan, shares_speed
from steptune.resilience.sim import SimContext, dp_sync_s, pipeline_time

__all__ = ["Moves", "best_moves", "dead_moves", "rerouted_step_time", "stage_costs"]

Moves = Mapping[tuple[int, int], int]
"""(replica, stage) -> microbatches that worker hands to its peers each step."""

_GRID = 8
"""``best_moves`` tries k = 0, m/8, ..., m, then refines around the best by halving steps."""


def stage_costs(
    plan: ExecutionPlan, r: int, speeds: tuple[float, ...], ctx: SimContext
) -> tuple[list[float], list[float], list[float]]:
    """Per stage of replica ``r``: F, B, W seconds of one microbatch (inf for a stage that cannot run).
    Uneven TP shares are paced by their slowest member (``shares_speed``); with a comm model, TP
    collectives and P2P go into F and B (as in ``sim``'s own step time)."""
    f, b, w, start = [], [], [], 0
    part = plan.layer_partition[r]
    groups = plan.tp_groups[r * plan.num_stages : (r + 1) * plan.num_stages]
    extra = ctx.comm.stage_extra(groups, part, speeds) if ctx.comm is not None else None
    for s, n in enumerate(part):
        g = groups[s]
        if plan.tp_shares is not None:
            v = shares_speed(g, plan.tp_shares[r * plan.num_stages + s], speeds)
        else:
            v = len(g) * min(speeds[d] for d in g)
        sl = slice(start, start + n)
        for out, src in ((f, ctx.layer_f), (b, ctx.layer_b), (w, ctx.layer_w)):
            out.append(sum(src[sl]) / v if v > 0 else math.inf)
        start += n
    if extra is not None:
        f = [x + y for x, y in zip(f, extra[0], strict=True)]
        b = [x + y for x, y in zip(b, extra[1], strict=True)]
    return f, b, w


@functools.lru_cache(maxsize=65536)
def _replica_time(f: tuple[float, ...], b: tuple[float, ...], m: int) -> float:
    return pipeline_time(f, b, m)


def _layer_ranges(plan: ExecutionPlan, r: int) -> list[tuple[int, int]]:
    out, start = [], 0
    for n in plan.layer_partition[r]:
        out.append((start, n))
        start += n
    return out


def rerouted_step_time(
    plan: ExecutionPlan,
    speeds: tuple[float, ...],
    ctx: SimContext,
    moves: Moves,
    *,
    absorb: float = 1.0,
    costs: list[tuple[list[float], list[float], list[float]]] | None = None,
) -> float:
    """The step of ``plan`` with ``moves`` rerouted (module docstring); inf if a dead worker keeps work
    or a mover has no live peer. A worker's receivers: the other replicas' workers at the same stage
    with the same layers that are live and move nothing themselves. Empty ``moves``: the plain step."""
    num_r, num_s = plan.num_replicas, plan.num_stages
    if costs is None:
        costs = [stage_costs(plan, r, speeds, ctx) for r in range(num_r)]
    ranges = [_layer_ranges(plan, r) for r in range(num_r)]
    got = [[0.0] * num_s for _ in range(num_r)]
    peer = {}  # (r, s) -> receivers' mean (F, B, W)
    for (r, s), k in moves.items():
        if k <= 0:
            continue
        recv = [
            p
            for p in range(num_r)
            if p != r
            and ranges[p][s] == ranges[r][s]
            and moves.get((p, s), 0) <= 0
            and math.isfinite(costs[p][0][s])
            and plan.microbatches[p] > 0
        ]
        if not recv:
            return math.inf
        for p in recv:
            got[p][s] += k / len(recv)
        peer[(r, s)] = tuple(sum(costs[p][i][s] for p in recv) / len(recv) for i in range(3))
    out = 0.0
    for r in range(num_r):
        m = plan.microbatches[r]
        if m == 0:
            continue
        f, b, w = costs[r]
        fs, bs, late = [], [], []
        for s in range(num_s):
            k = min(moves.get((r, s), 0), m)
            if k > 0:
                pf, pb, pw = peer[(r, s)]
                if k < m and not math.isfinite(f[s]):
                    return math.inf  # a dead worker cannot keep any of its microbatches
                own = m - k
                fs.append(((own * f[s] if own else 0.0) + k * pf) / m)
                bs.append(((own * (b[s] + w[s]) if own else 0.0) + k * (pb + pw)) / m)
                late.append(0.0)
            else:
                if not math.isfinite(f[s]):
                    return math.inf
                e = got[r][s]
                fs.append(f[s] * (m + e) / m)
                bs.append(b[s] + w[s] + e * b[s] / m)
                late.append(e * w[s])
        t = _replica_time(tuple(fs), tuple(bs), m)
        over = max((x - absorb * (t - m * (fs[s] + bs[s])) for s, x in enumerate(late) if x > 0), default=0.0)
        out = max(out, t + max(over, 0.0))
    return out + dp_sync_s(plan, speeds, ctx)


def dead_moves(plan: ExecutionPlan, speeds: tuple[float, ...]) -> dict[tuple[int, int], int]:
    """ReCycle's moves: every worker with a dead device hands all its microbatches to its peers."""
    return {
        (r, s): plan.microbatches[r]
        for r in range(plan.num_replicas)
        for s in range(plan.num_stages)
        if plan.microbatches[r] > 0 and any(speeds[d] <= 0 for d in plan.group(r, s))
    }


def best_moves(
    plan: ExecutionPlan, speeds: tuple[float, ...], ctx: SimContext, *, absorb: float = 1.0
) -> tuple[float, dict[tuple[int, int], int]]:
    """steptune's moves for ``plan`` under ``speeds``, and the step they give.

    Dead workers move everything (ReCycle). Live workers slower than their fastest same-layer peer may
    move part: first one shared ``k`` for all of them on a grid over 0..m (``_GRID`` + 1 points),
    then each worker's own ``k`` by a hill climb with halving steps. ``k = 0`` everywhere is on the
    grid, so the result is never worse than ReCycle's (or, with no dead worker, the plain step).
    """
    num_r, num_s = plan.num_replicas, plan.num_stages
    costs = [stage_costs(plan, r, speeds, ctx) for r in range(num_r)]
    forced = dead_moves(plan, speeds)
    ranges = [_layer_ranges(plan, r) for r in range(num_r)]
    slow = []
    for r in range(num_r):
        for s in range(num_s):
            if (r, s) in forced or plan.microbatches[r] == 0:
                continue
            own = costs[r][0][s] + costs[r][1][s] + costs[r][2][s]
            peers = [
                costs[p][0][s] + costs[p][1][s] + costs[p][2][s]
                for p in range(num_r)
                if p != r and ranges[p][s] == ranges[r][s] and (p, s) not in forced
            ]
            if peers and own > min(peers) * (1 + 1e-6):
                slow.append((r, s))

    def price(ks: Mapping[tuple[int, int], int]) -> float:
        return rerouted_step_time(plan, speeds, ctx, {**forced, **ks}, absorb=absorb, costs=costs)

    if not slow:
        return price({}), dict(forced)
    top = max(plan.microbatches[r] for r, _ in slow)
    grid = sorted({round(top * i / _GRID) for i in range(_GRID + 1)})
    best_t, best = min(
        ((price(ks), ks) for ks in ({w: min(k, plan.microbatches[w[0]]) for w in slow} for k in grid)),
        key=lambda x: x[0],
    )
    if len(slow) <= 4:  # refine each worker's own k
        step = max(1, top // (2 * _GRID))
        while step >= 1:
            better = True
            while better:
                better = False
                for w in slow:
                    for k in (best[w] - step, best[w] + step):
                        if 0 <= k <= plan.microbatches[w[0]]:
                            t = price({**best, w: k})
                            if t < best_t:
                                best_t, best, better = t, {**best, w: k}, True
            step //= 2
    moves = {**forced, **{w: k for w, k in best.items() if k > 0}}
    return best_t, moves
