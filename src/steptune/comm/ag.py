"""TIDE-AG: all-gather that lands every peer's shard straight in per-parameter storage.

Contract. ``slot`` is the group's flat unsharded buffer (``layout.slot_numel`` elements of the all-gather
dtype), owned by the caller; parameter ``p``'s storage is ``slot[layout.slot_offset(p):]`` with rank ``r``'s
rows at ``r * shard_numel(p)``. ``shards[p]`` is this rank's local shard in any dtype (at least its real
rows); the one local copy is the cast that writes it into place. Every other byte arrives from the wire
into its final address: no flat rank-major buffer, no copy-out. Padding is never sent.

Algorithms: ``direct`` (``W - 1`` exchanges of the own block), ``rd`` (recursive doubling: the butterfly for
power-of-two ``W``, the dissemination/Bruck form otherwise, ``ceil(log2 W)`` rounds). Pacing: parameters are
sent in windows whose bytes stay under ``max_inflight_bytes``; windows are cut from the global plan, so every
rank cuts the same windows and the exchange cannot deadlock.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from steptune.comm.layout import GroupLayout, Segment, bruck_steps, xor_steps
from steptune.comm.transport import Transport

__all__ = ["AG_ALGORITHMS", "ag_rounds", "all_gather_into", "place_own_shards", "window_segments"]

AG_ALGORITHMS = ("direct", "rd")


def place_own_shards(
    layout: GroupLayout, slot: torch.Tensor, shards: Sequence[torch.Tensor], rank: int
) -> int:
    """Cast-copy this rank's real rows into their place in ``slot``; returns the bytes written."""
    written = 0
    for p, shard in enumerate(shards):
        seg = layout.block_segment(p, rank, 1)
        if seg.numel:
            dst = _view(layout, slot, seg)
            dst.copy_(shard.reshape(-1)[: seg.numel])
            written += dst.numel() * dst.element_size()
    return written


def _view(layout: GroupLayout, slot: torch.Tensor, seg: Segment) -> torch.Tensor:
    return slot.narrow(0, layout.slot_offset(seg.param) + seg.start, seg.numel)


def ag_rounds(layout: GroupLayout, rank: int, algorithm: str) -> list[tuple[int, int, int, int, int]]:
    """``(send_peer, send_first, recv_peer, recv_first, count)`` per round."""
    w = layout.world_size
    if algorithm == "direct":
        return [((rank + d) % w, rank, (rank - d) % w, (rank - d) % w, 1) for d in range(1, w)]
    if algorithm != "rd":
        raise ValueError(f"unknown all-gather algorithm {algorithm!r}; choose one of {AG_ALGORITHMS}")
    if w & (w - 1) == 0:
        rounds = []
        for dist, block in xor_steps(w):
            peer = rank ^ dist
            rounds.append((peer, rank - rank % block, peer, peer - peer % block, block))
        return rounds
    return [((rank - d) % w, rank, (rank + d) % w, (rank + d) % w, c) for d, c in bruck_steps(w)]


def _windows(layout: GroupLayout, count: int, max_inflight_bytes: int | None) -> list[range]:
    num = len(layout.params)
    if not max_inflight_bytes:
        return [range(num)]
    windows, start, acc = [], 0, 0
    for p in range(num):
        b = layout.shard_numel(p) * count * layout.itemsize
        if p > start and acc + b > max_inflight_bytes:
            windows.append(range(start, p))
            start, acc = p, 0
        acc += b
    windows.append(range(start, num))
    return windows


def all_gather_into(
    layout: GroupLayout,
    slot: torch.Tensor,
    shards: Sequence[torch.Tensor],
    transport: Transport,
    *,
    algorithm: str = "rd",
    max_inflight_bytes: int | None = None,
    tag: int = 0,
) -> int:
    """Fill ``slot`` with every rank's rows of every parameter; returns the bytes of the local cast-copy."""
    rank, w = transport.rank, transport.world_size
    if w != layout.world_size:
        raise ValueError(f"layout is for {layout.world_size} ranks, transport has {w}")
    if slot.dim() != 1 or slot.numel() < layout.slot_numel:
        raise ValueError(f"slot must be 1-D with >= {layout.slot_numel} elements, got {tuple(slot.shape)}")
    if len(shards) != len(layout.params):
        raise ValueError(f"{len(shards)} shards for {len(layout.params)} parameters")
    written = place_own_shards(layout, slot, shards, rank)
    for i, (send_peer, send_first, recv_peer, recv_first, count) in enumerate(
        ag_rounds(layout, rank, algorithm)
    ):
        for window in _windows(layout, count, max_inflight_bytes):
            works: list[Any] = []
            for seg in window_segments(layout, window, recv_first, count):
                works.append(transport.irecv(_view(layout, slot, seg), recv_peer, tag + i))
            for seg in window_segments(layout, window, send_first, count):
                works.append(transport.isend(_view(layout, slot, seg), send_peer, tag + i))
            for work in works:
                work.wait()
    return written


def window_segments(layout: GroupLayout, window: range, first: int, count: int) -> list[Segment]:
    """Non-empty segments of ranks ``[first, first + count)`` (mod ``W``) for the parameters in ``window``.

    A Bruck block may wrap past the last rank: it is two runs, each contiguous per parameter. Sender and
    receiver list the same block in the same order, so messages match.
    """
    w = layout.world_size
    head = min(count, w - first)
    runs = [(first, head)] + ([(0, count - head)] if count > head else [])
    return [seg for p in window for a, k in runs if (seg := layout.block_segment(p, a, k)).numel]
