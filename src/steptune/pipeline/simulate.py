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

import math
import numbers
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field

from steptune.core.trace import Span, Trace
from steptune.pipeline.costs import StageCosts
from steptune.pipeline.schedule import Action, ActionKind, Schedule, ScheduleError

__all__ = ["Bubble", "Program", "SimResult", "makespan", "program", "simulate"]

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


_KIND_CODE = {ActionKind.F: 0, ActionKind.I: 1, ActionKind.W: 2, ActionKind.B: 3}


@dataclass(frozen=True, slots=True)
class Program:
    """What every simulation of one schedule shares, whatever the costs: its actions in an order that
    follows each device's sequence and every dependency (the sweep's order), with dependencies and
    sends as indices. ``program(schedule)`` builds it once per schedule object."""

    actions: tuple[Action, ...]
    device: tuple[int, ...]
    local_deps: tuple[tuple[int, ...], ...]
    """Producers on the same device: ready at their end."""
    remote_deps: tuple[tuple[int, ...], ...]
    """Producers on another device: ready when their output has arrived here."""
    channel: tuple[int, ...]
    """Index of the (device, consumer device) FIFO channel the output goes on; -1: it stays here."""
    comm_stage: tuple[int, ...]
    """Stage whose ``comm_time`` prices that send."""
    key: tuple[tuple[int, int], ...]
    """(stage, kind code) of each action, for per-stage cost lookups."""
    channel_dst: tuple[int, ...]
    """Consumer device of each channel."""


def _compile(schedule: Schedule) -> Program:
    place = schedule.placement
    last = schedule.num_stages - 1
    split = {(a.stage, a.microbatch) for order in schedule.orders for a in order if a.kind is ActionKind.I}

    def deps(a: Action) -> list[Action]:
        s, m = a.stage, a.microbatch
        if a.kind is ActionKind.F:
            return [Action(s - 1, ActionKind.F, m)] if s > 0 else []
        if a.kind is ActionKind.W:
            return [Action(s, ActionKind.I, m)]
        own = Action(s, ActionKind.F, m)
        if s == last:
            return [own]
        return [own, Action(s + 1, ActionKind.I if (s + 1, m) in split else ActionKind.B, m)]

    index: dict[Action, int] = {}
    actions: list[Action] = []
    device: list[int] = []
    local: list[tuple[int, ...]] = []
    remote: list[tuple[int, ...]] = []
    channel: list[int] = []
    comm_stage: list[int] = []
    channels: dict[tuple[int, int], int] = {}
    num_dev = schedule.num_devices
    heads = [0] * num_dev
    remaining = sum(len(o) for o in schedule.orders)
    while remaining:
        progressed = False
        for d in range(num_dev):
            order = schedule.orders[d]
            while heads[d] < len(order):
                a = order[heads[d]]
                ds = deps(a)
                if any(p not in index for p in ds):
                    break
                local.append(tuple(index[p] for p in ds if place[p.stage] == d))
                remote.append(tuple(index[p] for p in ds if place[p.stage] != d))
                if a.kind is ActionKind.F:
                    dst, cs = (place[a.stage + 1] if a.stage < last else None), a.stage
                elif a.kind is not ActionKind.W and a.stage > 0:
                    dst, cs = place[a.stage - 1], a.stage - 1
                else:
                    dst, cs = None, 0
                channel.append(
                    -1 if dst is None or dst == d else channels.setdefault((d, dst), len(channels))
                )
                comm_stage.append(cs)
                index[a] = len(actions)
                actions.append(a)
                device.append(d)
                heads[d] += 1
                remaining -= 1
                progressed = True
        if not progressed:
            waits, waits_on = [], {}
            for d in range(num_dev):
                if heads[d] < len(schedule.orders[d]):
                    a = schedule.orders[d][heads[d]]
                    missing = [p for p in deps(a) if p not in index]
                    waits.append(f"device {d} at {a} waits for {', '.join(map(str, missing))}")
                    waits_on[d] = (a, missing[0])
            raise ScheduleError(f"schedule deadlocks: {_cycle(waits_on, place)}; " + "; ".join(waits))
    return Program(
        actions=tuple(actions),
        device=tuple(device),
        local_deps=tuple(local),
        remote_deps=tuple(remote),
        channel=tuple(channel),
        comm_stage=tuple(comm_stage),
        key=tuple((a.stage, _KIND_CODE[a.kind]) for a in actions),
        channel_dst=tuple(dst for (_src, dst) in channels),  # dicts keep insertion (= index) order
    )


