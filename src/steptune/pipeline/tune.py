"""The bubble-aware co-tuner: partition, placement and schedule, searched together.

1. Seeds: for each placement family (sequential; looped and V with two stages per device) and
   each partition (layer-uniform; min-max balanced), every anchor schedule and the list scheduler
   under several policies. The anchors are seeds, so the tuner never returns anything slower
   than the best anchor that fits the memory cap.
2. Local search from the best seeds, driven by the simulator's bubble attribution: move a
   boundary layer off the busiest (least idle) device's stages, regenerate the schedule with the
   same recipe, keep the move if the simulated makespan drops and memory fits. Stops at a local
   optimum or when the time budget runs out.

All figures are simulated (see docs/pipeline.md).
"""

from __future__ import annotations

import math
import random
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

from steptune.core.specs import LinkSpec
from steptune.pipeline import anchors as _anchors
from steptune.pipeline.costs import (
    LayerCosts,
    balanced_partition,
    split_layer,
    stage_costs,
    uniform_partition,
)
from steptune.pipeline.listsched import ListPolicy, list_schedule
from steptune.pipeline.schedule import Schedule, ScheduleError
from steptune.pipeline.simulate import SimResult, simulate

__all__ = ["Candidate", "TuneConfig", "TuneResult", "lower_bound", "placement_for", "resimulate", "tune"]


@dataclass(frozen=True, kw_only=True, slots=True)
class TuneConfig:
    num_devices: int
    num_microbatches: int
    memory_cap: float | None = None
    """Bytes per device; candidates above it are rejected (anchors above it are reported as such)."""
    time_budget: float = 30.0
    """Seconds for the whole search: list-scheduler seeds stop at 50% (anchors always run),
    randomized multi-start at 70%, local search at 100%."""
    link: LinkSpec | None = None
    overhead: float = 0.0
    """Seconds added to every compute action."""
    families: tuple[str, ...] = ("seq", "loop2", "v")
    """Placement families to search: seq (one stage per device), loop<v> (v stages, looped), v (V shape)."""
    seed: int = 0
    """Seed of the randomized multi-start (the search is deterministic for a seed, up to the time budget)."""
    split_head: bool = True
    """Allow splitting a heavy LM head into vocabulary shards chained with an online softmax."""

    def __post_init__(self) -> None:
        if self.num_devices < 1 or self.num_microbatches < 1:
            raise ValueError(
                f"num_devices and num_microbatches must be >= 1, got {self.num_devices} and "
                f"{self.num_microbatches}"
            )
        for name in ("time_budget", "overhead"):
            value = getattr(self, name)
            if not (math.isfinite(value) and value >= 0):  # NaN, and inf (the search runs for its budget)
                raise ValueError(f"{name} must be a finite number >= 0 seconds, got {value}")
        if self.memory_cap is not None and not self.memory_cap > 0:
            raise ValueError(f"memory_cap must be > 0 bytes (or None for no cap), got {self.memory_cap}")
        if not self.families:
            raise ValueError("families is empty: name at least one of seq, loop<v> (v >= 1) or v")
        for family in self.families:
            placement_for(family, self.num_devices)  # raises for an unknown or malformed family


@dataclass(frozen=True, kw_only=True)
class Candidate:
    recipe: str
    """What generated it, e.g. "1f1b/seq/balanced" or "list(+1,IW)/v/searched"."""
    schedule: Schedule
    result: SimResult
    memory_ok: bool

    @property
    def makespan(self) -> float:
        return self.result.makespan


@dataclass(frozen=True, kw_only=True)
class TuneResult:
    best: Candidate
    anchors: dict[str, Candidate]
    """Every anchor, by "name/partition", whether or not it fits the memory cap."""
    lower_bound: float
    seconds: float
    num_evaluated: int
    history: list[tuple[float, float]] = field(default_factory=list)
    """(seconds since start, best makespan) each time the best improved."""
    skipped_anchors: list[str] = field(default_factory=list)
    """Anchors that could not be built for this P and M, each with the reason."""

    @property
    def best_anchor(self) -> Candidate | None:
        ok = [c for c in self.anchors.values() if c.memory_ok]
        return min(ok, key=lambda c: c.makespan) if ok else None


