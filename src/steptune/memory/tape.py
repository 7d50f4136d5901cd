"""The tape: one block's forward pass as the dispatcher saw it, and its backward slice.

Contract:
- A *slot* is one tensor view seen in the block (storage group, offset, shape, stride, dtype). A
  *value* is a slot at a version of its storage: ``(sid, version)``. Versions are our own, bumped
  by writes read off the op schema, because autograd bumps ``_version`` above the dispatch mode.
- The tape holds no internal activation: only argument templates, slot metadata, strong references
  to *externals* (tensors the block did not produce: inputs, parameters, buffers, captured
  constants) and to *saved* values (force-saved or chosen by a save policy).
- Every value backward reads is at its storage's final version, so replaying the slice in tape order
  reproduces exactly what backward reads. Autograd skips its own version check under saved-tensor
  hooks, so ``frame.Frame`` does it: unpacking a value written in place after it was packed raises
  autograd's "modified by an inplace operation" error.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

__all__ = [
    "ExternalRef",
    "OpNode",
    "Slot",
    "Tape",
    "TapeSACError",
    "ValueKey",
    "backward_slice",
]

ValueKey = tuple[int, int]
"""``(slot id, storage version)``."""


class TapeSACError(RuntimeError):
    """A TapeSAC contract was broken; the message says what to change."""


READS_WRITTEN = "reads a tensor the block writes in place"
"""The force-save reason of a node that read a block input, parameter or buffer the block writes later."""


@dataclass(slots=True)
class ExternalRef:
    """Where a tensor the block did not produce comes from at replay time."""

    kind: str
    """``"arg"`` (index into the block call's flattened tensor args), ``"param"`` (a parameter or
    buffer name relative to the block) or ``"captured"`` (held as recorded; not reusable)."""
    index: int = -1
    name: str = ""
    tensor: torch.Tensor | None = None
    version: int = 0
    written: bool = False
    """The block writes this external in place: ops reading it are not replayed."""


@dataclass(slots=True)
class Slot:
    sid: int
    group: int
    """Storage group (one per distinct storage seen)."""
    producer: int
    """Index of the producing node; -1 for an external."""
    born: int
    """Storage version when the slot was created."""
    shape: tuple[int, ...]
    dtype: torch.dtype
    nbytes: int
    external: ExternalRef | None = None


@dataclass(slots=True)
class OpNode:
    index: int
    func: Any
    """The aten ``OpOverload`` (or custom op) the dispatcher ran."""
    flat_args: list[Any]
    """Flattened args and kwargs with every tensor replaced by ``_Ref(sid, version)``."""
    spec: Any
    reads: list[ValueKey]
    outs: list[tuple[int, int]]
    """``(flat output index, sid)`` for each tensor output."""
    out_versions: list[int]
    writes: list[int] = field(default_factory=list)
    """Storage groups this node writes in place."""
    random: bool = False
    rng_state: Any = None
    """Generator state before the op ran (random ops recorded every step)."""
    force_save: str | None = None
    """Why the node cannot be replayed (its outputs are saved instead); None if it can."""
    flops: int = 0

    @property
    def name(self) -> str:
        return str(self.func)


@dataclass(frozen=True, slots=True)
class _Ref:
    sid: int
    version: int


@dataclass(slots=True)
class Tape:
    """One recorded forward of one block."""

    nodes: list[OpNode]
    slots: list[Slot]
    group_writes: dict[int, list[tuple[int, int]]]
    """Storage group -> [(version after the write, writer node index)] in order."""
    group_version: dict[int, int]
    """Storage group -> final version."""
    packs: list[ValueKey | None]
    """Per autograd pack, in order: the value packed, or None when the tensor was kept as is."""
    pack_meta: list[tuple[tuple[int, ...], torch.dtype]]
    captured: dict[ValueKey, torch.Tensor]
    """Values held since forward: force-saved outputs and the save policy's choices."""
    stale: frozenset[ValueKey] = frozenset()
    """Packed values written in place (autograd's version moved) later in the forward: unpacking one raises
    autograd's "modified by an inplace operation", as training without TapeSAC does."""

    def final(self, sid: int) -> ValueKey:
        return (sid, self.group_version[self.slots[sid].group])

    def packed_internal(self) -> list[ValueKey]:
        seen: dict[ValueKey, None] = {}
        for key in self.packs:
            if key is not None:
                seen[key] = None
        return list(seen)


def backward_slice(
    tape: Tape, needed: list[ValueKey], saved: set[ValueKey]
) -> tuple[list[int], set[ValueKey]]:
    """Nodes to replay (tape order) to materialize ``needed``, cut at ``saved`` values and
    externals; also returns the saved values the replay reads."""
    want: set[int] = set()
    cut: set[ValueKey] = set()
    stack = list(needed)
    done: set[ValueKey] = set()
    while stack:
        key = stack.pop()
        if key in done:
            continue
        done.add(key)
        sid, version = key
        slot = tape.slots[sid]
        if slot.producer < 0:
            continue
        if key in saved:
            cut.add(key)
            continue
        producer = tape.nodes[slot.producer]
        if producer.force_save is not None:
            why = (
                "the block writes that tensor in place later, so this output was not held from forward"
                if producer.force_save == READS_WRITTEN
                else "and was overwritten in place later"
            )
            raise TapeSACError(
                f"backward needs an intermediate version of the output of {producer.name} "
                f"(node {producer.index}), which cannot be replayed ({producer.force_save}); {why}; "
                "exclude this block from TapeSAC"
            )
        nodes = [slot.producer]
        for after, writer in tape.group_writes.get(slot.group, []):
            if slot.born < after <= version:
                nodes.append(writer)
        for n in nodes:
            if n in want:
                continue
            node = tape.nodes[n]
            if node.force_save is not None:
                raise TapeSACError(
                    f"backward needs a value written by {node.name} (node {n}), which cannot be "
                    f"replayed ({node.force_save}); exclude this block from TapeSAC"
                )
            want.add(n)
            stack.extend(node.reads)
    return sorted(want), cut
