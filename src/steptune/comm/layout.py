"""Layout planning for TIDE: where every shard of every parameter lives, for every rank (pure, no group).

Contract. A parameter group of ``P`` parameters is sharded over ``W`` ranks on dim 0 with FSDP2's
semantics (``torch.chunk``): every rank's padded shard holds ``c = ceil(rows / W)`` rows; rank ``r``
holds ``rows_on(p, r) = clamp(rows - r * c, 0, c)`` real rows, so trailing ranks may hold fewer or zero
rows. Unsharded storage is *per parameter* and rank-major inside the parameter (as FSDP2's
``all_gather_outputs[0]``): rank ``r``'s shard of ``p`` lives at ``r * shard_numel(p)``. The real rows of
a parameter are therefore a contiguous prefix of its storage, and the real part of any contiguous block
of ranks is one contiguous segment: that is what lets an all-gather write every peer's rows straight into
parameter storage with one message per (parameter, block), and what keeps padding off the wire.

The slot of a group is one flat buffer holding every parameter's unsharded storage, each parameter at an
offset aligned to ``align_bytes`` (16 B for vectorised copies; NCCL windows want 4 KiB).

Reduce-scatter maps: owner ``r`` receives, from every peer, rows ``[r * c, r * c + rows_on(p, r))`` of each
parameter's gradient (a contiguous view of a contiguous gradient). The owner's fp32 output is the flat
layout stock FSDP2 uses (``shard_numel(p)`` per parameter, in parameter order), so gradients are views of
it exactly as in ``foreach_reduce``. Incoming data is cut into chunks of at most ``chunk_numel`` elements
(a chunk may span parameters); sender and receiver derive the same cut from this plan alone.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

__all__ = ["GroupLayout", "ParamSpec", "Piece", "Segment", "bruck_steps", "xor_steps"]


@dataclass(frozen=True, slots=True)
class ParamSpec:
    """One parameter's unsharded shape (dim 0 is the sharded dim)."""

    shape: tuple[int, ...]
    name: str = ""

    def __post_init__(self) -> None:
        if len(self.shape) == 0:
            raise ValueError(f"parameter {self.name!r}: a 0-d parameter cannot be dim-0 sharded; flatten it")
        if any(d < 0 for d in self.shape):
            raise ValueError(f"parameter {self.name!r}: negative dimension in {self.shape}")

    @property
    def rows(self) -> int:
        return self.shape[0]

    @property
    def row_numel(self) -> int:
        return math.prod(self.shape[1:])

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


@dataclass(frozen=True, slots=True)
class Segment:
    """``numel`` elements of parameter ``param`` starting at element ``start`` of its unsharded storage."""

    param: int
    start: int
    numel: int


@dataclass(frozen=True, slots=True)
class Piece:
    """Part of a reduce-scatter chunk: ``numel`` elements of parameter ``param``'s owner rows, starting
    ``src`` elements into those rows, landing ``dst`` elements into the owner's flat output and ``slot``
    elements into the staging slot."""

    param: int
    src: int
    numel: int
    dst: int
    slot: int


