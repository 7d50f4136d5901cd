"""The memory-aware planner: which packed values each block signature keeps, minimizing measured
replay time under one limit on the step's peak memory.

Decision model (per block signature, from its :class:`BlockProfile`): binary ``r_n`` (replay node
n), ``s_p`` (keep packed value p), ``g_G`` (storage group G is held). Every packed value is kept or
all of its producers (its slot's producer and the in-place writers up to its version) replay; a
replayed node's inputs are kept or replayed likewise (producer elimination: keeping a value frees
every producer needed only for it). Force-saved nodes never replay; their outputs are held anyway.
Objective: sum of measured replay time. Memory: a kept group costs its storage bytes in every block
of the signature.

Peak model: ``peak = base + sum_sig num_blocks * kept_bytes(sig) + max_sig work(sig)``, where
``work`` is the replay working set (liveness over the replay order, packed values held to the end)
and ``base`` is calibrated so that the model equals one measured replay-only step. In the MILP the
working set is the replay-only one (an upper bound: keeping values only shrinks what replays); the
reported prediction uses each plan's own.

The model's last block is planned apart: backward reaches it first, while every other block's
kept values are alive in any case, and it has finished (its values freed) before any other block
replays. Keeping all of its packed values therefore costs ``max(its activations, working set)``
instead of adding to the sum, which is free whenever its activations fit in the working set.
Then it never replays (the reason HF's ``every_n_layers=2`` costs no more peak than full
checkpointing on a two-layer model, found by the bench).
"""

from __future__ import annotations

import math
import numbers
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from steptune.memory.apply import SavePlan
from steptune.memory.profile import BlockProfile
from steptune.memory.tape import Tape, ValueKey, backward_slice

__all__ = [
    "BlockPlan",
    "MemoryPlan",
    "PeakModel",
    "limit_bytes",
    "parse_limit",
    "plan_saves",
    "plan_within",
    "replay_cost",
    "replay_only_plan",
    "working_set",
]


@dataclass(frozen=True, slots=True)
class PeakModel:
    base: int
    """Everything but kept values and the replay working set (static memory, block inputs,
    force-saved values, backward transients), calibrated by one measured replay-only step."""
    base_last_free: int | None = None
    """The same, calibrated by a measured replay-only step whose last block keeps everything
    (the peak may then move to the end of forward); None when not measured."""
    head: int | None = None
    """The replay-only step's peak before any block replays (forward, loss and the head's backward;
    :func:`steptune.memory.measure.head_peak_probe`). Kept values are alive there too, but no replay
    working set: where this phase holds the peak (a large vocabulary), keeping a value costs its whole
    size. None: not measured (the prediction then assumes the peak is in a block's backward)."""
    head_last_free: int | None = None
    """The same for the calibration step whose last block keeps everything; None: not measured."""
    last_phase_last_free: int | None = None
    """That step's own peak during the last block's backward (``measure_peak(..., phases=)``): every
    other block's kept values are alive there and nothing replays. None: not measured."""
    rest_last_free: int | None = None
    """That step's own peak after the last block's backward, where the other blocks replay; None: not
    measured. With both measured, a plan whose last block keeps everything is priced per phase (one
    ``base_last_free`` over-credited the working set where the last block's phase held the peak: plans
    went over their limit by one gradient's bytes, found in a sweep)."""

    def predict(
        self,
        profiles: dict[Any, BlockProfile],
        keeps: dict[Any, frozenset[ValueKey]],
        last_free: bool = False,
    ) -> int:
        """With ``last_free`` the model's last block keeps every packed value and never replays."""
        kept = sum(
            (p.num_blocks - (last_free and p.has_last)) * kept_bytes(p, keeps.get(k, frozenset()))
            for k, p in profiles.items()
        )
        work = max(working_set(p, keeps.get(k, frozenset())) for k, p in profiles.items())
        head = -1 if self.head is None else self.head + kept
        if not last_free:
            return max(self.base + kept + work, head)
        if self.base_last_free is None:
            raise ValueError(
                "this peak model was not calibrated with the last block kept; pass last_free_peak"
            )
        head_lf = -1 if self.head_last_free is None else self.head_last_free + kept
        if self.last_phase_last_free is not None and self.rest_last_free is not None:
            rest = _rest_work(profiles, keeps)
            return max(
                head_lf,
                self.last_phase_last_free + kept,
                self.rest_last_free - _rest_work(profiles, {}) + kept + rest,
            )
        return max(self.base_last_free + kept + max(work, _last_packed(profiles)), head_lf)


