"""Planner: ResiHP's progressive TP -> PP -> DP adaptation, as pure functions over an ExecutionPlan.

The simulator and the runtime share this decision code; nothing here touches torch.distributed.
Every function returns new values and never mutates its arguments.

Model (approximate where stated; the planners are exact for it unless noted):
- Device ``i`` runs at speed ``p_i`` in (0, 1] of a healthy device; ``p_i == 0`` means dead.
- ``layer_costs[l]``: seconds one microbatch (F + B + W) spends in layer ``l`` on ONE healthy device
  (from the workload predictor). A TP group of ``k`` devices runs at ``k * min p`` healthy-device units:
  the slowest member paces every collective. Approximate: TP communication overhead is ignored.
- ``layer_bytes[l]``: the layer's resident state (params, grads, optimizer, activations), sharded evenly
  over the TP group; a stage fits if ``sum(layer_bytes) / k <= memory_bytes``.
- A replica running ``m >= 1`` microbatches takes ``sum_s t_s + (m - 1) * max_s t_s`` (1F1B fill/drain,
  then the bottleneck stage paces the steady state); the step is the slowest replica (synchronous DP).
- Exact: ``plan_tp``, ``plan_pp`` (min-max, then fewest layers moved), microbatch counts for equal costs.
  Heuristic: ``plan_dp`` for unequal costs (LPT; within 4/3 of optimal on equal speeds, Graham 1969),
  ``migrate``, the PP candidate set and the per-group greedy TP gating of ``progressive_replan``.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import heapq
import json
import math
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any, NamedTuple

import numpy as np

__all__ = [
    "ClusterState",
    "ExecutionPlan",
    "Move",
    "ReconfigCosts",
    "StageMemory",
    "estimate_step_time",
    "group_speed",
    "initial_plan",
    "makespan",
    "migrate",
    "plan_dp",
    "plan_pp",
    "plan_tp",
    "progressive_replan",
    "rebalanced",
    "shares_only",
    "shares_speed",
    "should_apply",
    "uniform_repartition",
    "water_fill",
]

_REL = 1e-9
"""Relative tolerance for float comparisons of times and bytes."""
_KEYS = ("version", "tp_groups", "layer_partition", "microbatches")


@dataclass(frozen=True, kw_only=True, slots=True)
class ExecutionPlan:
    """Who runs what. Versioned and immutable: ranks agree on ``digest()`` before switching to it."""

    version: int
    tp_groups: tuple[tuple[int, ...], ...]
    """Device ids per TP group, replica-major: replica r, stage s uses ``tp_groups[r * num_stages + s]``."""
    layer_partition: tuple[tuple[int, ...], ...]
    """Layers per stage (contiguous, in order), one tuple per DP replica; usually all equal."""
    microbatches: tuple[int, ...]
    """Microbatches each DP replica runs per step; they sum to the global batch."""
    tp_shares: tuple[tuple[int, ...], ...] | None = None
    """steptune's uneven TP shares: per TP group, the units (attention heads, with their slice of the MLP)
    each member holds, in member order. None: equal shares (Megatron, ResiHP)."""

    @property
    def num_replicas(self) -> int:
        return len(self.layer_partition)

    @property
    def num_stages(self) -> int:
        return len(self.layer_partition[0]) if self.layer_partition else 0

    def group(self, replica: int, stage: int) -> tuple[int, ...]:
        return self.tp_groups[replica * self.num_stages + stage]

    def to_json(self) -> str:
        d = {k: getattr(self, k) for k in _KEYS}
        if self.tp_shares is not None:
            d["tp_shares"] = self.tp_shares
        return json.dumps(d, sort_keys=True, separators=(",", ":"))

    @classmethod
    def from_json(cls, text: str) -> ExecutionPlan:
        try:
            d = json.loads(text)
        except json.JSONDecodeError as e:
            raise ValueError(f"plan JSON does not parse: {e}") from e
        if not isinstance(d, dict) or set(d) - {"tp_shares"} != set(_KEYS):
            raise ValueError(f"plan JSON must be an object with exactly the keys {list(_KEYS)} (+ tp_shares)")

        def ints(x: Any, what: str) -> tuple[int, ...]:
            if not isinstance(x, list) or not all(isinstance(v, int) and not isinstance(v, bool) for v in x):
                raise ValueError(f"plan JSON field {what} must be a list of integers, got {x!r}")
            return tuple(x)

        def nested(x: Any, what: str) -> tuple[tuple[int, ...], ...]:
            if not isinstance(x, list):
                raise ValueError(f"plan JSON field {what} must be a list of lists of integers")
            return tuple(ints(v, what) for v in x)

        if not isinstance(d["version"], int) or isinstance(d["version"], bool):
            raise ValueError(f"plan JSON field version must be an integer, got {d['version']!r}")
        return cls(
            version=d["version"],
            tp_groups=nested(d["tp_groups"], "tp_groups"),
            layer_partition=nested(d["layer_partition"], "layer_partition"),
            microbatches=ints(d["microbatches"], "microbatches"),
            tp_shares=nested(d["tp_shares"], "tp_shares") if d.get("tp_shares") is not None else None,
        )

    def digest(self) -> str:
        """sha256 of the canonical JSON (version included): equal digests mean equal plans."""
        return hashlib.sha256(self.to_json().encode()).hexdigest()

    def validate(self, num_layers: int, global_microbatches: int) -> None:
        """Raise ValueError naming what to change if this plan cannot run the model and batch."""
        if self.version < 0:
            raise ValueError(f"plan version is {self.version}; versions start at 0")
        num_r, num_s = self.num_replicas, self.num_stages
        if num_r == 0 or num_s == 0:
            raise ValueError("plan has no replica or no stage; give layer_partition at least one (1,) entry")
        if len(self.microbatches) != num_r:
            raise ValueError(f"plan has {len(self.microbatches)} microbatch counts for {num_r} replicas")
        for r, part in enumerate(self.layer_partition):
            if len(part) != num_s:
                raise ValueError(f"replica {r} has {len(part)} stages, replica 0 has {num_s}; use one depth")
            if min(part) < 1 or sum(part) != num_layers:
                raise ValueError(
                    f"replica {r} partition {part} must give every stage >= 1 layer and sum to {num_layers}"
                )
        if len(self.tp_groups) != num_r * num_s:
            raise ValueError(
                f"plan needs {num_r * num_s} TP groups (replicas x stages), has {len(self.tp_groups)}"
            )
        seen: set[int] = set()
        for i, g in enumerate(self.tp_groups):
            r, s = divmod(i, num_s)
            if not g:
                raise ValueError(f"TP group (dp{r},pp{s}) is empty; give it at least one device")
            if min(g) < 0 or seen.intersection(g) or len(set(g)) != len(g):
                raise ValueError(f"TP group (dp{r},pp{s}) {g} reuses a device or has a negative id")
            seen.update(g)
        if self.tp_shares is not None:
            if len(self.tp_shares) != len(self.tp_groups):
                raise ValueError(
                    f"plan has {len(self.tp_shares)} TP share lists for {len(self.tp_groups)} groups"
                )
            for g, c in zip(self.tp_groups, self.tp_shares, strict=True):
                if len(c) != len(g) or min(c) < 0 or sum(c) != sum(self.tp_shares[0]) or sum(c) == 0:
                    raise ValueError(
                        f"TP shares {c} of group {g}: one count >= 0 per member, the same positive total "
                        "in every group"
                    )
        if min(self.microbatches) < 0 or sum(self.microbatches) != global_microbatches:
            raise ValueError(
                f"microbatches {self.microbatches} must be >= 0 and sum to the global {global_microbatches}"
            )


@dataclass(frozen=True, kw_only=True, slots=True)
class ClusterState:
    """What the planner knows: device health and the model's per-layer time and memory."""

    speeds: tuple[float, ...]
    """p_i per device id, in [0, 1]: 1 healthy, 0 dead (from the detector)."""
    layer_costs: tuple[float, ...]
    """Seconds per microbatch (F+B+W) of each layer on one healthy device; > 0."""
    num_heads: int
    """Attention heads: a TP degree must divide it."""
    layer_bytes: tuple[float, ...] = ()
    """Resident bytes of each layer before TP sharding; empty means 0 (no memory limit)."""
    memory_bytes: float = math.inf
    """Per-device budget for layer state in bytes."""
    tp_shares: bool = False
    """Plan for steptune's uneven TP shares (``water_fill``): a group runs at the sum of its members'
    speeds, to head granularity, and is never cut to a power of two. False: ResiHP's k x min p."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "speeds", tuple(float(p) for p in self.speeds))
        object.__setattr__(self, "layer_costs", tuple(float(c) for c in self.layer_costs))
        object.__setattr__(
            self, "layer_bytes", tuple(float(b) for b in self.layer_bytes) or (0.0,) * len(self.layer_costs)
        )
        if not all(0.0 <= p <= 1.0 for p in self.speeds):
            raise ValueError("device speeds must lie in [0, 1] (1 healthy, 0 dead)")
        if not self.layer_costs or min(self.layer_costs) <= 0:
            raise ValueError("layer_costs must be non-empty and positive (seconds on one healthy device)")
        if len(self.layer_bytes) != len(self.layer_costs) or min(self.layer_bytes) < 0:
            raise ValueError(f"layer_bytes needs {len(self.layer_costs)} non-negative entries, one per layer")
        if self.num_heads < 1 or self.memory_bytes <= 0:
            raise ValueError("num_heads must be >= 1 and memory_bytes > 0")

    @property
    def num_layers(self) -> int:
        return len(self.layer_costs)

    def group_throughput(self, group: Sequence[int]) -> float:
        """A TP group's throughput in healthy devices under this state's share rule."""
        if self.tp_shares:
            return shares_speed(group, water_fill(group, self.speeds, self.num_heads), self.speeds)
        return group_speed(group, self.speeds)

    def group_capacity(self, group: Sequence[int]) -> float:
        """Layer bytes a TP group can hold: the member with the largest share fills first."""
        if self.tp_shares:
            top = max(water_fill(group, self.speeds, self.num_heads), default=0)
            return self.num_heads / top * self.memory_bytes if top else 0.0
        return len(group) * self.memory_bytes


@dataclass(frozen=True, kw_only=True, slots=True)
class StageMemory:
    """Per-stage memory cap for ``plan_pp``: a stage's layers must satisfy sum(layer_bytes) <= capacity."""

    layer_bytes: tuple[float, ...]
    capacity: tuple[float, ...]
    """Bytes per stage: the TP degree times the per-device budget."""


