"""Anchor schedules: the published pipeline schedules that OctoPipe is measured against.

Each generator is a pure function of the device count P and the microbatch count M and returns a
validated :class:`~steptune.pipeline.schedule.Schedule` holding only per-device orders; durations are
the simulator's business. The orders follow torch.distributed.pipelining 2.13 (``pipeline_order`` of
the matching schedule class, ``None`` bubbles dropped) so that a steptune anchor and a torch run of
the same name execute the same actions in the same order. Known differences:

* ``one_f_one_b``: torch's ``Schedule1F1B._get_pipeline_order`` numbers the last rank's forwards
  1..M instead of 0..M-1 (its executed loop is right); we emit the correct indices, and unlike torch
  we accept M < P.
* ``zb_h1``: torch has no class of that name; it equals ``ScheduleInterleavedZeroBubble`` (ZB1P) with
  one stage per rank, minus that class's M % (M // P) == 0 rule, which only matters with 2+ chunks.
  As in the paper, device d may hold up to P microbatches between F and W (1F1B's peak, reached on
  device 0 in both), not 1F1B's P-d; between F and I it holds at most P-d, as 1F1B does.
* ``dualpipe_v``: torch emits compound ``OVERLAP_F_B`` actions; our IR has no compound actions, so
  each one becomes its forward followed by its backward, and ``meta["overlap_f_b"]`` lists the
  ``[device, position]`` of every such forward so an executor can overlap the pair again.

Contract: every order is deadlock-free whatever the stage costs (it is a topological order of the
dependency graph once device chains are added); the tests check this with a unit-time executor.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from steptune.pipeline.schedule import Action, ActionKind, Schedule, ScheduleError

__all__ = [
    "ANCHORS",
    "anchor",
    "dualpipe_v",
    "gpipe",
    "interleaved_1f1b",
    "one_f_one_b",
    "zb_h1",
    "zb_v",
]

_F, _I, _W, _B = ActionKind.F, ActionKind.I, ActionKind.W, ActionKind.B


def _check_sizes(num_devices: int, num_microbatches: int) -> None:
    if num_devices < 1:
        raise ScheduleError(f"num_devices is {num_devices}; a pipeline needs at least 1 device")
    if num_microbatches < 1:
        raise ScheduleError(f"num_microbatches is {num_microbatches}; use at least 1 microbatch")


def _build(
    name: str,
    num_microbatches: int,
    placement: list[int],
    orders: list[list[Action]],
    partition: tuple[int, ...] | None,
    **meta: Any,
) -> Schedule:
    return Schedule(
        name=name,
        num_stages=len(placement),
        num_microbatches=num_microbatches,
        placement=tuple(placement),
        orders=tuple(tuple(order) for order in orders),
        partition=tuple(partition) if partition is not None else None,
        meta={"anchor": name, **meta},
    ).validate()


def _v_placement(num_devices: int) -> list[int]:
    """Stage d and stage 2P-1-d on device d (torch's ``generate_stage_to_rank_mapping(style="v")``)."""
    return [*range(num_devices), *reversed(range(num_devices))]


def _one_f_one_b_order(forwards: list[Action], backwards: list[Action], *, num_warmup: int) -> list[Action]:
    """Warm-up forwards, then alternate one forward and one backward, then drain the backwards."""
    order = forwards[:num_warmup]  # warm-up
    for f, b in zip(forwards[num_warmup:], backwards, strict=False):  # steady 1F1B
        order += [f, b]
    return order + backwards[len(forwards) - num_warmup :]  # cool-down


class _Order:
    """One device's order under construction; each (stage, F / backward / W) numbers its microbatches
    0, 1, 2, ... in the order they are added. B and I share the backward counter."""

    def __init__(self) -> None:
        self.actions: list[Action] = []
        self._next: dict[tuple[int, ActionKind], int] = {}

    def add(self, stage: int, kind: ActionKind) -> int:
        key = (stage, _I if kind is _B else kind)
        m = self._next.get(key, 0)
        self._next[key] = m + 1
        self.actions.append(Action(stage, kind, m))
        return m

    def count(self, stage: int, kind: ActionKind) -> int:
        return self._next.get((stage, kind), 0)


def gpipe(num_devices: int, num_microbatches: int, *, partition: tuple[int, ...] | None = None) -> Schedule:
    """GPipe (fill-drain): every forward, then every fused backward, both in microbatch order."""
    _check_sizes(num_devices, num_microbatches)
    mbs = range(num_microbatches)
    orders = [[Action(d, _F, m) for m in mbs] + [Action(d, _B, m) for m in mbs] for d in range(num_devices)]
    return _build("gpipe", num_microbatches, list(range(num_devices)), orders, partition)


def one_f_one_b(
    num_devices: int, num_microbatches: int, *, partition: tuple[int, ...] | None = None
) -> Schedule:
    """1F1B (PipeDream-Flush): P-1-d warm-up forwards, then F/B pairs, then the remaining backwards."""
    _check_sizes(num_devices, num_microbatches)
    mbs = range(num_microbatches)
    orders = [
        _one_f_one_b_order(
            [Action(d, _F, m) for m in mbs],
            [Action(d, _B, m) for m in mbs],
            num_warmup=min(num_devices - 1 - d, num_microbatches),
        )
        for d in range(num_devices)
    ]
    return _build("1f1b", num_microbatches, list(range(num_devices)), orders, partition)


def interleaved_1f1b(
    num_devices: int,
    num_microbatches: int,
    *,
    num_chunks: int = 2,
    partition: tuple[int, ...] | None = None,
) -> Schedule:
    """Megatron interleaved 1F1B with ``num_chunks`` (v) stages per device in loop placement.

    Stage s lives on device s % P. Microbatches go through the local chunks in groups of
    g = M / max(1, M // P) (g = P when P divides M, as in Megatron; torch's "flex" rule otherwise).
    Device d warms up with (v-1)*g + 2*(P-1-d) forwards (at most v*M), then alternates one forward
    and one backward, then drains the backwards; backwards visit chunks in reverse.
    """
    _check_sizes(num_devices, num_microbatches)
    if num_chunks < 2:
        raise ScheduleError(
            f"interleaved 1F1B needs num_chunks >= 2 (got {num_chunks}); use one_f_one_b for one chunk"
        )
    num_rounds = max(1, num_microbatches // num_devices)
    if num_microbatches % num_rounds:
        lower = num_devices * num_rounds
        raise ScheduleError(
            f"interleaved 1F1B splits the microbatches into M // P = {num_rounds} equal groups, so "
            f"num_microbatches={num_microbatches} must be a multiple of {num_rounds}; use a multiple of "
            f"num_devices, e.g. {lower} or {lower + num_devices}"
        )
    group = num_microbatches // num_rounds
    total = num_chunks * num_microbatches  # forwards (and backwards) per device

    # The k-th forward (and k-th backward) of a device is microbatch m of its local chunk c.
    slots = [
        ((k // group) % num_chunks, (k // (group * num_chunks)) * group + k % group) for k in range(total)
    ]
    orders = [
        _one_f_one_b_order(
            [Action(c * num_devices + d, _F, m) for c, m in slots],
            [Action((num_chunks - 1 - c) * num_devices + d, _B, m) for c, m in slots],
            num_warmup=min((num_chunks - 1) * group + 2 * (num_devices - 1 - d), total),
        )
        for d in range(num_devices)
    ]
    placement = [s % num_devices for s in range(num_chunks * num_devices)]
    return _build(
        f"interleaved_1f1b_v{num_chunks}",
        num_microbatches,
        placement,
        orders,
        partition,
        num_chunks=num_chunks,
    )


def zb_h1(num_devices: int, num_microbatches: int, *, partition: tuple[int, ...] | None = None) -> Schedule:
    """ZB-H1 (Qi et al., ICLR 2024, §2.1): 1F1B with the backward split into I and W.

    Forwards and I's follow 1F1B exactly, so at most P-d microbatches sit between F and I on device d.
    Device d runs each W d steps after its I: the paper delays W by the warm-up shortfall so that all
    devices keep the same number in flight. Every device then holds at most P microbatches between F
    and W, which is 1F1B's peak (device 0), and the delayed W's fill the cool-down bubbles. Equals
    torch's ``ScheduleInterleavedZeroBubble`` (ZB1P) with one stage per rank.
    """
    _check_sizes(num_devices, num_microbatches)
    orders = []
    for d in range(num_devices):
        num_warmup = min(num_devices - 1 - d, num_microbatches)
        order = [Action(d, _F, m) for m in range(num_warmup)]  # warm-up
        for m in range(num_microbatches):
            if m < num_microbatches - num_warmup:  # steady: F, I, W; cool-down: I, W
                order.append(Action(d, _F, num_warmup + m))
            order.append(Action(d, _I, m))
            if m >= d:
                order.append(Action(d, _W, m - d))
        order += [Action(d, _W, m) for m in range(max(0, num_microbatches - d), num_microbatches)]  # W tail
        orders.append(order)
    return _build("zb_h1", num_microbatches, list(range(num_devices)), orders, partition)


def zb_v(num_devices: int, num_microbatches: int, *, partition: tuple[int, ...] | None = None) -> Schedule:
    """ZB-V (Qi et al., "Pipeline Parallelism with Controllable Memory", NeurIPS 2024): 2P stages in a
    V (stage d and 2P-1-d on device d), split I/W, zero bubble when F = I = W.

    Built as torch's ``ScheduleZBVZeroBubble``: the order is generated for max(M, 2P-1) microbatches
    and the extra ones are dropped (dropping actions keeps a deadlock-free order deadlock-free).
    """
    _check_sizes(num_devices, num_microbatches)
    n = max(num_microbatches, 2 * num_devices - 1)
    orders = [
        [a for a in _zb_v_device(num_devices, d, n) if a.microbatch < num_microbatches]
        for d in range(num_devices)
    ]
    return _build("zb_v", num_microbatches, _v_placement(num_devices), orders, partition)


def _zb_v_device(num_devices: int, d: int, n: int) -> list[Action]:
    down, up = d, 2 * num_devices - 1 - d  # the stage on the way down the V, and on the way up
    o = _Order()
    for _ in range(2 * (num_devices - d) - 1):  # warm-up 1: forwards of the down stage
        o.add(down, _F)
    for _ in range(d):  # warm-up 2: alternate the two stages' forwards
        o.add(up, _F)
        o.add(down, _F)
    for _ in range(num_devices - d):  # warm-up 3: the up stage starts its backwards
        for kind in (_F, _I, _W):
            o.add(up, kind)
    while o.count(up, _F) < o.count(down, _F) or o.count(down, _F) < n:  # steady: F I W per stage
        if o.count(down, _F) < n:
            o.add(down, _F)
        o.add(down, _I)
        o.add(down, _W)
        for kind in (_F, _I, _W):
            o.add(up, kind)
    for _ in range(d):  # cool-down 1: input gradients only
        o.add(down, _I)
        o.add(up, _I)
    for _ in range(num_devices - d):  # cool-down 2: the down stage's I, then a deferred W
        o.add(down, _I)
        o.add(down, _W)
    for stage in (up, down):  # cool-down 3: the remaining W's
        while o.count(stage, _W) < o.count(stage, _I):
            o.add(stage, _W)
    return o.actions


def dualpipe_v(
    num_devices: int, num_microbatches: int, *, partition: tuple[int, ...] | None = None
) -> Schedule:
    """DualPipeV (DeepSeek-V3's DualPipe cut in half; deepseek-ai/DualPipe ``dualpipev.py``).

    V placement, 2P stages. The main phase pairs a forward of one stage with the backward of the
    other; torch writes each pair as one ``OVERLAP_F_B`` action. Our IR has no compound actions, so
    a pair is its forward followed by its fused backward, and ``meta["overlap_f_b"]`` records the
    ``[device, position]`` of each such forward. Some backwards are fused (B), others split into I
    and W where the W's fill bubbles, exactly as in torch's ``ScheduleDualPipeV``. Needs M >= 2P.
    """
    _check_sizes(num_devices, num_microbatches)
    if num_microbatches < 2 * num_devices:
        raise ScheduleError(
            f"DualPipeV needs num_microbatches >= 2 * num_devices = {2 * num_devices} (got "
            f"{num_microbatches}); raise num_microbatches or use zb_v"
        )
    orders, overlaps = [], []
    for d in range(num_devices):
        order, pairs = _dualpipe_v_device(num_devices, num_microbatches, d)
        orders.append(order)
        overlaps += [[d, i] for i in pairs]
    return _build(
        "dualpipe_v", num_microbatches, _v_placement(num_devices), orders, partition, overlap_f_b=overlaps
    )


def _dualpipe_v_device(num_devices: int, num_microbatches: int, d: int) -> tuple[list[Action], list[int]]:
    """Device d's order, and the positions of the forwards that start an overlapped F/B pair."""
    P, M = num_devices, num_microbatches
    down, up = d, 2 * P - 1 - d
    o = _Order()
    pairs: list[int] = []
    pending_w: list[tuple[int, int]] = []  # (stage, microbatch) of I's whose W is not placed yet

    def backward(stage: int, split: bool = False) -> None:
        m = o.add(stage, _I if split else _B)
        if split:
            pending_w.append((stage, m))

    def weight() -> None:
        stage, m = pending_w.pop(0)
        o.actions.append(Action(stage, _W, m))

    def overlapped(f_stage: int, b_stage: int) -> None:
        pairs.append(len(o.actions))
        o.add(f_stage, _F)
        backward(b_stage)

    for _ in range(2 * (P - d - 1)):  # Step 1: nF0
        o.add(down, _F)
    for _ in range(d + 1):  # Step 2: nF0F1
        o.add(down, _F)
        o.add(up, _F)
    for _ in range(P - d - 1):  # Step 3: nB1W1F1 (zero bubble)
        backward(up, split=True)
        weight()
        o.add(up, _F)
    for i in range(M - 2 * P + d + 1):  # Step 4 (main step): nF0B1F1B0
        if i == 0 and d == P - 1:
            # DualPipe does not overlap these two chunks, to shorten the bubble.
            o.add(down, _F)
            backward(up)
        else:
            overlapped(down, up)
        overlapped(up, down)
    for _ in range(P - d - 1):  # Step 5: nB1F1B0
        backward(up)
        overlapped(up, down)
    split = False
    for i in range(d + 1):  # Step 6: nB1B0, the second half with zero bubble
        split = split or (i == (d + 1) // 2 and d % 2 == 1)
        backward(up, split)
        split = split or (i == (d + 1) // 2 and d % 2 == 0)
        backward(down, split)
    for _ in range(P - d - 1):  # Step 7: nWB0 (zero bubble)
        weight()
        backward(down, split)
    for _ in range(d + 1):  # Step 8: nW
        weight()
    assert not pending_w, f"DualPipeV device {d} left W's unplaced: {pending_w}"
    return o.actions, pairs


ANCHORS: dict[str, Callable[..., Schedule]] = {
    "gpipe": gpipe,
    "1f1b": one_f_one_b,
    "interleaved_1f1b": interleaved_1f1b,
    "zb_h1": zb_h1,
    "zb_v": zb_v,
    "dualpipe_v": dualpipe_v,
}


def anchor(name: str, num_devices: int, num_microbatches: int, **kwargs: Any) -> Schedule:
    """The anchor schedule ``name`` (a key of :data:`ANCHORS`); ``kwargs`` go to its generator."""
    try:
        generator = ANCHORS[name]
    except KeyError:
        raise ScheduleError(f"unknown anchor {name!r}; choose one of {', '.join(ANCHORS)}") from None
    return generator(num_devices, num_microbatches, **kwargs)