def placement_for(family: str, num_devices: int) -> tuple[int, ...]:
    p = num_devices
    if family == "seq":
        return tuple(range(p))
    if family.startswith("loop"):
        v = int(family[4:]) if family[4:].isdigit() else 0
        if v < 1:
            raise ValueError(f"placement family {family!r}: write loop<v> with v >= 1 stages per device")
        return tuple(s % p for s in range(p * v))
    if family == "v":
        return tuple(range(p)) + tuple(reversed(range(p)))
    raise ValueError(f"unknown placement family {family!r}; use seq, loop<v> or v")


_FAMILY_ANCHORS: dict[str, tuple[str, ...]] = {
    "seq": ("gpipe", "1f1b", "zb_h1"),
    "loop2": ("interleaved_1f1b",),
    "v": ("zb_v", "dualpipe_v"),
}

_REPEATS_TO_STOP = 200
"""Consecutive repeated draws that end the randomized multi-start: the odds that a policy space with a
tenth of it still undrawn gives 200 repeats in a row are 0.9**200, about 7e-10."""

_POLICIES = (
    ListPolicy(extra_inflight=0),
    ListPolicy(extra_inflight=1),
    ListPolicy(extra_inflight=2),
    ListPolicy(extra_inflight=0, forward_first=True),
    ListPolicy(extra_inflight=0, split_backward=False),
)


def resimulate(
    cand: Candidate, layers: LayerCosts, *, link: LinkSpec | None = None, overhead: float = 0.0
) -> SimResult:
    """Simulate a tuned candidate again with spans (the search runs without them), head split applied."""
    if cand.schedule.partition is None:
        raise ValueError(f"candidate {cand.recipe} has no partition")
    units = split_layer(layers, layers.num_layers - 1, int(cand.schedule.meta.get("head_split", 1)))
    return simulate(cand.schedule, stage_costs(units, cand.schedule.partition, link=link, overhead=overhead))


def lower_bound(layers: LayerCosts, num_devices: int, num_microbatches: int) -> float:
    """max(total work / P, heaviest indivisible layer), for all microbatches."""
    per_layer = [layers.f[k] + layers.i[k] + layers.w[k] for k in range(layers.num_layers)]
    return num_microbatches * max(sum(per_layer) / num_devices, max(per_layer))


def _anchor_fn(name: str, family: str, p: int, m: int) -> Callable[[tuple[int, ...]], Schedule]:
    def make(partition: tuple[int, ...]) -> Schedule:
        if name == "interleaved_1f1b":
            return _anchors.interleaved_1f1b(p, m, num_chunks=int(family[4:]), partition=partition)
        gen = _anchors.ANCHORS[name]
        return gen(p, m, partition=partition)

    return make


def _family_of(placement: tuple[int, ...], num_devices: int) -> str:
    for fam in ("seq", "v", "loop2", "loop3", "loop4"):
        if len(placement) == (1 if fam == "seq" else 2 if fam == "v" else int(fam[4:])) * num_devices and (
            placement_for(fam, num_devices) == placement
        ):
            return fam
    return "custom"


Maker = Callable[[tuple[int, ...]], Schedule]


def _list_maker(
    units: LayerCosts,
    placement: tuple[int, ...],
    num_microbatches: int,
    policy: ListPolicy,
    config: TuneConfig,
) -> Maker:
    """A recipe: partition -> list-scheduled order for this placement and policy."""

    def make(partition: tuple[int, ...]) -> Schedule:
        sc = stage_costs(units, partition, link=config.link, overhead=config.overhead)
        return list_schedule(sc, placement, num_microbatches, policy, partition=partition)

    return make


