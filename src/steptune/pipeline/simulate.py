"""Graph simulator of one pipeline step: compute actions, P2P transfers, memory and bubbles.

Model (assumptions in docs/pipeline.md):
- Each device runs its actions in the schedule's order, one at a time.
- F(s,m) waits for F(s-1,m); I/B(s,m) waits for I/B(s+1,m) (or F(s,m) on the last stage);
  W(s,m) waits for I(s,m). Crossing devices adds a transfer of the stage output (or its gradient).
- Each ordered device pair is one FIFO channel (alpha + bytes/beta); sends do not block compute.
  A channel from device ``a`` only carries what ``a`` produced, in ``a``'s order, so a sweep that
  follows each device's order is an exact longest-path computation, FIFO contention included.
- Memory per device: static bytes of its stages, plus each microbatch's activations of a stage
  from the start of its F to the end of its W (or fused B). I does not free activations.

A cyclic or otherwise impossible order raises ``ScheduleError`` naming what each device waits for.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from steptune.core.trace import Span, Trace
from steptune.pipeline.costs import StageCosts
from steptune.pipeline.schedule import Action, ActionKind, Schedule, ScheduleError

__all__ = ["Bubble", "SimResult", "simulate"]

_EPS = 1e-12


@dataclass(frozen=True, slots=True)
class Bubble:
    device: int
    start: float
    duration: float
    before: str
    """The action that waited (empty for the tail after a device's last action)."""
    cause: str
    """The dependency whose late arrival made the gap, e.g. "1I3 via comm" or "tail"."""


@dataclass(frozen=True, kw_only=True)
class SimResult:
    makespan: float
    busy: tuple[float, ...]
    peak_memory: tuple[float, ...]
    bubbles: tuple[Bubble, ...]
    start: dict[Action, float] = field(repr=False)
    end: dict[Action, float] = field(repr=False)
    spans: tuple[Span, ...] = field(repr=False)

    @property
    def num_devices(self) -> int:
        return len(self.busy)

    @property
    def bubble_fraction(self) -> float:
        return 1.0 - sum(self.busy) / (self.num_devices * self.makespan) if self.makespan > 0 else 0.0

    def idle(self, device: int) -> float:
        return self.makespan - self.busy[device]

    def memory_ok(self, cap: float | None) -> bool:
        return cap is None or max(self.peak_memory) <= cap * (1 + 1e-9)

    def bubble_by_device(self) -> list[float]:
        out = [0.0] * self.num_devices
        for b in self.bubbles:
            out[b.device] += b.duration
        return out

    def trace(self) -> Trace:
        t = Trace()
        t.spans.extend(self.spans)
        for d in range(self.num_devices):
            t.name_rank(d, f"device {d}")
        return t


def _duration(costs: StageCosts, a: Action) -> float:
    s = a.stage
    base = {
        ActionKind.F: costs.f[s],
        ActionKind.I: costs.i[s],
        ActionKind.W: costs.w[s],
        ActionKind.B: costs.i[s] + costs.w[s],
    }[a.kind]
    return base + costs.overhead


def _cycle(waits_on: dict[int, tuple[Action, Action]], place: tuple[int, ...]) -> str:
    """Follow "device waits for an action on device ..." until a device repeats: the cycle."""
    if not waits_on:
        return "no device can start"
    d, path = min(waits_on), []
    seen: list[int] = []
    while d in waits_on and d not in seen:
        seen.append(d)
        head, need = waits_on[d]
        path.append(f"device {d} at {head} needs {need} (device {place[need.stage]})")
        d = place[need.stage]
    if d in seen:
        return "cycle: " + " -> ".join(path[seen.index(d) :]) + f" -> device {d}"
    return "stuck: " + " -> ".join(path)


def simulate(
    schedule: Schedule,
    costs: StageCosts,
    *,
    with_spans: bool = True,
    durations: Callable[[Action], float] | None = None,
) -> SimResult:
    """Simulate ``schedule`` with per-stage ``costs``; see the module docstring for the model.

    ``durations`` overrides the compute time of individual actions (per-microbatch workloads, a
    slowed device); ``costs`` still provides communication and memory.
    """
    if costs.num_stages != schedule.num_stages:
        raise ScheduleError(f"costs cover {costs.num_stages} stages, the schedule has {schedule.num_stages}")
    place = schedule.placement
    last = schedule.num_stages - 1
    split = {(a.stage, a.microbatch) for order in schedule.orders for a in order if a.kind is ActionKind.I}
    start: dict[Action, float] = {}
    end: dict[Action, float] = {}
    # Arrival time on the consumer's device of each producer's output, set when the producer runs.
    arrival: dict[Action, float] = {}
    chan_free: dict[tuple[int, int], float] = {}
    spans: list[Span] = []
    num_dev = schedule.num_devices
    dev_free = [0.0] * num_dev
    busy = [0.0] * num_dev
    heads = [0] * num_dev
    bubbles: list[Bubble] = []
    mem_events: list[list[tuple[float, float]]] = [[] for _ in range(num_dev)]

    def backward_of(s: int, m: int) -> Action:
        return Action(s, ActionKind.I if (s, m) in split else ActionKind.B, m)

    def deps(a: Action) -> list[Action]:
        s, m = a.stage, a.microbatch
        if a.kind is ActionKind.F:
            return [Action(s - 1, ActionKind.F, m)] if s > 0 else []
        if a.kind is ActionKind.W:
            return [Action(s, ActionKind.I, m)]
        own = Action(s, ActionKind.F, m)
        return [own] if s == last else [own, backward_of(s + 1, m)]

    def consumer_device(a: Action) -> int | None:
        """Where ``a``'s output goes, if anywhere."""
        if a.kind is ActionKind.F and a.stage < last:
            return place[a.stage + 1]
        if a.kind in (ActionKind.I, ActionKind.B) and a.stage > 0:
            return place[a.stage - 1]
        return None

    remaining = sum(len(o) for o in schedule.orders)
    while remaining:
        progressed = False
        for d in range(num_dev):
            order = schedule.orders[d]
            while heads[d] < len(order):
                a = order[heads[d]]
                ds = deps(a)
                if any(p not in end for p in ds):
                    break
                ready, cause = dev_free[d], ""
                for p in ds:
                    t = arrival.get(p, end[p])
                    if t > ready + _EPS:
                        via = " via comm" if place[p.stage] != d else ""
                        ready, cause = t, f"{p}{via}"
                if ready > dev_free[d] + _EPS:
                    bubbles.append(Bubble(d, dev_free[d], ready - dev_free[d], str(a), cause))
                dur = durations(a) if durations is not None else _duration(costs, a)
                start[a], end[a] = ready, ready + dur
                dev_free[d] = end[a]
                busy[d] += dur
                if with_spans:
                    spans.append(
                        Span(
                            name=str(a),
                            start=ready,
                            duration=dur,
                            rank=d,
                            stream="compute",
                            category=a.kind.value,
                        )
                    )
                # Memory: activations live from F's start to W's (or B's) end.
                if a.kind is ActionKind.F:
                    mem_events[d].append((ready, costs.act_bytes[a.stage]))
                elif a.kind in (ActionKind.W, ActionKind.B):
                    mem_events[d].append((end[a], -costs.act_bytes[a.stage]))
                dst = consumer_device(a)
                if dst is not None and dst != d:
                    dur_c = costs.comm_time(a.stage - 1 if a.kind is not ActionKind.F else a.stage)
                    ch = (d, dst)
                    t0 = max(end[a], chan_free.get(ch, 0.0))
                    chan_free[ch] = t0 + dur_c
                    arrival[a] = t0 + dur_c
                    if with_spans and dur_c > 0:
                        spans.append(
                            Span(
                                name=f"{a}->{dst}",
                                start=t0,
                                duration=dur_c,
                                rank=d,
                                stream=f"send to {dst}",
                                category="comm",
                            )
                        )
                heads[d] += 1
                remaining -= 1
                progressed = True
        if not progressed:
            waits, waits_on = [], {}
            for d in range(num_dev):
                if heads[d] < len(schedule.orders[d]):
                    a = schedule.orders[d][heads[d]]
                    missing = [p for p in deps(a) if p not in end]
                    waits.append(f"device {d} at {a} waits for {', '.join(map(str, missing))}")
                    waits_on[d] = (a, missing[0])
            raise ScheduleError(f"schedule deadlocks: {_cycle(waits_on, place)}; " + "; ".join(waits))
    makespan = max(dev_free) if dev_free else 0.0
    for d in range(num_dev):
        if makespan - dev_free[d] > _EPS:
            bubbles.append(Bubble(d, dev_free[d], makespan - dev_free[d], "", "tail"))
    peaks = []
    for d in range(num_dev):
        static = sum(costs.static_bytes[s] for s in schedule.stages_of(d))
        cur = peak = 0.0
        for _, delta in sorted(mem_events[d], key=lambda e: (e[0], e[1])):  # frees first at equal times
            cur += delta
            peak = max(peak, cur)
        peaks.append(static + peak)
    return SimResult(
        makespan=makespan,
        busy=tuple(busy),
        peak_memory=tuple(peaks),
        bubbles=tuple(bubbles),
        start=start,
        end=end,
        spans=tuple(spans),
    )