_programs: dict[int, tuple[weakref.ref[Schedule], Program]] = {}


def program(schedule: Schedule) -> Program:
    """``schedule``'s ``Program``, built on first use and kept while the schedule object lives; raises
    ``ScheduleError`` for an invalid schedule (``Schedule.validate``), or naming what each device waits for
    if the order deadlocks."""
    key = id(schedule)
    hit = _programs.get(key)
    if hit is not None and hit[0]() is schedule:
        return hit[1]
    schedule.validate()  # a missing action, or one on the wrong device, would be priced as if valid
    prog = _compile(schedule)
    _programs[key] = (weakref.ref(schedule, lambda _ref, k=key: _programs.pop(k, None)), prog)
    return prog


def _durations(prog: Program, costs: StageCosts, durations: Callable[[Action], float] | None) -> list[float]:
    if durations is not None:
        out = [durations(a) for a in prog.actions]
        for a, d in zip(prog.actions, out, strict=True):
            # a NaN duration dropped the action's dependents from the makespan, a negative one gave -1 s
            if isinstance(d, bool) or not isinstance(d, numbers.Real) or not (math.isfinite(d) and d >= 0):
                raise ValueError(f"durations({a}) must be a finite number of seconds >= 0, got {d!r}")
        return out
    o = costs.overhead
    table = [(f + o, i + o, w + o, i + w + o) for f, i, w in zip(costs.f, costs.i, costs.w, strict=True)]
    return [table[s][k] for s, k in prog.key]


def _send_offsets(
    prog: Program,
    costs: StageCosts,
    dur: list[float],
    durations: Callable[[Action], float] | None,
    after_i: bool,
) -> list[float]:
    """Seconds from each action's start until its output can be sent: its duration, except a fused B's
    under ``after_i`` (its input gradient is ready when its I part ends; W follows on the device). Given
    per-action ``durations`` (no I/W split known), the whole duration."""
    if not after_i or durations is not None:
        return dur
    o = costs.overhead
    return [costs.i[s] + o if k == 3 else d for (s, k), d in zip(prog.key, dur, strict=True)]


def _check(schedule: Schedule, costs: StageCosts) -> None:
    if costs.num_stages != schedule.num_stages:
        raise ScheduleError(f"costs cover {costs.num_stages} stages, the schedule has {schedule.num_stages}")


def _sweep(
    prog: Program, dur: list[float], comm: list[float], num_dev: int, send: list[float]
) -> tuple[list[float], list[float], list[int]]:
    """The longest-path sweep: each action's start and end, and what set its start (-1: its device's
    previous action; ``j``: local producer ``j``; ``-2 - j``: the arrival of remote producer ``j``)."""
    n = len(dur)
    start, end, avail, why = [0.0] * n, [0.0] * n, [0.0] * n, [-1] * n
    dev_free = [0.0] * num_dev
    chan = [0.0] * len(prog.channel_dst)
    device, local, remote, channel = prog.device, prog.local_deps, prog.remote_deps, prog.channel
    for i in range(n):
        d = device[i]
        ready, w = dev_free[d], -1
        for j in local[i]:
            if end[j] > ready + _EPS:
                ready, w = end[j], j
        for j in remote[i]:
            if avail[j] > ready + _EPS:
                ready, w = avail[j], -2 - j
        start[i], why[i] = ready, w
        e = ready + dur[i]
        end[i] = avail[i] = dev_free[d] = e
        c = channel[i]
        if c >= 0:
            out = ready + send[i]
            t0 = chan[c] if chan[c] > out else out
            chan[c] = avail[i] = t0 + comm[i]
    return start, end, why


def _comm(prog: Program, costs: StageCosts) -> list[float]:
    return [costs.comm_time(s) if c >= 0 else 0.0 for c, s in zip(prog.channel, prog.comm_stage, strict=True)]


