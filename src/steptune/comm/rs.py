"""TIDE-RS: reduce-scatter that consumes per-parameter bf16 gradients and accumulates fp32 shards.

Contract. ``grads[p]`` is this rank's full (unsharded) gradient of parameter ``p``, contiguous, in the
gradient dtype (bf16 under FSDP2 mixed precision); the caller keeps it alive until the call returns. Each
peer's rows for owner ``r`` are sent as they are (a contiguous view: bf16 on the wire, no padding, no fp32
full-group buffer); the owner accumulates them into ``out`` (fp32, ``layout.out_numel`` elements, stock
FSDP2's flat shard layout) in a fixed order: its own rows first, then peers ``r-1, r-2, ...`` (mod ``W``).
bf16 -> fp32 is exact, so only that summation order can differ from another reduction.

Pipeline. Incoming data is cut into chunks of at most ``chunk_numel`` elements (``layout.rs_chunks``) and
received into ``num_slots`` staging slots round-robin; a slot is re-posted once its chunk is accumulated.
With ``two_phase=True`` outgoing chunks are first gathered into ``num_slots`` send slots (phase 1, the
gradient read), then sent (phase 2, network progress): on GPUs that separates HBM reads from the wire;
on gloo it only adds copies, so it is off by default. Staging is ``num_slots * chunk_numel`` elements per
direction whatever ``W`` is. ``staging`` may be borrowed memory (Slot-Reuse: a vacated all-gather slot);
otherwise it is allocated here and reported.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from steptune.comm.accounting import phase
from steptune.comm.layout import GroupLayout, Piece
from steptune.comm.transport import Transport

__all__ = ["RSStats", "reduce_scatter_into", "staging_numel"]


@dataclass(frozen=True, slots=True)
class RSStats:
    staging_bytes: int
    """Staging this call needed (receive slots, plus send slots when two-phase)."""
    staging_allocated_bytes: int
    """Of which newly allocated (0 when borrowed from a vacated all-gather slot)."""
    own_cast_bytes: int
    """fp32 bytes written by folding this rank's own rows into the output (the reduction's first term)."""
    stage_copy_bytes: int
    """Bytes copied into send slots (two-phase only)."""


def _src_view(layout: GroupLayout, grads: Sequence[torch.Tensor], owner: int, piece: Piece) -> torch.Tensor:
    first_row, _ = layout.owner_rows(piece.param, owner)
    start = first_row * layout.params[piece.param].row_numel + piece.src
    return grads[piece.param].reshape(-1).narrow(0, start, piece.numel)


def _clamp_chunk(layout: GroupLayout, chunk_numel: int) -> int:
    return max(1, min(chunk_numel, max(layout.rs_numel(r) for r in range(layout.world_size))))


def staging_numel(layout: GroupLayout, *, chunk_numel: int, num_slots: int, two_phase: bool) -> int:
    """Staging elements one reduce-scatter needs: independent of ``W`` once chunks are full."""
    if layout.world_size == 1:
        return 0
    return num_slots * _clamp_chunk(layout, chunk_numel) * (2 if two_phase else 1)


def _post_recv(
    transport: Transport, slot: torch.Tensor, pieces: list[Piece], src: int, tag: int
) -> list[Any]:
    return [transport.irecv(slot.narrow(0, pc.slot, pc.numel), src, tag) for pc in pieces]


def reduce_scatter_into(
    layout: GroupLayout,
    grads: Sequence[torch.Tensor],
    out: torch.Tensor,
    transport: Transport,
    *,
    chunk_numel: int = 1 << 20,
    num_slots: int = 2,
    two_phase: bool = False,
    staging: torch.Tensor | None = None,
    divide_by: float | None = None,
    tag: int = 0,
) -> RSStats:
    """Reduce ``grads`` over the transport's ranks into this rank's fp32 shard ``out``."""
    rank, w = transport.rank, transport.world_size
    if w != layout.world_size:
        raise ValueError(f"layout is for {layout.world_size} ranks, transport has {w}")
    if len(grads) != len(layout.params):
        raise ValueError(f"{len(grads)} gradients for {len(layout.params)} parameters")
    dtypes = {g.dtype for g in grads}
    if len(dtypes) != 1:
        raise ValueError(f"gradients must share one dtype, got {sorted(map(str, dtypes))}")
    for p, g in enumerate(grads):
        if g.numel() != layout.params[p].numel or not g.is_contiguous():
            raise ValueError(f"gradient {p} must be contiguous with {layout.params[p].numel} elements")
    if out.dim() != 1 or out.numel() != layout.out_numel:
        raise ValueError(f"out must be 1-D with {layout.out_numel} elements, got {tuple(out.shape)}")
    if num_slots < 1:
        raise ValueError(f"num_slots must be >= 1, got {num_slots}")
    gdtype = grads[0].dtype
    chunk_numel = _clamp_chunk(layout, chunk_numel)
    need = staging_numel(layout, chunk_numel=chunk_numel, num_slots=num_slots, two_phase=two_phase)
    if staging is not None:
        if staging.dtype != gdtype or staging.dim() != 1 or staging.numel() < need:
            raise ValueError(f"staging must be 1-D {gdtype} with >= {need} elements")
        allocated = 0
    else:
        staging = torch.empty(need, dtype=gdtype, device=out.device)
        allocated = staging.numel() * staging.element_size()
    recv_slots = [staging.narrow(0, k * chunk_numel, chunk_numel) for k in range(num_slots if w > 1 else 0)]
    send_base = num_slots * chunk_numel

    # The reduction's first term: this rank's own rows (exact cast), padding zeroed as in stock's chunk_cat.
    own_bytes = 0
    with phase("reduce"):
        for p in range(len(layout.params)):
            n = layout.real_numel(p, rank)
            off = layout.out_offset(p)
            if n:
                first_row, _ = layout.owner_rows(p, rank)
                start = first_row * layout.params[p].row_numel
                out.narrow(0, off, n).copy_(grads[p].reshape(-1).narrow(0, start, n))
                own_bytes += n * out.element_size()
            if layout.shard_numel(p) > n:
                out.narrow(0, off + n, layout.shard_numel(p) - n).zero_()

    stage_bytes = 0
    for step in range(1, w):
        dst, src = (rank + step) % w, (rank - step) % w
        send_chunks = layout.rs_chunks(dst, chunk_numel)
        recv_chunks = layout.rs_chunks(rank, chunk_numel)
        send_works: list[list[Any]] = []
        recv_works: dict[int, list[Any]] = {}

        for j in range(min(num_slots, len(recv_chunks))):
            recv_works[j] = _post_recv(transport, recv_slots[j % num_slots], recv_chunks[j], src, tag + step)
        for j in range(max(len(send_chunks), len(recv_chunks))):
            if j < len(send_chunks):
                pieces = send_chunks[j]
                if two_phase:
                    # Phase 1: the gradient read into a send slot, once the slot's previous send is done.
                    if j >= num_slots:
                        # A gloo work must be waited exactly once (a second wait blocks forever).
                        for work in send_works[j - num_slots]:
                            work.wait()
                        send_works[j - num_slots] = []
                    sslot = staging.narrow(0, send_base + (j % num_slots) * chunk_numel, chunk_numel)
                    views = []
                    for pc in pieces:
                        v = sslot.narrow(0, pc.slot, pc.numel)
                        v.copy_(_src_view(layout, grads, dst, pc))
                        stage_bytes += v.numel() * v.element_size()
                        views.append(v)
                else:
                    views = [_src_view(layout, grads, dst, pc) for pc in pieces]
                # Phase 2: network progress.
                send_works.append([transport.isend(v, dst, tag + step) for v in views])
            if j < len(recv_chunks):
                for work in recv_works.pop(j):
                    work.wait()
                slot = recv_slots[j % num_slots]
                for pc in recv_chunks[j]:
                    out.narrow(0, pc.dst, pc.numel).add_(slot.narrow(0, pc.slot, pc.numel))
                if (k := j + num_slots) < len(recv_chunks):
                    recv_works[k] = _post_recv(transport, slot, recv_chunks[k], src, tag + step)
        for works in send_works:
            for work in works:
                work.wait()
    if divide_by is not None and divide_by != 1:
        out.div_(divide_by)
    return RSStats(need * staging.element_size(), allocated, own_bytes, stage_bytes)