@dataclass(frozen=True, kw_only=True, slots=True)
class ReconfigCosts:
    """Seconds each adaptation stalls training (the ski-rental price of switching)."""

    tp_s: float
    """Rebuild one TP group's communicators and reshard its layers (ElasWave: < 1 s in place)."""
    pp_s: float
    """Fixed cost of a layer repartition (group rebuild, safe point)."""
    pp_per_layer_s: float = 0.0
    """Plus this per layer that changes stage (params + optimizer over IB; replicas move in parallel)."""
    dp_s: float = 0.0
    """Changing microbatch counts: about free (next iteration)."""


def group_speed(group: Sequence[int], speeds: Sequence[float]) -> float:
    """TP group throughput in healthy-device units: k * min p (0 if any member is dead)."""
    return len(group) * min(speeds[d] for d in group)


def water_fill(group: Sequence[int], speeds: Sequence[float], units: int) -> tuple[int, ...]:
    """steptune's uneven TP shares: ``units`` split over the group's live members in proportion to speed.

    Each unit goes to the member that would finish its share soonest, (count + 1) / speed (ties: member
    order), which minimizes max(count / speed) exactly. Dead members get 0. Counts in member order.
    """
    return _water_fill(tuple(speeds[d] for d in group), units)


@functools.lru_cache(maxsize=4096)
def _water_fill(member_speeds: tuple[float, ...], units: int) -> tuple[int, ...]:
    alive = [i for i, v in enumerate(member_speeds) if v > 0]
    count = [0] * len(member_speeds)
    if not alive:
        return tuple(count)
    for _ in range(units):
        i = min(alive, key=lambda i: ((count[i] + 1) / member_speeds[i], i))
        count[i] += 1
    return tuple(count)