def _rest_work(profiles: dict[Any, BlockProfile], keeps: dict[Any, frozenset[ValueKey]]) -> int:
    """The largest replay working set among the blocks other than the model's last."""
    return max(
        (working_set(p, keeps.get(k, frozenset())) for k, p in profiles.items() if p.num_blocks > p.has_last),
        default=0,
    )


def _last_packed(profiles: dict[Any, BlockProfile]) -> int:
    return max((all_packed_bytes(p) for p in profiles.values() if p.has_last), default=0)


def last_free_plan(profiles: dict[Any, BlockProfile]) -> SavePlan:
    """Replay-only, except the model's last block, which keeps every packed value."""
    for p in profiles.values():
        if p.has_last and p.names:
            return SavePlan({p.names[-1]: frozenset(i for i, k in enumerate(p.tape.packs) if k is not None)})
    return SavePlan({})


def calibrate(
    profiles: dict[Any, BlockProfile],
    measured_replay_only_peak: int,
    last_free_peak: int | None = None,
    head_peak: int | None = None,
    head_last_free_peak: int | None = None,
    last_free_phases: list[int] | None = None,
) -> PeakModel:
    """``last_free_peak``: the measured peak under :func:`last_free_plan` (optional); ``head_peak`` and
    ``head_last_free_peak``: those two steps' peaks before any block replays (optional;
    ``measure_peak(..., head=out)``); ``last_free_phases``: the :func:`last_free_plan` step's three
    phase peaks (optional; ``measure_peak(..., phases=out)``; ignored unless there are three)."""
    work = max(working_set(p, frozenset()) for p in profiles.values())
    base_last = None
    if last_free_peak is not None:
        base_last = last_free_peak - max(work, _last_packed(profiles))
    # three peaks or none: measure_peak gives fewer where it saw no boundary (a last block whose input
    # needs no gradient), and the single-base model stands then
    phases = (
        last_free_phases
        if last_free_peak is not None and last_free_phases and len(last_free_phases) == 3
        else []
    )
    return PeakModel(
        base=measured_replay_only_peak - work,
        base_last_free=base_last,
        head=head_peak,
        head_last_free=head_last_free_peak if last_free_peak is not None else None,
        last_phase_last_free=phases[1] if phases else None,
        rest_last_free=phases[2] if phases else None,
    )


@dataclass(frozen=True, slots=True)
class BlockPlan:
    keep: frozenset[ValueKey]
    replay_nodes: tuple[int, ...]
    replay_s: float
    kept_bytes: int
    work_bytes: int


@dataclass(frozen=True, slots=True)
class MemoryPlan:
    limit: int
    blocks: dict[Any, BlockPlan]
    last_block: str | None
    """FQN of the model's last block when it keeps every packed value (no replay), else None."""
    predicted_peak: int
    predicted_replay_s: float
    """Per step, over every block."""
    solver: str
    solve_s: float

    def save_plan(self, profiles: dict[Any, BlockProfile]) -> SavePlan:
        saves = {}
        for key, plan in self.blocks.items():
            packs = profiles[key].tape.packs
            saves[key] = frozenset(i for i, p in enumerate(packs) if p is not None and p in plan.keep)
            if self.last_block is not None and self.last_block in profiles[key].names:
                saves[self.last_block] = frozenset(i for i, p in enumerate(packs) if p is not None)
        # distinct blocks, not recordings: a block called twice (shared weights) is one block (a review)
        blocks = {name for p in profiles.values() for name in p.names}
        return SavePlan(saves, limit=self.limit, num_blocks=len(blocks))