def _lowest_cap(
    combos: list[Any], num_microbatches: int, config: TuneConfig, fits: float, probes: int = 14
) -> tuple[float, str | None]:
    """The lowest memory cap (within ``fits`` / 2**``probes``, or as far as bisection got in
    max(2 s, a quarter of the time budget)) under which a cap-aware list schedule of some combination
    fits, by bisection below ``fits`` (a peak already built): (cap, recipe), the recipe None when no cap
    below ``fits`` was found. For the infeasible-cap message: the schedules built under the user's cap
    say nothing about what a cap between it and their lowest peak would allow (3.8x lower on llama2-7b,
    P=16, M=256)."""
    lo, hi, best = 0.0, fits, None
    deadline = time.perf_counter() + max(2.0, 0.25 * config.time_budget)
    for _ in range(probes):
        if time.perf_counter() > deadline:
            break
        mid = (lo + hi) / 2
        got = None
        pol = replace(_POLICIES[0], memory_cap=mid)
        for split, units, family, placement, pname, part in combos:
            try:
                sched = _list_maker(units, placement, num_microbatches, pol, config)(part)
            except (ScheduleError, ValueError):
                continue
            res = simulate(sched, stage_costs(units, part, link=config.link, overhead=config.overhead))
            if res.memory_ok(mid):
                head = f"/head{split}" if split > 1 else ""
                got = (max(res.peak_memory), f"{pol.label()}/{family}/{pname}{head}")
                break
        if got is None:
            lo = mid
        else:
            hi, best = got[0], got[1]
    return hi, best


def _head_splits(layers: LayerCosts, num_devices: int) -> list[int]:
    """Head split factors worth trying: only when the last unit is heavy against a device's share."""
    per_layer = [layers.f[k] + layers.i[k] + layers.w[k] for k in range(layers.num_layers)]
    share = sum(per_layer) / num_devices
    if per_layer[-1] < 0.5 * share:
        return [1]
    return [k for k in (1, 2, 4, 8) if k <= num_devices]