def shares_speed(group: Sequence[int], counts: Sequence[int], speeds: Sequence[float]) -> float:
    """Throughput (healthy devices) of a TP group whose members hold ``counts`` units: the member that
    finishes its units last paces every TP collective. 0 if a dead member holds units."""
    units = sum(counts)
    worst = 0.0
    for d, c in zip(group, counts, strict=True):
        if c:
            if speeds[d] <= 0:
                return 0.0
            worst = max(worst, c / units / speeds[d])
    return 1.0 / worst if worst else 0.0


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


# Progressive replanning --------------------------------------------------------------------------

_Groups = list[list[tuple[int, ...]]]


def _stage_times(state: ClusterState, groups: Sequence[tuple[int, ...]], part: Sequence[int]) -> list[float]:
    out, start = [], 0
    for g, n in zip(groups, part, strict=True):
        speed = state.group_throughput(g)
        fits = sum(state.layer_bytes[start : start + n]) <= state.group_capacity(g) * (1 + _REL)
        out.append(sum(state.layer_costs[start : start + n]) / speed if speed > 0 and fits else math.inf)
        start += n
    return out


def _step_time(state: ClusterState, tp: _Groups, part: Sequence[Sequence[int]], mb: Sequence[int]) -> float:
    out = 0.0
    for groups, p, m in zip(tp, part, mb, strict=True):
        t = _stage_times(state, groups, p)
        if math.isinf(max(t)):
            return math.inf  # a dead device or an OOM stage: the plan cannot run at all
        out = max(out, sum(t) + (m - 1) * max(t) if m > 0 else 0.0)
    return out


