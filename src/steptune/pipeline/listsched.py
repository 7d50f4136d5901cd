"""Bubble-aware list scheduler: builds a per-device order for any partition and placement.

On each device, whenever it can start something, it picks among the actions whose inputs have
arrived: the backward-input of the oldest microbatch first (it is on the critical path of the
devices upstream), then a forward if the stage's in-flight limit and the memory cap allow it,
and a deferred weight-gradient W only to fill time when nothing else is ready (or when the memory
cap forces activations to be freed). This is zero-bubble's idea generalized to unequal stages.

The order it returns is re-simulated by ``simulate`` (which adds channel contention), so the
scheduler's own clock is only a heuristic guide.
"""

from __future__ import annotations

from dataclasses import dataclass

from steptune.pipeline.costs import StageCosts
from steptune.pipeline.schedule import Action, ActionKind, Schedule

__all__ = ["ListPolicy", "list_schedule"]


@dataclass(frozen=True, kw_only=True, slots=True)
class ListPolicy:
    extra_inflight: int = 0
    """Microbatches a stage may run ahead beyond the 1F1B warm-up depth (S - s before its I) and beyond
    ZB-H1's bound (S before its W)."""
    forward_first: bool = False
    """Prefer a ready F over a ready I (fills the warm-up faster, holds more memory)."""
    split_backward: bool = True
    """Emit I and W separately (W deferred to fill bubbles); False emits fused B."""
    memory_cap: float | None = None
    """Bytes per device; an F that would exceed it waits (W's are pulled in to free memory)."""
    stage_extra: tuple[int, ...] | None = None
    """Per-stage override of ``extra_inflight`` (the tuner's randomized multi-start sets these)."""
    stage_forward_first: tuple[bool, ...] | None = None
    """Per-stage override of ``forward_first``."""
    tag: str = ""
    """Appended to the label (e.g. the multi-start seed)."""

    def __post_init__(self) -> None:
        extras = [self.extra_inflight, *(self.stage_extra or ())]
        if min(extras) < 0:
            raise ValueError(f"extra_inflight (and stage_extra) must be >= 0 microbatches, got {min(extras)}")

    def label(self) -> str:
        return (
            f"list(+{self.extra_inflight}{',F' if self.forward_first else ''}"
            f"{',IW' if self.split_backward else ',B'}{',' + self.tag if self.tag else ''})"
        )

    def extra(self, stage: int) -> int:
        return self.stage_extra[stage] if self.stage_extra is not None else self.extra_inflight

    def f_first(self, stage: int) -> bool:
        return self.stage_forward_first[stage] if self.stage_forward_first is not None else self.forward_first


