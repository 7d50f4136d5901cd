"""Planners over an ``ExecutionPlan``: one per axis, and the ski-rental gate. The step-time model that
prices plans is in ``steptime``; whole-plan constructors (initial, uneven shares, one partition for every
replica) in ``replans``.

Contract: nothing here touches torch.distributed; every function returns new values and never mutates its
arguments. Devices, layer costs and memory follow the model in ``steptune.resilience.plan``'s docstring.

Exact: ``plan_tp``, ``plan_pp`` (min-max, then fewest layers moved), microbatch counts for equal costs.
Heuristic: ``plan_dp`` for unequal costs (LPT; within 4/3 of optimal on equal speeds, Graham 1969),
``migrate``.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence
from typing import NamedTuple

import numpy as np

from steptune.resilience.plan import (
    _REL,
    StageMemory,
)

__all__ = [
    "Move",
    "makespan",
    "migrate",
    "plan_dp",
    "plan_pp",
    "plan_tp",
    "should_apply",
]


def plan_tp(
    group: Sequence[int], speeds: Sequence[float], *, num_heads: int, min_degree: int = 1
) -> tuple[int, ...]:
    """ResiHP selective device exclusion: the subgroup maximizing k * min p.

    Candidates are the fastest k alive members for k = 2^q with min_degree <= k <= #alive and
    num_heads % k == 0 (memory enters through ``min_degree``). Ties keep the larger group. The result
    keeps the group's order. Exact: for a given k the fastest k maximize min p. O(n log n).
    """
    if not group or len(set(group)) != len(group):
        raise ValueError(f"TP group {tuple(group)} must be non-empty without repeated devices")
    order = sorted((d for d in group if speeds[d] > 0), key=lambda d: -speeds[d])
    best: list[int] | None = None
    best_score = 0.0
    k = 1
    while k <= len(order):
        score = k * speeds[order[k - 1]]
        if k >= min_degree and num_heads % k == 0 and score >= best_score * (1 - _REL):
            best, best_score = order[:k], score
        k *= 2
    if best is None:
        raise ValueError(
            f"TP group {tuple(group)}: no degree k = 2^q with {min_degree} <= k <= {len(order)} alive "
            f"devices and {num_heads} heads % k == 0; lower min_degree (fewer layers or more memory) "
            "or drop the replica"
        )
    chosen = set(best)
    return tuple(d for d in group if d in chosen)


def plan_pp(
    layer_costs: Sequence[float],
    stage_speeds: Sequence[float],
    *,
    memory: StageMemory | None = None,
    prefer: Sequence[int] | None = None,
) -> tuple[int, ...]:
    """Contiguous partition minimizing the bottleneck max_s sum(costs in s) / speed_s.

    Each stage gets >= 1 layer and, with ``memory``, at most its capacity. Among bottleneck-optimal
    partitions it takes the one moving the fewest layers off their stage in ``prefer`` (the current
    partition: moving layers costs params and optimizer state over the network), then the least sum
    of squared stage times (balanced non-bottleneck stages). Exact DP over (stage, end), run twice
    (T*, then the tie-break under T*): O(S L^2), numpy over the inner loop (L = 128, S = 16: ~20 ms).
    Returns layers per stage. Memoized on its arguments (planners ask the same question many times).
    """
    return _plan_pp(
        tuple(map(float, layer_costs)),
        tuple(map(float, stage_speeds)),
        memory,
        None if prefer is None else tuple(map(int, prefer)),
    )


@functools.lru_cache(maxsize=4096)
def _plan_pp(
    layer_costs: tuple[float, ...],
    stage_speeds: tuple[float, ...],
    memory: StageMemory | None,
    prefer: tuple[int, ...] | None,
) -> tuple[int, ...]:
    num_l, num_s = len(layer_costs), len(stage_speeds)
    if not 1 <= num_s <= num_l:
        raise ValueError(f"cannot split {num_l} layers into {num_s} stages; use 1..{num_l} stages")
    if min(stage_speeds) <= 0:
        raise ValueError(
            f"stage speeds {tuple(stage_speeds)} must be > 0; exclude dead devices with plan_tp first"
        )
    if memory is not None and (len(memory.capacity) != num_s or len(memory.layer_bytes) != num_l):
        raise ValueError(f"memory needs {num_s} capacities and {num_l} layer sizes")
    if prefer is not None and (len(prefer) != num_s or sum(prefer) != num_l):
        raise ValueError(f"prefer must give layers for each of the {num_s} stages, summing to {num_l}")
    prefix = np.concatenate(([0.0], np.cumsum(np.asarray(layer_costs, dtype=np.float64))))
    mprefix = np.concatenate(([0.0], np.cumsum(memory.layer_bytes))) if memory else np.zeros(num_l + 1)
    old = np.concatenate(([0], np.cumsum(prefer))) if prefer is not None else None

    def solve(cap: float | None) -> tuple[np.ndarray, np.ndarray]:
        # Phase 1 (cap None): best[s, j] = min bottleneck of layers [0, j) on stages [0, s).
        # Phase 2: best[s, j] = min (layers moved + scaled sum of squares), every stage time <= cap;
        # the scaled squares sum to < 1/2, so one moved layer outweighs any balance.
        best = np.full((num_s + 1, num_l + 1), np.inf)
        cut = np.zeros((num_s + 1, num_l + 1), dtype=np.int64)
        best[0, 0] = 0.0
        for s in range(1, num_s + 1):
            for j in range(s, num_l - (num_s - s) + 1):
                i = np.arange(s - 1, j)
                t = (prefix[j] - prefix[i]) / stage_speeds[s - 1]
                if cap is None:
                    v = np.maximum(best[s - 1, i], t)
                else:
                    v = best[s - 1, i] + t * t / (2 * num_s * cap * cap)
                    if old is not None:
                        kept = np.clip(np.minimum(j, old[s]) - np.maximum(i, old[s - 1]), 0, None)
                        v += (j - i) - kept
                    v[t > cap] = np.inf
                if memory is not None:
                    v[mprefix[j] - mprefix[i] > memory.capacity[s - 1] * (1 + _REL)] = np.inf
                a = int(np.argmin(v))
                best[s, j], cut[s, j] = v[a], i[a]
        return best, cut

    best, _ = solve(None)
    bottleneck = float(best[num_s, num_l])
    if math.isinf(bottleneck):
        assert memory is not None
        raise ValueError(
            f"no partition of {num_l} layers over {num_s} stages fits memory capacities {memory.capacity} "
            f"(largest layer {max(memory.layer_bytes):.3g} B); raise TP degree or memory, or shrink layers"
        )
    _, cut = solve(bottleneck * (1 + _REL))
    sizes, j = [], num_l
    for s in range(num_s, 0, -1):
        i = int(cut[s, j])
        sizes.append(j - i)
        j = i
    return tuple(reversed(sizes))


def plan_dp(
    microbatch_costs: Sequence[float], replica_speeds: Sequence[float], *, base: Sequence[float] | None = None
) -> list[list[int]]:
    """LPT: largest predicted cost first, each to the replica where it finishes earliest.

    ``microbatch_costs`` are seconds at speed 1 (the workload predictor's c0 + c1 N + c2 sum l^2, so
    equal-token microbatches with longer sequences cost more); replica r finishes at
    ``base[r] + load_r / speed_r``. Dead replicas (speed 0) get nothing. Returns microbatch indices
    per replica, ascending. O(M log M + M R); optimal for equal costs (earliest finish slots).
    """
    base = list(base) if base is not None else [0.0] * len(replica_speeds)
    alive = [r for r, v in enumerate(replica_speeds) if v > 0]
    if not alive or len(base) != len(replica_speeds) or min(microbatch_costs, default=0.0) < 0:
        raise ValueError("plan_dp needs a replica with speed > 0, one base per replica and costs >= 0")
    load = [0.0] * len(replica_speeds)
    out: list[list[int]] = [[] for _ in replica_speeds]
    for i in sorted(range(len(microbatch_costs)), key=lambda i: (-microbatch_costs[i], i)):
        c = microbatch_costs[i]
        r = min(alive, key=lambda r: (base[r] + (load[r] + c) / replica_speeds[r], r))
        load[r] += c
        out[r].append(i)
    return [sorted(x) for x in out]


def makespan(
    assignment: Sequence[Sequence[int]],
    microbatch_costs: Sequence[float],
    replica_speeds: Sequence[float],
    *,
    base: Sequence[float] | None = None,
) -> float:
    """max_r base[r] + (sum of r's costs) / speed_r; inf if a dead replica holds work."""
    out = 0.0
    for r, idx in enumerate(assignment):
        load = sum(microbatch_costs[i] for i in idx)
        t = load / replica_speeds[r] if replica_speeds[r] > 0 else (math.inf if load > 0 else 0.0)
        out = max(out, (base[r] if base is not None else 0.0) + t)
    return out


class Move(NamedTuple):
    """Run ``remaining[src][item]`` (cost ``cost``) on replica ``dst`` instead."""

    src: int
    item: int
    dst: int
    cost: float


def migrate(
    progress: Sequence[float], remaining: Sequence[Sequence[float]], speeds: Sequence[float], delta: float
) -> list[Move]:
    """ResiHP's online migration (Algorithm 1, heuristic) within one iteration.

    Replica r is predicted to finish at ``progress[r] + sum(remaining[r]) / speeds[r]``: ``progress``
    is when its non-movable work (in flight) ends, ``remaining`` the pending microbatch costs (seconds
    at speed 1). A dead replica's pending work is evicted first (largest first, earliest finish). Then,
    while the slowest and fastest finish more than ``delta`` seconds apart (delta prices one activation
    transfer), move the slowest replica's pending microbatch that most lowers max(both finishes) to the
    fastest; stop when no move helps. A microbatch moves at most once, so this ends after <= M moves.
    """
    num_r = len(speeds)
    if len(progress) != num_r or len(remaining) != num_r or delta < 0:
        raise ValueError("migrate needs one progress and one pending list per replica and delta >= 0")
    alive = [r for r in range(num_r) if speeds[r] > 0]
    if not alive:
        raise ValueError("migrate: every replica is dead; nothing can take the pending microbatches")
    load = [float(sum(x)) for x in remaining]
    own = [dict(enumerate(x)) for x in remaining]

    def finish(r: int, extra: float = 0.0) -> float:
        return progress[r] + (load[r] + extra) / speeds[r]

    moves: list[Move] = []

    def move(src: int, item: int, dst: int) -> None:
        c = own[src].pop(item)
        load[src] -= c
        load[dst] += c
        moves.append(Move(src, item, dst, c))

    # Fail-stop eviction.
    for src in (r for r in range(num_r) if speeds[r] <= 0):
        for i in sorted(own[src], key=lambda i: -own[src][i]):
            c = own[src][i]
            move(src, i, min(alive, key=lambda r: finish(r, c)))
    # Progress-aware migration: slowest -> fastest while the gap exceeds delta.
    while True:
        slow, fast = max(alive, key=finish), min(alive, key=finish)
        top = finish(slow)
        if top - finish(fast) <= delta or not own[slow]:
            break

        def after(i: int, slow: int = slow, fast: int = fast, top: float = top) -> float:
            c = own[slow][i]
            return max(top - c / speeds[slow], finish(fast, c))

        i = min(own[slow], key=after)
        if after(i) >= top * (1 - _REL):
            break
        move(slow, i, fast)
    return moves


def should_apply(
    t_now: float, t_new: float, expected_fault_duration_s: float, reconfig_cost_s: float
) -> bool:
    """Ski-rental gate: switch iff it finishes the steps the current plan would run during the fault sooner.

    With per-step times ``t_now`` and ``t_new`` and expected fault duration D, the current plan runs
    n = D / t_now steps during the fault; switching runs them in ``cost + n * t_new``. So apply iff
    ``(t_now - t_new) * (D / t_now) > cost``. A plan that cannot run (t_now = inf) is always left for
    one that can; D = inf (a permanent fail-stop) applies any gain.
    """
    if t_now <= 0 or t_new <= 0 or expected_fault_duration_s < 0 or reconfig_cost_s < 0:
        raise ValueError("step times must be > 0, the fault duration and reconfiguration cost >= 0")
    if math.isinf(t_new) or t_new >= t_now:
        return False
    if math.isinf(t_now):
        return True
    return (t_now - t_new) * (expected_fault_duration_s / t_now) > reconfig_cost_s