def _rebalance(
    state: ClusterState, tp: _Groups, part: Sequence[Sequence[int]], total: int
) -> tuple[list[int], float]:
    """Optimal counts for equal microbatches (take the earliest finish slot each time), and the step."""
    times = [_stage_times(state, g, p) for g, p in zip(tp, part, strict=True)]
    if any(math.isinf(max(t)) for t in times):
        return [0] * len(tp), math.inf
    counts = [0] * len(tp)
    heap = [(sum(t), r) for r, t in enumerate(times)]
    heapq.heapify(heap)
    for _ in range(total):
        _, r = heapq.heappop(heap)
        counts[r] += 1
        heapq.heappush(heap, (sum(times[r]) + counts[r] * max(times[r]), r))
    return counts, _step_time(state, tp, part, counts)


def estimate_step_time(state: ClusterState, plan: ExecutionPlan) -> float:
    """Modelled step time of ``plan`` (module docstring); inf if it uses a dead device or a stage OOMs."""
    tp = [[plan.group(r, s) for s in range(plan.num_stages)] for r in range(plan.num_replicas)]
    return _step_time(state, tp, plan.layer_partition, plan.microbatches)


def rebalanced(state: ClusterState, plan: ExecutionPlan) -> ExecutionPlan:
    """``plan`` with the microbatch counts that minimize the modelled step (same version if unchanged)."""
    tp = [[plan.group(r, s) for s in range(plan.num_stages)] for r in range(plan.num_replicas)]
    counts, t = _rebalance(state, tp, plan.layer_partition, sum(plan.microbatches))
    if tuple(counts) == plan.microbatches or math.isinf(t):
        return plan
    return replace(plan, version=plan.version + 1, microbatches=tuple(counts))


def shares_only(state: ClusterState, plan: ExecutionPlan) -> ExecutionPlan:
    """``plan`` with each TP group's dead members dropped and its units water-filled over the live ones
    by speed (steptune's uneven shares, ``water_fill``); partition and microbatches kept. A group with no
    live member stays as it is (only rerouting its work can run it). Same version if nothing changed."""
    groups, shares = [], []
    for g in plan.tp_groups:
        live = tuple(d for d in g if state.speeds[d] > 0)
        groups.append(live or g)
        shares.append(
            water_fill(live, state.speeds, state.num_heads)
            if live
            else _water_fill((1.0,) * len(g), state.num_heads)
        )
    out = replace(
        plan,
        tp_groups=tuple(groups),
        tp_shares=tuple(shares) if any(len(set(c)) > 1 for c in shares) else None,
    )
    return plan if out == plan else replace(out, version=plan.version + 1)