def tune(
    layers: LayerCosts, config: TuneConfig, *, progress: Callable[[str], None] | None = None
) -> TuneResult:
    """Search partition x placement x schedule (and head splits) for the lowest simulated makespan."""
    p, m = config.num_devices, config.num_microbatches
    if p < 2:
        raise ValueError(f"pipeline tuning needs at least 2 devices, got {p}")
    if m < 1:
        raise ValueError(f"num_microbatches must be >= 1, got {m}")
    t_start = time.perf_counter()
    evaluated = 0
    cache: dict[tuple[str, int, tuple[int, ...]], Candidate | None] = {}
    why_not: dict[tuple[str, int, tuple[int, ...]], str] = {}

    def evaluate(
        units: LayerCosts, split: int, recipe: str, make: Maker, partition: tuple[int, ...], tag: str
    ) -> Candidate | None:
        nonlocal evaluated
        key = (recipe, split, partition)
        if key in cache:
            return cache[key]
        try:
            sched = make(partition)
            res = simulate(
                sched,
                stage_costs(units, partition, link=config.link, overhead=config.overhead),
                with_spans=False,
            )
        except (ScheduleError, ValueError) as err:
            cache[key] = None
            why_not[key] = str(err).split("\n")[0]
            return None
        evaluated += 1
        head = f"/head{split}" if split > 1 else ""
        sched = replace(sched, name=f"{recipe}/{tag}{head}", meta={**sched.meta, "head_split": split})
        cand = Candidate(
            recipe=f"{recipe}/{tag}{head}",
            schedule=sched,
            result=res,
            memory_ok=res.memory_ok(config.memory_cap),
        )
        cache[key] = cand
        return cand

    anchors: dict[str, Candidate] = {}
    seeds: list[tuple[Candidate, str, Maker, tuple[int, ...], LayerCosts, int]] = []
    splits = _head_splits(layers, p) if config.split_head else [1]
    seed_deadline = t_start + 0.5 * config.time_budget
    combos = []  # (split, units, family, placement, partition name, partition)
    for split in splits:
        units = split_layer(layers, layers.num_layers - 1, split)
        weights = [units.f[k] + units.i[k] + units.w[k] for k in range(units.num_layers)]
        for family in config.families:
            placement = placement_for(family, p)
            if len(placement) > units.num_layers:
                continue
            combos.append(
                (
                    split,
                    units,
                    family,
                    placement,
                    "uniform",
                    uniform_partition(units.num_layers, len(placement)),
                )
            )
            combos.append(
                (
                    split,
                    units,
                    family,
                    placement,
                    "balanced",
                    balanced_partition(weights, len(placement), placement),
                )
            )
    # Phase 1: every anchor on the unsplit model (none of those systems splits the head).
    skipped: dict[str, str] = {}
    for split, units, family, _, pname, part in combos:
        if split != 1:
            continue
        for aname in _FAMILY_ANCHORS.get(family, ()):
            make = _anchor_fn(aname, family, p, m)
            cand = evaluate(units, split, f"{aname}/{family}", make, part, pname)
            if cand is not None:
                anchors[f"{aname}/{pname}"] = cand
                seeds.append((cand, f"{aname}/{family}", make, part, units, split))
            else:
                skipped.setdefault(aname, why_not.get((f"{aname}/{family}", split, part), "not built"))
    if not any(split == 1 for split, *_ in combos):
        skipped["every anchor"] = (
            f"the unsplit model's {layers.num_layers} layers give fewer stages than {p} devices need, and "
            "the anchors run unsplit (the tuner splits the head)"
        )
    skipped = {k: v for k, v in skipped.items() if not any(n.startswith(k + "/") for n in anchors)}
    # Phase 2: list-scheduler policies, breadth first over the combinations, until half the budget.
    for base in _POLICIES:
        if time.perf_counter() > seed_deadline and base is not _POLICIES[0]:
            break
        pol = replace(base, memory_cap=config.memory_cap)
        for split, units, family, placement, pname, part in combos:
            make_list = _list_maker(units, placement, m, pol, config)
            cand = evaluate(units, split, f"{pol.label()}/{family}", make_list, part, pname)
            if cand is not None:
                seeds.append((cand, f"{pol.label()}/{family}", make_list, part, units, split))
    if not combos:
        stages = min(len(placement_for(f, p)) for f in config.families)
        most = max(split_layer(layers, layers.num_layers - 1, x).num_layers for x in splits)
        raise ValueError(
            f"{p} devices need at least {stages} pipeline stages, but the model has {layers.num_layers} "
            f"layers ({most} units with its head split): every stage needs one; use fewer devices"
        )
    feasible = [sd for sd in seeds if sd[0].memory_ok]
    if not feasible:
        cap = "none" if config.memory_cap is None else f"{config.memory_cap:.4g} B"
        lowest = min((sd[0] for sd in seeds), key=lambda c: max(c.result.peak_memory), default=None)
        found = ""
        if lowest is not None:
            peak, recipe = _lowest_cap(combos, m, config, max(lowest.result.peak_memory))
            recipe = recipe or lowest.recipe
            unit = 10.0 ** (math.floor(math.log10(peak)) - 3)
            peak = math.ceil(peak / unit) * unit  # 4 digits, rounded up
            found = f"; a cap of {peak:.4g} B would fit {recipe}, the lowest found"
        fewer = "" if m == 1 else ", or fewer microbatches"
        raise ValueError(
            f"no schedule fits memory_cap={cap} per device{found}; raise the cap, use more devices{fewer}"
        )
    feasible.sort(key=lambda sd: sd[0].makespan)
    best = feasible[0][0]
    history = [(time.perf_counter() - t_start, best.makespan)]
    if progress:
        progress(f"seeds: {evaluated} evaluated, best {best.recipe} {best.makespan:.4g}")

    deadline = t_start + config.time_budget
    # Randomized multi-start: per-stage list-scheduler policies around the best seeds' partitions,
    # for up to half the budget.
    rng = random.Random(config.seed)
    random_deadline = t_start + 0.7 * config.time_budget
    bases = []
    seen_bases: set[tuple[tuple[int, ...], tuple[int, ...], int]] = set()
    for sd in feasible:
        key = (sd[0].schedule.placement, sd[3], sd[5])
        if key not in seen_bases:
            seen_bases.add(key)
            bases.append(sd)
        if len(bases) == 4:
            break
    trial_no = repeats = 0
    drawn: set[tuple[int, tuple[int, ...], tuple[bool, ...]]] = set()
    # Stop early once the draws keep repeating (small pipelines have few distinct policies: a 4-stage
    # one 1,296 per base), instead of re-simulating them until 70% of the budget.
    while bases and time.perf_counter() < random_deadline and repeats < _REPEATS_TO_STOP:
        base = trial_no % len(bases)
        cand0, _, _, part, units, split = bases[base]
        trial_no += 1
        placement = cand0.schedule.placement
        ns = len(placement)
        extra = tuple(rng.choice((0, 0, 1, 2)) for _ in range(ns))
        first = tuple(rng.random() < 0.3 for _ in range(ns))
        if (base, extra, first) in drawn:
            repeats += 1
            continue
        drawn.add((base, extra, first))
        repeats = 0
        pol = ListPolicy(
            stage_extra=extra,
            stage_forward_first=first,
            memory_cap=config.memory_cap,
            tag=f"r{len(drawn)}",
        )
        make_rand = _list_maker(units, placement, m, pol, config)

        cand = evaluate(units, split, f"{pol.label()}/{_family_of(placement, p)}", make_rand, part, "random")
        if cand is not None and cand.memory_ok:
            feasible.append(
                (cand, f"{pol.label()}/{_family_of(placement, p)}", make_rand, part, units, split)
            )
            if cand.makespan < best.makespan:
                best = cand
                history.append((time.perf_counter() - t_start, best.makespan))
                if progress:
                    progress(f"multi-start: {best.recipe} {best.makespan:.4g}")
    feasible.sort(key=lambda sd: sd[0].makespan)

    # Local search from the best few distinct recipes, moving layers off the busiest device.
    starts = []
    seen: set[tuple[str, int]] = set()
    for sd in feasible:
        if (sd[1], sd[5]) not in seen:
            starts.append(sd)
            seen.add((sd[1], sd[5]))
        if len(starts) == 6:
            break
    for cand, recipe, make, part, units, split in starts:
        cur, cur_part = cand, part
        improved = True
        while improved and time.perf_counter() < deadline:
            improved = False
            placement = cur.schedule.placement
            busy = cur.result.busy
            for d in sorted(range(p), key=lambda x: -busy[x]):
                for st in [s for s in range(len(placement)) if placement[s] == d]:
                    for nb in (st - 1, st + 1):
                        if not 0 <= nb < len(cur_part) or cur_part[st] <= 1:
                            continue
                        trial = list(cur_part)
                        trial[st] -= 1
                        trial[nb] += 1
                        nxt = evaluate(units, split, recipe, make, tuple(trial), "searched")
                        if nxt is not None and nxt.memory_ok and nxt.makespan < cur.makespan * (1 - 1e-9):
                            cur, cur_part, improved = nxt, tuple(trial), True
                            break
                    if improved or time.perf_counter() > deadline:
                        break
                if improved or time.perf_counter() > deadline:
                    break
        if cur.makespan < best.makespan:
            best = cur
            history.append((time.perf_counter() - t_start, best.makespan))
            if progress:
                progress(f"search: {best.recipe} {best.makespan:.4g}")
    finest = split_layer(layers, layers.num_layers - 1, max(splits))
    return TuneResult(
        best=best,
        anchors=anchors,
        lower_bound=lower_bound(finest, p, m),
        seconds=time.perf_counter() - t_start,
        num_evaluated=evaluated,
        history=history,
        skipped_anchors=[f"{name}: {why}" for name, why in skipped.items()],
    )