def _available(tape: Tape) -> set[ValueKey]:
    """Values replay never has to produce: outputs of force-saved nodes at their final version."""
    out: set[ValueKey] = set()
    for node in tape.nodes:
        if node.force_save is not None:
            for _, sid in node.outs:
                out.add(tape.final(sid))
    return out


def replay_cost(profile: BlockProfile, keep: frozenset[ValueKey]) -> tuple[list[int], float]:
    order, _ = backward_slice(
        profile.tape, profile.tape.packed_internal(), set(keep) | _available(profile.tape)
    )
    return order, sum(profile.cost_s[n] for n in order)


def kept_bytes(profile: BlockProfile, keep: frozenset[ValueKey]) -> int:
    groups = {profile.tape.slots[sid].group for sid, _ in keep}
    return sum(profile.group_bytes[g] for g in groups)


def all_packed_bytes(profile: BlockProfile) -> int:
    return kept_bytes(profile, frozenset(profile.tape.packed_internal()))


def working_set(profile: BlockProfile, keep: frozenset[ValueKey]) -> int:
    """Peak bytes the replay allocates: storages created by replayed nodes, held until their last
    read in the slice, packed ones until the end."""
    tape = profile.tape
    order, _ = replay_cost(profile, keep)
    packed_groups = {tape.slots[sid].group for sid, _ in tape.packed_internal()}
    kept_groups = {tape.slots[sid].group for sid, _ in keep}
    # Views of parameters and inputs (a weight's transpose, say) allocate nothing.
    external_groups = {slot.group for slot in tape.slots if slot.producer == -1}
    last: dict[int, int] = {}
    for pos, n in enumerate(order):
        for sid, _ in tape.nodes[n].reads:
            last[tape.slots[sid].group] = pos
    live: dict[int, int] = {}
    peak = 0
    for pos, n in enumerate(order):
        for _, sid in tape.nodes[n].outs:
            slot = tape.slots[sid]
            if slot.producer == n and slot.group not in kept_groups and slot.group not in external_groups:
                live.setdefault(slot.group, profile.group_bytes[slot.group])
        peak = max(peak, sum(live.values()))
        for group in list(live):
            if group not in packed_groups and last.get(group, -1) <= pos:
                del live[group]
    return peak


def _deps(tape: Tape, key: ValueKey) -> list[int]:
    sid, version = key
    slot = tape.slots[sid]
    if slot.producer < 0:
        return []
    nodes = [slot.producer]
    for after, writer in tape.group_writes.get(slot.group, []):
        if slot.born < after <= version:
            nodes.append(writer)
    return [n for n in nodes if tape.nodes[n].force_save is None]


def _size(n: float) -> str:
    """Bytes in the largest binary unit that keeps the number >= 1 (1 KiB is not '0.0 MiB')."""
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(n) >= scale:
            return f"{n / scale:.1f} {unit}"
    return f"{n:.0f} B"


def _exact(n: float) -> str:
    """Bytes exactly, then in the largest binary unit (notes whose sizes differ by a few KiB stay apart)."""
    return f"{n:,.0f} B ({_size(n)})"