def uniform_repartition(state: ClusterState, plan: ExecutionPlan) -> ExecutionPlan | None:
    """``plan`` with one bottleneck-optimal layer partition for every replica, each stage position
    paced by its slowest replica's group (k x min speed); TP groups and microbatches kept. None if no
    partition fits in memory. (Greyhound's S3; a candidate of the simulator's oracle.)"""
    num_r, num_s = plan.num_replicas, plan.num_stages
    speeds = [min(group_speed(plan.group(r, s), state.speeds) for r in range(num_r)) for s in range(num_s)]
    mem = None
    if math.isfinite(state.memory_bytes):
        caps = tuple(
            min(len(plan.group(r, s)) for r in range(num_r)) * state.memory_bytes for s in range(num_s)
        )
        mem = StageMemory(layer_bytes=state.layer_bytes, capacity=caps)
    try:
        part = plan_pp(state.layer_costs, speeds, memory=mem, prefer=plan.layer_partition[0])
    except ValueError:
        return None
    return replace(plan, version=plan.version + 1, layer_partition=(part,) * num_r)


def initial_plan(
    state: ClusterState, *, tp: int, pp: int, dp: int, global_microbatches: int
) -> ExecutionPlan:
    """Version 0 on devices 0..tp*pp*dp-1 (replica-major, then stage, then TP rank), healthy speeds."""
    if tp * pp * dp > len(state.speeds):
        raise ValueError(f"tp*pp*dp = {tp * pp * dp} exceeds the {len(state.speeds)} devices")
    groups = tuple(tuple(range(i * tp, (i + 1) * tp)) for i in range(dp * pp))
    mem = None
    if math.isfinite(state.memory_bytes):
        mem = StageMemory(layer_bytes=state.layer_bytes, capacity=(tp * state.memory_bytes,) * pp)
    part = plan_pp(state.layer_costs, [float(tp)] * pp, memory=mem)
    q, rem = divmod(global_microbatches, dp)
    mb = tuple(q + (r < rem) for r in range(dp))
    plan = ExecutionPlan(version=0, tp_groups=groups, layer_partition=(part,) * dp, microbatches=mb)
    plan.validate(state.num_layers, global_microbatches)
    return plan


def _min_degree(state: ClusterState, part: Sequence[int], stage: int) -> int:
    start = sum(part[:stage])
    nbytes = sum(state.layer_bytes[start : start + part[stage]])
    if nbytes == 0 or math.isinf(state.memory_bytes):
        return 1
    return max(1, math.ceil(nbytes / state.memory_bytes * (1 - _REL)))


def _live_members(
    state: ClusterState, group: tuple[int, ...], part: Sequence[int], stage: int
) -> tuple[int, ...]:
    """steptune's TP step: keep every live member (uneven shares absorb slowness; a member too slow for
    one unit gets none). Raises ValueError if none is left or the survivors cannot hold the stage."""
    live = tuple(d for d in group if state.speeds[d] > 0)
    start = sum(part[:stage])
    nbytes = sum(state.layer_bytes[start : start + part[stage]])
    if not live or nbytes > state.group_capacity(live) * (1 + _REL):
        raise ValueError(f"{len(live)} live member(s) cannot hold the stage's {nbytes:.3g} bytes")
    return live


def _layers_moved(old: Sequence[int], new: Sequence[int]) -> int:
    def owner(p: Sequence[int]) -> list[int]:
        return [s for s, n in enumerate(p) for _ in range(n)]

    return sum(a != b for a, b in zip(owner(old), owner(new), strict=True))


def _not_worth(t0: float, t1: float, cost: float, dur: float) -> str:
    return f"would cut the step {t0:.4g} -> {t1:.4g} s: not worth {cost:.4g} s over {dur:.4g} s"


def _who(d: int, speeds: Sequence[float]) -> str:
    return f"device {d} ({'dead' if speeds[d] <= 0 else f'speed {speeds[d]:.2f}'})"


@dataclass(kw_only=True, slots=True)
class _Work:
    """The plan being built; replicas may be dropped, ``ids`` keeps their original indices."""

    ids: list[int]
    tp: _Groups
    part: list[tuple[int, ...]]
    mb: list[int]
    total: int
    per_replica: bool = False
    """Also consider a partition per replica (needs layer-wise DP gradient sync)."""

    def step(
        self, state: ClusterState, tp: _Groups | None = None, part: list[tuple[int, ...]] | None = None
    ) -> float:
        return _rebalance(
            state, self.tp if tp is None else tp, self.part if part is None else part, self.total
        )[1]