def list_schedule(
    costs: StageCosts,
    placement: tuple[int, ...],
    num_microbatches: int,
    policy: ListPolicy,
    *,
    name: str | None = None,
    partition: tuple[int, ...] | None = None,
) -> Schedule:
    num_stages = len(placement)
    num_dev = max(placement) + 1
    last = num_stages - 1
    mbs = num_microbatches
    stages_on = [[s for s in range(num_stages) if placement[s] == d] for d in range(num_dev)]
    static = [sum(costs.static_bytes[s] for s in stages_on[d]) for d in range(num_dev)]
    mem = list(static)
    next_f = [0] * num_stages  # next microbatch to forward, per stage
    next_b = [0] * num_stages  # next microbatch to run backward-input (or fused B), per stage
    pending_w: list[list[int]] = [[] for _ in range(num_stages)]
    done_f: dict[tuple[int, int], float] = {}
    done_b: dict[tuple[int, int], float] = {}
    dev_free = [0.0] * num_dev
    orders: list[list[Action]] = [[] for _ in range(num_dev)]
    # 1F1B's warm-up depth bounds F-to-I; ZB-H1's bound (S) limits F-to-W, so W's can be deferred.
    limit_fi = [num_stages - s + policy.extra(s) for s in range(num_stages)]
    limit_fw = [num_stages + policy.extra(s) for s in range(num_stages)]
    inflight_fi = [0] * num_stages  # F done, I (or B) not yet
    inflight = [0] * num_stages  # F done, W (or B) not yet
    cap = policy.memory_cap
    remaining = num_stages * mbs * (3 if policy.split_backward else 2)

    def comm(stage: int, src: int, dst: int) -> float:
        return costs.comm_time(stage) if placement[src] != placement[dst] else 0.0

    def f_ready(s: int) -> float | None:
        m = next_f[s]
        if m >= mbs:
            return None
        if s == 0:
            return 0.0
        t = done_f.get((s - 1, m))
        return None if t is None else t + comm(s - 1, s - 1, s)

    def b_ready(s: int) -> float | None:
        m = next_b[s]
        if m >= mbs or m >= next_f[s]:
            return None
        t_f = done_f[(s, m)]
        if s == last:
            return t_f
        t = done_b.get((s + 1, m))
        return None if t is None else max(t_f, t + comm(s, s + 1, s))

    split = policy.split_backward
    b_kind = ActionKind.I if split else ActionKind.B
    b_dur = [costs.i[s] + (0.0 if split else costs.w[s]) for s in range(num_stages)]
    # Priorities at equal start times (lower first): older microbatches and later stages first, they
    # unblock the most work upstream; a stage that prefers forwards ranks its F before its I.
    b_prio = [4 if policy.f_first(s) else 0 for s in range(num_stages)]
    f_prio = [1 if policy.f_first(s) else 5 for s in range(num_stages)]
    w_prio = 8

    def device_first(d: int) -> tuple[float, int, Action, float] | None:
        """The action device ``d`` would run next, as (start, priority, action, duration)."""
        free = dev_free[d]
        # (start, priority, -stage, microbatch, kind, stage, duration): the first four are unique per
        # candidate (a stage offers at most one action of each priority), so tuple order is the rule.
        cands: list[tuple[float, int, int, int, ActionKind, int, float]] = []
        for s in stages_on[d]:
            tb = b_ready(s)
            if tb is not None:
                cands.append((max(free, tb), b_prio[s], -s, next_b[s], b_kind, s, b_dur[s]))
            tf = f_ready(s)
            if (
                tf is not None
                and inflight_fi[s] < limit_fi[s]
                and inflight[s] < limit_fw[s]
                and (cap is None or mem[d] + costs.act_bytes[s] <= cap)
            ):
                cands.append((max(free, tf), f_prio[s], -s, next_f[s], ActionKind.F, s, costs.f[s]))
            if pending_w[s]:
                cands.append((free, w_prio, -s, pending_w[s][0], ActionKind.W, s, costs.w[s]))
        if not cands:
            return None
        first = min(cands)
        if first[1] == w_prio:
            # A W only runs if nothing else could start no later than it would finish.
            earliest = min((c for c in cands if c[1] != w_prio), default=None)
            if earliest is not None and earliest[0] <= first[0]:
                first = earliest
        else:
            # among actions that can start at the same time, use the priority
            first = min((c for c in cands if c[0] <= first[0] + 1e-12), key=lambda c: c[1:4])
        t0, prio, _, m, kind, s, dur = first
        return t0, prio, Action(s, kind, m), dur

    # A device's next action depends only on its own clock and memory, its stages' state and the
    # neighbouring stages' completions, so after each action only three devices need a new look.
    firsts = [device_first(d) for d in range(num_dev)]
    while remaining:
        # the earliest start, ties to the lowest device
        pick = min(((f[0], d) for d, f in enumerate(firsts) if f is not None), default=None)
        if pick is None:
            # Only reachable when the memory cap blocks every forward and nothing can free memory.
            raise ValueError(
                f"memory cap {cap:.3g} B is too small for this partition: a forward cannot fit even "
                f"with every weight gradient done; raise the cap or use more stages"
            )
        best = firsts[pick[1]]
        assert best is not None
        t0, _, a, dur = best
        d = placement[a.stage]
        dev_free[d] = t0 + dur + costs.overhead
        orders[d].append(a)
        remaining -= 1
        s, m = a.stage, a.microbatch
        if a.kind is ActionKind.F:
            done_f[(s, m)] = dev_free[d]
            next_f[s] += 1
            inflight[s] += 1
            inflight_fi[s] += 1
            mem[d] += costs.act_bytes[s]
        elif a.kind is ActionKind.I:
            done_b[(s, m)] = dev_free[d]
            next_b[s] += 1
            inflight_fi[s] -= 1
            pending_w[s].append(m)
        else:  # W or fused B
            if a.kind is ActionKind.B:
                done_b[(s, m)] = dev_free[d]
                next_b[s] += 1
                inflight_fi[s] -= 1
            else:
                pending_w[s].pop(0)
            inflight[s] -= 1
            mem[d] -= costs.act_bytes[s]
        for dd in {d, placement[s - 1] if s > 0 else d, placement[s + 1] if s < last else d}:
            firsts[dd] = device_first(dd)
    return Schedule(
        name=name or policy.label(),
        num_stages=num_stages,
        num_microbatches=mbs,
        placement=placement,
        orders=tuple(tuple(o) for o in orders),
        partition=partition,
    ).validate()