@dataclass(frozen=True)
class GroupLayout:
    """The placement plan of one parameter group over ``world_size`` ranks."""

    params: tuple[ParamSpec, ...]
    world_size: int
    itemsize: int = 2
    """Bytes per element of the unsharded (all-gather) dtype: 2 for bf16."""
    align_bytes: int = 16
    _slot_offsets: tuple[int, ...] = field(init=False, repr=False)
    _out_offsets: tuple[int, ...] = field(init=False, repr=False)

    def __post_init__(self) -> None:
        if self.world_size < 1:
            raise ValueError(f"world_size must be >= 1, got {self.world_size}")
        if not self.params:
            raise ValueError("a parameter group needs at least one parameter")
        if self.align_bytes % self.itemsize:
            raise ValueError(f"align_bytes={self.align_bytes} is not a multiple of itemsize={self.itemsize}")
        align = self.align_bytes // self.itemsize
        slot, out, s, o = [], [], 0, 0
        for p in range(len(self.params)):
            slot.append(s)
            out.append(o)
            s += -(-(self.shard_numel(p) * self.world_size) // align) * align
            o += self.shard_numel(p)
        slot.append(s)
        out.append(o)
        object.__setattr__(self, "_slot_offsets", tuple(slot))
        object.__setattr__(self, "_out_offsets", tuple(out))

    # -- sharding --------------------------------------------------------------------------------
    def chunk_rows(self, p: int) -> int:
        return -(-self.params[p].rows // self.world_size)

    def rows_on(self, p: int, rank: int) -> int:
        c = self.chunk_rows(p)
        return max(0, min(c, self.params[p].rows - rank * c))

    def shard_numel(self, p: int) -> int:
        """Padded shard numel (FSDP2's ``padded_sharded_param_size``)."""
        return self.chunk_rows(p) * self.params[p].row_numel

    def real_numel(self, p: int, rank: int) -> int:
        return self.rows_on(p, rank) * self.params[p].row_numel

    # -- all-gather placement --------------------------------------------------------------------
    @property
    def slot_numel(self) -> int:
        return self._slot_offsets[-1]

    def slot_offset(self, p: int) -> int:
        """Element offset of parameter ``p``'s unsharded storage inside the group slot."""
        return self._slot_offsets[p]

    def block_segment(self, p: int, first: int, count: int) -> Segment:
        """The real data of ranks ``[first, first + count)`` of parameter ``p``: one segment (maybe empty)."""
        s = self.shard_numel(p)
        start = first * s
        end = min((first + count) * s, self.params[p].numel)
        return Segment(p, start, max(0, end - start))

    # -- reduce-scatter maps ---------------------------------------------------------------------
    @property
    def out_numel(self) -> int:
        """Numel of one rank's flat reduce-scatter output (padded shards, stock FSDP2's layout)."""
        return self._out_offsets[-1]

    def out_offset(self, p: int) -> int:
        return self._out_offsets[p]

    def owner_rows(self, p: int, owner: int) -> tuple[int, int]:
        """``(first_row, num_rows)`` of parameter ``p``'s gradient that rank ``owner`` reduces."""
        return owner * self.chunk_rows(p), self.rows_on(p, owner)

    def rs_numel(self, owner: int) -> int:
        """Elements every peer sends to ``owner`` (real rows only: no padding on the wire)."""
        return sum(self.real_numel(p, owner) for p in range(len(self.params)))

    def rs_chunks(self, owner: int, chunk_numel: int) -> list[list[Piece]]:
        """The incoming stream for ``owner`` cut into chunks of at most ``chunk_numel`` elements."""
        if chunk_numel < 1:
            raise ValueError(f"chunk_numel must be >= 1, got {chunk_numel}")
        chunks: list[list[Piece]] = []
        cur: list[Piece] = []
        used = 0
        for p in range(len(self.params)):
            n, src = self.real_numel(p, owner), 0
            while n > 0:
                take = min(n, chunk_numel - used)
                cur.append(Piece(p, src, take, self.out_offset(p) + src, used))
                src, n, used = src + take, n - take, used + take
                if used == chunk_numel:
                    chunks.append(cur)
                    cur, used = [], 0
        if cur:
            chunks.append(cur)
        return chunks

    # -- accounting (what the stock path allocates and copies, from the same plan) -----------------
    def stock_rs_input_numel(self) -> int:
        """Stock FSDP2's full-group reduce-scatter input: ``W`` padded shards per parameter."""
        return self.out_numel * self.world_size


def xor_steps(world_size: int) -> list[tuple[int, int]]:
    """Recursive doubling (butterfly) for a power-of-two ``world_size``: ``(distance, block)`` per round.

    In round ``k`` rank ``r`` exchanges with ``r ^ 2**k`` the aligned block of ``2**k`` ranks it holds.
    """
    if world_size & (world_size - 1):
        raise ValueError(f"the butterfly needs a power-of-two world size, got {world_size}; use bruck_steps")
    return [(1 << k, 1 << k) for k in range(world_size.bit_length() - 1)]


def bruck_steps(world_size: int) -> list[tuple[int, int]]:
    """Recursive doubling in dissemination (Bruck) form, for any ``world_size``: ``(distance, count)``.

    In round ``k`` rank ``r`` holds ranks ``[r, r + 2**k)`` (mod ``W``); it sends ``count`` of them to
    ``r - distance`` and receives ``[r + distance, r + distance + count)`` from ``r + distance``. Blocks go
    straight to their absolute place in per-parameter storage, so no final rotation is needed.
    """
    steps, have = [], 1
    while have < world_size:
        count = min(have, world_size - have)
        steps.append((have, count))
        have += count
    return steps
