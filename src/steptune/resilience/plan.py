"""Plan and state types: ``ExecutionPlan`` (who runs what), ``ClusterState`` (what the planners know).

Shared by the planners (``planners``, ``progressive``), the simulator and the runtime; nothing here touches
torch.distributed. Plans and states are frozen: ranks agree on ``ExecutionPlan.digest()`` before switching.

Model (approximate where stated):
- Device ``i`` runs at speed ``p_i`` in (0, 1] of a healthy device; ``p_i == 0`` means dead.
- ``layer_costs[l]``: seconds one microbatch (F + B + W) spends in layer ``l`` on ONE healthy device
  (from the workload predictor). A TP group of ``k`` devices runs at ``k * min p`` healthy-device units:
  the slowest member paces every collective. Approximate: TP communication overhead is ignored.
- ``layer_bytes[l]``: the layer's resident state (params, grads, optimizer, activations), sharded evenly
  over the TP group; a stage fits if ``sum(layer_bytes) / k <= memory_bytes``.
"""

from __future__ import annotations

import functools
import hashlib
import json
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

__all__ = [
    "ClusterState",
    "ExecutionPlan",
    "ReconfigCosts",
    "StageMemory",
    "group_speed",
    "shares_speed",
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