def makespan(
    schedule: Schedule,
    costs: StageCosts,
    *,
    durations: Callable[[Action], float] | None = None,
    send_after_i: bool = True,
) -> float:
    """``simulate(...).makespan`` without bubbles, spans or memory: the hot path of planners that price
    many cost vectors on one schedule object."""
    _check(schedule, costs)
    prog = program(schedule)
    dur = _durations(prog, costs, durations)
    send = _send_offsets(prog, costs, dur, durations, send_after_i)
    _, end, _ = _sweep(prog, dur, _comm(prog, costs), schedule.num_devices, send)
    return max(end, default=0.0)


def simulate(
    schedule: Schedule,
    costs: StageCosts,
    *,
    with_spans: bool = True,
    durations: Callable[[Action], float] | None = None,
    send_after_i: bool = True,
) -> SimResult:
    """Simulate ``schedule`` with per-stage ``costs``; see the module docstring for the model.

    ``durations`` overrides the compute time of individual actions (per-microbatch workloads, a
    slowed device); ``costs`` still provides communication and memory. ``makespan`` is the same
    sweep when only the makespan is needed. ``send_after_i``: a fused B sends its input gradient when
    its I part ends, as steptune's executor does; False: when the whole B ends, as torch's
    ``_PipelineScheduleRuntime`` does (a sweep: fused-B anchors priced up to 12% slow for our executor).
    """
    _check(schedule, costs)
    prog = program(schedule)
    actions = prog.actions
    dur = _durations(prog, costs, durations)
    comm = _comm(prog, costs)
    send = _send_offsets(prog, costs, dur, durations, send_after_i)
    starts, end, why = _sweep(prog, dur, comm, schedule.num_devices, send)
    num_dev = schedule.num_devices
    dev_free = [0.0] * num_dev
    busy = [0.0] * num_dev
    chan = [0.0] * len(prog.channel_dst)
    spans: list[Span] = []
    bubbles: list[Bubble] = []
    mem_events: list[list[tuple[float, int, float]]] = [[] for _ in range(num_dev)]
    for i, a in enumerate(actions):
        d, ready, w = prog.device[i], starts[i], why[i]
        if w != -1:  # a dependency, not the device, set the start: the gap before it is a bubble
            cause = str(actions[w]) if w >= 0 else f"{actions[-2 - w]} via comm"
            bubbles.append(Bubble(d, dev_free[d], ready - dev_free[d], str(a), cause))
        dev_free[d] = end[i]
        busy[d] += dur[i]
        if with_spans:
            spans.append(
                Span(
                    name=str(a), start=ready, duration=dur[i], rank=d, stream="compute", category=a.kind.value
                )
            )
        # Memory: activations live from F's start to W's (or B's) end.
        if a.kind is ActionKind.F:
            mem_events[d].append((ready, i, costs.act_bytes[a.stage]))
        elif a.kind in (ActionKind.W, ActionKind.B):
            mem_events[d].append((end[i], i, -costs.act_bytes[a.stage]))
        c = prog.channel[i]
        if with_spans and c >= 0 and comm[i] > 0:  # replay the channel only for its spans
            t0 = max(starts[i] + send[i], chan[c])
            chan[c] = t0 + comm[i]
            dst = prog.channel_dst[c]
            spans.append(
                Span(
                    name=f"{a}->{dst}",
                    start=t0,
                    duration=comm[i],
                    rank=d,
                    stream=f"send to {dst}",
                    category="comm",
                )
            )
    makespan_ = max(dev_free) if dev_free else 0.0
    for d in range(num_dev):
        if makespan_ - dev_free[d] > _EPS:
            bubbles.append(Bubble(d, dev_free[d], makespan_ - dev_free[d], "", "tail"))
    peaks = []
    for d in range(num_dev):
        static = sum(costs.static_bytes[s] for s in schedule.stages_of(d))
        cur = peak = 0.0
        # At equal times, program order (the index follows each device's order): a W that ends as the next
        # F starts frees first, and a zero-length F and its W allocate, then free (a peak of 0 before).
        for _, _, delta in sorted(mem_events[d], key=lambda e: (e[0], e[1])):
            cur += delta
            peak = max(peak, cur)
        peaks.append(static + peak)
    return SimResult(
        makespan=makespan_,
        busy=tuple(busy),
        peak_memory=tuple(peaks),
        bubbles=tuple(bubbles),
        start=dict(zip(actions, starts, strict=True)),
        end=dict(zip(actions, end, strict=True)),
        spans=tuple(spans),
    )