def _tp_step(state: ClusterState, w: _Work, dur: float, costs: ReconfigCosts, log: list[str]) -> None:
    sp = state.speeds

    def dead(g: tuple[int, ...]) -> bool:
        return any(sp[d] <= 0 for d in g)

    jobs = [(r0, s) for r, r0 in enumerate(w.ids) for s in range(len(w.tp[r]))]
    # Groups holding a dead device first: until they change every plan is infinitely slow.
    for r0, s in sorted(jobs, key=lambda j: (not dead(w.tp[w.ids.index(j[0])][j[1]]), j)):
        if r0 not in w.ids:
            continue
        r = w.ids.index(r0)
        g, name = w.tp[r][s], f"group (dp{r0},pp{s})"
        try:
            if state.tp_shares:
                new = _live_members(state, g, w.part[r], s)
            else:
                new = plan_tp(g, sp, num_heads=state.num_heads, min_degree=_min_degree(state, w.part[r], s))
        except ValueError as e:
            if not dead(g):
                raise
            log.append(f"DP: dropping replica dp{r0}: {name} lost a device and {e}")
            del w.ids[r], w.tp[r], w.part[r], w.mb[r]
            if not w.ids:
                raise ValueError(
                    "no DP replica survives; replace devices and restart from a checkpoint"
                ) from e
            continue
        if new == g:
            continue
        cand = [list(x) for x in w.tp]
        cand[r][s] = new
        gone = ", ".join(_who(d, sp) for d in g if d not in new)
        what = f"{len(g)} -> {len(new)} devices, excluding {gone}"
        if dead(g):
            w.tp = cand
            log.append(f"TP: {name} {what} (forced)")
            continue
        t0, t1 = w.step(state), w.step(state, tp=cand)
        if should_apply(t0, t1, dur, costs.tp_s):
            w.tp = cand
            log.append(f"TP: {name} {what}; step {t0:.4g} -> {t1:.4g} s")
        else:
            log.append(f"TP: kept {name}: {what} {_not_worth(t0, t1, costs.tp_s, dur)}")


def _pp_step(state: ClusterState, w: _Work, dur: float, costs: ReconfigCosts, log: list[str]) -> None:
    speeds = [[state.group_throughput(g) for g in groups] for groups in w.tp]
    caps = [[state.group_capacity(g) for g in groups] for groups in w.tp]

    def mem(c: Sequence[float]) -> StageMemory | None:
        if math.isinf(state.memory_bytes):
            return None
        return StageMemory(layer_bytes=state.layer_bytes, capacity=tuple(c))

    # A shared partition must fit every replica's stage and is paced, per stage, by the slowest replica.
    shared_mem = mem([min(c) for c in zip(*caps, strict=True)])
    options = []
    cur = w.part[0] if len(set(w.part)) == 1 else None
    shared_speeds = tuple(min(x) for x in zip(*speeds, strict=True))
    for v in dict.fromkeys([shared_speeds, *map(tuple, speeds)]):  # distinct, in order
        with contextlib.suppress(ValueError):  # memory may admit no shared partition
            options.append(plan_pp(state.layer_costs, v, memory=shared_mem, prefer=cur))
    if cur is not None:
        options.append(cur)  # fits: step 1 kept every stage within its memory
    cands = [[o] * len(w.tp) for o in options]
    if w.per_replica and len(w.tp) > 1:
        with contextlib.suppress(ValueError):
            own = [
                plan_pp(state.layer_costs, v, memory=mem(c), prefer=p)
                for v, c, p in zip(speeds, caps, w.part, strict=True)
            ]
            if own not in cands:
                cands.append(own)
    if cands:
        # Prefer the current partition on ties: moving layers is never free.
        new = min(cands, key=lambda c: (w.step(state, part=c), c != w.part, c))
    else:
        new = [
            plan_pp(state.layer_costs, v, memory=mem(c), prefer=p)
            for v, c, p in zip(speeds, caps, w.part, strict=True)
        ]
    if new == w.part:
        return
    moved = max(_layers_moved(a, b) for a, b in zip(w.part, new, strict=True))
    cost = costs.pp_s + costs.pp_per_layer_s * moved
    t0, t1 = w.step(state), w.step(state, part=new)
    if len(set(new)) == 1:
        what = f"{w.part[0]} -> {new[0]} on all replicas"
    else:
        what = "per replica: " if w.per_replica else "per replica (memory admits no shared partition): "
        what += ", ".join(f"dp{i} {p}" for i, p in zip(w.ids, new, strict=True))
    if should_apply(t0, t1, dur, cost):
        w.part = new
        log.append(f"PP: {what}, {moved} layers move; step {t0:.4g} -> {t1:.4g} s")
    else:
        log.append(f"PP: kept {w.part[0]}: {what} {_not_worth(t0, t1, cost, dur)}")