def parse_limit(text: str, what: str = "--limit") -> float:
    """Bytes (with a unit, or a whole number >= 1024) or a fraction in (0, 1]; ValueError otherwise."""
    units = {"KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "KB": 1e3, "MB": 1e6, "GB": 1e9}
    upper = text.strip().upper()
    unit = next((u for u in units if upper.endswith(u)), None)
    try:
        value = float(upper[: -len(unit)] if unit else upper) * (units[unit] if unit else 1.0)
    except ValueError:
        raise ValueError(
            f"{what} {text!r}: write bytes (300MiB, 2GiB, 123456789) or a fraction in (0, 1]"
        ) from None
    if not 0 < value < math.inf:
        raise ValueError(
            f"{what} must be positive and finite (bytes, e.g. 300MiB, or a fraction in (0, 1]); got {text}"
        )
    if unit is None and 1 < value < 1024:
        raise ValueError(f"{what} {text}: a fraction must lie in (0, 1]; for bytes give a unit (e.g. 300MiB)")
    return value


def limit_bytes(limit: Any, what: str = "limit") -> int:
    """A step-peak limit given to the Python API, as whole bytes: an int, a finite float, a numpy or torch
    scalar, or a string with a unit (``"300MiB"``, checked as the CLI's ``--limit``). The CLI's fraction
    form (0.5: half way from replay-only to no checkpointing) needs measured peaks, so here it is refused
    with the sum to write; so are NaN, infinities, zero, negatives and booleans (a sweep: ``0.5`` gave "no
    plan fits a peak limit of 0 B", ``"8MiB"`` a TypeError, a numpy scalar was stored as the plan's limit)."""

    def fraction_refused(value: float) -> ValueError:
        return ValueError(
            f"{what}={limit!r}: the fraction form is the CLI's (--limit 0.5); the Python API takes bytes: "
            f"pass int(floor + {value} * (top - floor)) with the measured replay-only and no_ac peaks"
        )

    if isinstance(limit, str):
        value = parse_limit(limit, what)
        if value <= 1.0:
            raise fraction_refused(value)
        return int(value)
    if getattr(limit, "ndim", None) == 0 and hasattr(limit, "item"):
        limit = limit.item()  # a numpy or torch scalar
    if isinstance(limit, bool) or not isinstance(limit, numbers.Real):
        raise TypeError(
            f"{what} must be a number of bytes (an int such as 300 * 2**20, or '300MiB'), got "
            f"{type(limit).__name__} {limit!r}"
        )
    if not 0 < limit < math.inf:
        raise ValueError(f"{what} must be a positive, finite number of bytes; got {limit!r}")
    if limit <= 1:
        raise fraction_refused(limit)
    return int(limit)


def plan_saves(
    profiles: dict[Any, BlockProfile],
    peak: PeakModel,
    limit: int,
    *,
    solver: str = "milp",
    time_limit_s: float = 10.0,
    last_block_free: bool = True,
) -> MemoryPlan:
    """The fastest plan whose predicted peak is at most ``limit`` bytes (see :func:`limit_bytes`)."""
    limit = limit_bytes(limit)
    start = time.perf_counter()
    floor = peak.predict(profiles, {})
    can_free = (
        last_block_free and peak.base_last_free is not None and any(p.has_last for p in profiles.values())
    )
    free_floor = peak.predict(profiles, {}, last_free=True) if can_free else None
    if free_floor is not None and free_floor <= limit:
        # Both ways fit: keep the last block whole if that replays less.
        with_last = _plan(profiles, peak, limit, solver, time_limit_s, True, start)
        without = _plan(profiles, peak, limit, solver, time_limit_s, False, start) if floor <= limit else None
        if without is None or with_last.predicted_replay_s <= without.predicted_replay_s:
            return with_last
        return without
    if limit < floor:
        smallest = min(floor, free_floor) if free_floor is not None else floor
        raise ValueError(
            f"no plan fits a peak limit of {_size(limit)}: replaying everything already peaks at "
            f"{_size(floor)} (static memory, block inputs and the replay working set); raise the "
            f"limit to at least {smallest} bytes ({_size(smallest)})"
        )
    return _plan(profiles, peak, limit, solver, time_limit_s, False, start)


def plan_within(
    profiles: dict[Any, BlockProfile],
    peak: PeakModel,
    limit: int,
    measure: Callable[[MemoryPlan], int],
    *,
    tries: int = 3,
    **options: Any,
) -> tuple[MemoryPlan, int, list[str]]:
    """:func:`plan_saves`, then ``measure(plan)`` (the step's measured peak); over ``limit``, plan again
    with the limit lowered by twice the last cut plus the overshoot, at most ``tries`` plans, then replay
    only; a plan the same as one measured already is not measured again. Returns (plan, its measured
    peak, what was tightened). The peak model is calibrated on
    replay-only steps, and where keeping a value does not shrink the replay working set as predicted (a
    3-block MLP with a host sync and dropout: 4.5-6.9% over, found in a 2026-12-05 sweep) a plan can exceed
    its limit. Raises ``ValueError`` when even replaying everything measures over ``limit``."""
    limit = limit_bytes(limit)
    budget, cut, notes = limit, 0, []
    seen: dict[Any, int] = {}

    def measure_once(plan: MemoryPlan) -> int:
        # a cut of a few KiB often gives the plan just measured (a sweep: the same plan measured twice in a
        # row); its peak is known
        what = (
            plan.last_block,
            tuple(sorted((repr(k), tuple(sorted(b.keep))) for k, b in plan.blocks.items())),
        )
        if what not in seen:
            seen[what] = measure(plan)
        return seen[what]

    for _ in range(tries):
        try:
            plan = plan_saves(profiles, peak, budget, **options)
        except ValueError:
            if not notes:  # the limit itself is below any plan: plan_saves says what to raise it to
                raise
            break
        got = measure_once(plan)
        if got <= limit:
            return plan, got, notes
        cut = 2 * cut + (got - limit)
        notes.append(
            f"the plan for {_exact(budget)} measured {_exact(got)}, {_exact(got - limit)} over the limit: "
            f"planned again for {_exact(limit - cut)}"
        )
        budget = limit - cut
    # Plans change in steps the overshoot may not reach (a review: 3 cuts of a few KiB gave the same plan,
    # then replay only at 2.1x the replay of a plan that fit): a coarse walk down to the predicted floor
    floor = peak.predict(profiles, {})
    for frac in (0.25, 0.5, 0.75):
        lower = int(limit - frac * (limit - floor))
        if lower >= budget or lower < floor:
            continue
        try:
            plan = plan_saves(profiles, peak, lower, **options)
        except ValueError:
            break
        got = measure_once(plan)
        if got <= limit:
            notes.append(f"the plan for {_exact(lower)} measured {_exact(got)}, within the limit")
            return plan, got, notes
    plan = replay_only_plan(profiles, peak, limit)
    got = measure_once(plan)
    if got <= limit:
        notes.append(f"no kept value fit as measured: replay only ({_exact(got)})")
        return plan, got, notes
    raise ValueError(
        f"no plan measured within the peak limit of {_exact(limit)}, replaying everything included "
        f"({_exact(got)}; {'; '.join(notes)}); raise the limit"
    )


def replay_only_plan(profiles: dict[Any, BlockProfile], peak: PeakModel, limit: int) -> MemoryPlan:
    """The plan that keeps nothing: every block replays all it needs (``limit`` is only recorded)."""
    limit = limit_bytes(limit)
    blocks, total = {}, 0.0
    for key, profile in profiles.items():
        order, cost = replay_cost(profile, frozenset())
        blocks[key] = BlockPlan(frozenset(), tuple(order), cost, 0, working_set(profile, frozenset()))
        total += cost * profile.num_blocks
    return MemoryPlan(
        limit=limit, blocks=blocks, last_block=None, predicted_peak=peak.predict(profiles, {}),
        predicted_replay_s=total, solver="replay-only", solve_s=0.0,
    )  # fmt: skip


def _plan(
    profiles: dict[Any, BlockProfile],
    peak: PeakModel,
    limit: int,
    solver: str,
    time_limit_s: float,
    last_free: bool,
    start: float,
) -> MemoryPlan:
    work0 = max(working_set(p, frozenset()) for p in profiles.values())
    if last_free:
        assert peak.base_last_free is not None
        budget = limit - peak.base_last_free - max(work0, _last_packed(profiles))
    else:
        budget = limit - peak.base - work0
    counts = {k: p.num_blocks - (last_free and p.has_last) for k, p in profiles.items()}
    if solver not in ("milp", "greedy"):
        raise ValueError(f"unknown solver {solver!r}; choose 'milp' or 'greedy'")

    def solve(kept_budget: float) -> dict[Any, frozenset[ValueKey]]:
        if solver == "milp":
            return _solve_milp(profiles, counts, int(kept_budget), time_limit_s)
        return _solve_greedy(profiles, counts, int(kept_budget))

    keeps = solve(budget)
    if (peak.head_last_free if last_free else peak.head) is not None:
        keeps = _widen(profiles, peak, limit, last_free, counts, solve, budget, keeps, start, time_limit_s)
    blocks = {}
    total = 0.0
    for key, profile in profiles.items():
        keep = keeps.get(key, frozenset())
        order, cost = replay_cost(profile, keep)
        blocks[key] = BlockPlan(
            keep, tuple(order), cost, kept_bytes(profile, keep), working_set(profile, keep)
        )
        total += cost * counts[key]
    last = (
        next((p.names[-1] for p in profiles.values() if p.has_last and p.names), None) if last_free else None
    )
    return MemoryPlan(
        limit=limit,
        blocks=blocks,
        last_block=last,
        predicted_peak=peak.predict(profiles, keeps, last_free=last_free),
        predicted_replay_s=total,
        solver=solver,
        solve_s=time.perf_counter() - start,
    )


def _widen(
    profiles: dict[Any, BlockProfile],
    peak: PeakModel,
    limit: int,
    last_free: bool,
    counts: dict[Any, int],
    solve: Any,
    budget: int,
    keeps: dict[Any, frozenset[ValueKey]],
    start: float,
    time_limit_s: float,
) -> dict[Any, frozenset[ValueKey]]:
    """A larger kept-bytes budget, where the peak model allows it. ``budget`` charges a kept value its
    size on top of the replay-only working set, as if keeping it saved no replay memory: right where the
    head phase holds the peak, too strict where a block's backward does (keeping a value also shrinks that
    block's replay working set). With the head phase measured (``PeakModel.head``) the model prices both
    phases, so bisect the budget up to what either phase leaves and take the fastest plan whose predicted
    peak fits. Without the head phase measured the strict budget stands (the model alone could not tell
    the phases apart)."""
    if last_free:
        assert peak.base_last_free is not None and peak.head_last_free is not None
        if peak.last_phase_last_free is not None and peak.rest_last_free is not None:
            floor = max(peak.last_phase_last_free, peak.rest_last_free - _rest_work(profiles, {}))
        else:
            floor = peak.base_last_free + _last_packed(profiles)
        hi = limit - max(floor, peak.head_last_free)
    else:
        assert peak.head is not None
        hi = limit - max(peak.base, peak.head)  # no plan with more kept bytes fits either phase
    lo = budget

    def replay_s(k: dict[Any, frozenset[ValueKey]]) -> float:
        return sum(replay_cost(p, k.get(key, frozenset()))[1] * counts[key] for key, p in profiles.items())

    best, best_s = keeps, replay_s(keeps)
    for _ in range(12):
        if hi - lo < 2**16 or time.perf_counter() - start > time_limit_s:
            break
        mid = (lo + hi) / 2
        trial = solve(mid)
        if peak.predict(profiles, trial, last_free=last_free) <= limit:
            lo = mid
            if (s := replay_s(trial)) < best_s:
                best, best_s = trial, s
        else:
            hi = mid
    return best


def _candidates(profile: BlockProfile) -> list[ValueKey]:
    avail = _available(profile.tape)
    return [k for k in profile.tape.packed_internal() if k not in avail and _deps(profile.tape, k)]


def _solve_milp(
    profiles: dict[Any, BlockProfile], counts: dict[Any, int], budget: int, time_limit_s: float
) -> dict[Any, frozenset[ValueKey]]:
    from scipy.optimize import Bounds, LinearConstraint, milp
    from scipy.sparse import coo_matrix

    index: dict[tuple[Any, str, Any], int] = {}

    def var(*name: Any) -> int:
        return index.setdefault(name, len(index))

    rows: list[tuple[dict[int, float], float, float]] = []
    cost: dict[int, float] = {}
    memory: dict[int, float] = {}
    for key, profile in profiles.items():
        tape = profile.tape
        cands = set(_candidates(profile))
        avail = _available(tape)
        for n, node in enumerate(tape.nodes):
            if node.force_save is None:
                cost[var(key, "r", n)] = profile.cost_s[n] * counts[key]
        for p in tape.packed_internal():
            if p in avail:
                continue
            for m in _deps(tape, p):  # kept, or every producer replays
                row = {var(key, "r", m): 1.0}
                if p in cands:
                    row[var(key, "s", p)] = 1.0
                rows.append((row, 1.0, np.inf))
        for n, node in enumerate(tape.nodes):
            if node.force_save is not None:
                continue
            for k in set(node.reads):
                if k in avail:
                    continue
                for m in _deps(tape, k):  # a replayed node's input is kept or produced
                    row = {var(key, "r", m): 1.0, var(key, "r", n): -1.0}
                    if k in cands:
                        row[var(key, "s", k)] = 1.0
                    rows.append((row, 0.0, np.inf))
        for p in cands:
            g = var(key, "g", tape.slots[p[0]].group)
            rows.append(({g: 1.0, var(key, "s", p): -1.0}, 0.0, np.inf))
            memory[g] = float(profile.group_bytes[tape.slots[p[0]].group] * counts[key])
    rows.append((memory, -np.inf, float(budget)))
    num = len(index)
    c = np.zeros(num)
    for i, v in cost.items():
        c[i] = v
    data, ri, ci, lb, ub = [], [], [], [], []
    for r, (row, lo, hi) in enumerate(rows):
        for col, val in row.items():
            ri.append(r)
            ci.append(col)
            data.append(val)
        lb.append(lo)
        ub.append(hi)
    a = coo_matrix((data, (ri, ci)), shape=(len(rows), num)).tocsr()
    res = milp(
        c,
        constraints=LinearConstraint(a, np.array(lb), np.array(ub)),
        integrality=np.ones(num),
        bounds=Bounds(0, 1),
        options={"time_limit": time_limit_s},
    )
    if res.x is None:
        raise ValueError(f"the MILP found no plan ({res.message}); try solver='greedy'")
    keeps: dict[Any, set[ValueKey]] = {k: set() for k in profiles}
    for (key, kind, item), i in index.items():
        if kind == "s" and res.x[i] > 0.5:
            keeps[key].add(item)
    return {k: frozenset(v) for k, v in keeps.items()}


def _solve_greedy(
    profiles: dict[Any, BlockProfile], counts: dict[Any, int], budget: int
) -> dict[Any, frozenset[ValueKey]]:
    """Pick the value with the most replay time eliminated per byte, recomputed after each pick
    (unlike an independent-items knapsack, a pick changes what the others eliminate)."""
    keeps: dict[Any, set[ValueKey]] = {k: set() for k in profiles}
    used = 0
    while True:
        best: tuple[float, Any, ValueKey, int] | None = None
        for key, profile in profiles.items():
            _, now = replay_cost(profile, frozenset(keeps[key]))
            before = kept_bytes(profile, frozenset(keeps[key]))
            for cand in _candidates(profile):
                if cand in keeps[key]:
                    continue
                trial = frozenset(keeps[key] | {cand})
                extra = (kept_bytes(profile, trial) - before) * counts[key]
                if used + extra > budget:
                    continue
                gain = (now - replay_cost(profile, trial)[1]) * counts[key]
                if gain <= 0:
                    continue
                score = gain / max(extra, 1)
                if best is None or score > best[0]:
                    best = (score, key, cand, extra)
        if best is None:
            return {k: frozenset(v) for k, v in keeps.items()}
        _, key, cand, extra = best
        keeps[key].add(cand)
        used += extra