def _dp_step(state: ClusterState, w: _Work, dur: float, costs: ReconfigCosts, log: list[str]) -> None:
    new, t1 = _rebalance(state, w.tp, w.part, w.total)
    lost = sum(w.mb) != w.total  # a dropped replica's microbatches must go somewhere
    t0 = math.inf if lost else _step_time(state, w.tp, w.part, w.mb)
    if new == w.mb or t1 >= t0:
        return  # equal step time: a different tie is no change worth making
    what = f"microbatches {tuple(w.mb)} -> {tuple(new)} on replicas {', '.join(f'dp{i}' for i in w.ids)}"
    if lost or should_apply(t0, t1, dur, costs.dp_s):
        w.mb = new
        log.append(f"DP: {what}; step {t0:.4g} -> {t1:.4g} s")
    else:
        log.append(f"DP: kept {what} {_not_worth(t0, t1, costs.dp_s, dur)}")


def progressive_replan(
    state: ClusterState,
    plan: ExecutionPlan,
    *,
    expected_fault_duration_s: float,
    reconfig_costs: ReconfigCosts,
    per_replica_partitions: bool = False,
) -> tuple[ExecutionPlan, list[str]]:
    """ResiHP's scheduler: TP exclusion, then PP repartition, then DP counts, each behind ``should_apply``.

    Each gate compares modelled step times after the (nearly free) DP rebalance, with and without
    the step. Step 1 (TP): per group, ``plan_tp`` under the memory floor of its current layers; groups
    holding a dead device go first and are forced, and one with no feasible degree drops its replica.
    Step 2 (PP): one partition for all replicas, the best modelled among the current one and
    ``plan_pp`` for the per-stage slowest speeds and for each replica's speeds; per-replica partitions
    only when memory admits no shared one, or, with ``per_replica_partitions`` (a runtime whose DP
    gradient sync is per layer, not per stage), when one per replica models faster. Step 3 (DP):
    exact counts for equal microbatches (the runtime assigns concrete microbatches with ``plan_dp``
    and ``migrate``).
    Returns the plan with version + 1 (the input plan itself if nothing changed) and one line per decision.
    """
    total = sum(plan.microbatches)
    plan.validate(state.num_layers, total)
    if max(d for g in plan.tp_groups for d in g) >= len(state.speeds):
        raise ValueError(f"plan uses device ids beyond the {len(state.speeds)} speeds in the cluster state")
    w = _Work(
        ids=list(range(plan.num_replicas)),
        tp=[[plan.group(r, s) for s in range(plan.num_stages)] for r in range(plan.num_replicas)],
        part=list(plan.layer_partition),
        mb=list(plan.microbatches),
        total=total,
        per_replica=per_replica_partitions,
    )
    log: list[str] = []
    for step in (_tp_step, _pp_step, _dp_step):
        step(state, w, expected_fault_duration_s, reconfig_costs, log)
    groups = tuple(g for gs in w.tp for g in gs)
    shares = None
    if state.tp_shares:
        counts = tuple(water_fill(g, state.speeds, state.num_heads) for g in groups)
        if any(len(set(c)) > 1 for c in counts):
            shares = counts
            log.append("TP shares (units per member): " + ", ".join(
                f"{g} {c}" for g, c in zip(groups, counts, strict=True) if len(set(c)) > 1
            ))  # fmt: skip
    if (groups, tuple(w.part), tuple(w.mb), shares) == (
        plan.tp_groups, plan.layer_partition, plan.microbatches, plan.tp_shares
    ):  # fmt: skip
        return plan, [*log, "no change"]
    out = ExecutionPlan(
        version=plan.version + 1, tp_groups=groups, layer_partition=tuple(w.part), microbatches=tuple(w.mb),
        tp_shares=shares,
    )  # fmt: skip
    out.validate(state.num_layers, total)
    assert all(state.speeds[d] > 0 for g in groups for d in g), "planner left a dead device in the plan"
    return out, log
