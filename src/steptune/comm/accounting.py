"""Measured accounting of FSDP2's collective path: bytes copied, wire bytes, staging buffers.

``CopyCounter`` is a dispatch mode that counts the bytes *written* by every copy-like op that runs while it
is active, under the current ``phase`` (``layout`` by default; TIDE marks the first term of its fp32
reduction as ``reduce``). It sees FSDP2's own custom ops (``fsdp.all_gather_copy_in``,
``fsdp.split_with_sizes_copy``, ``fsdp.chunk_cat``) as single ops, and the aten copies around them
(``_foreach_copy_`` for the bf16 cast, ``copy_``, ``_to_copy``, ``clone``, ``cat``). Collectives and P2P are
not copies and are counted as wire bytes by whoever issues them.

``CommMeter`` accumulates one run's figures for both paths (stock FSDP2 and TIDE), so a benchmark compares
like with like: the same counter wraps the same three FSDP2 entry points whichever path runs.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections import defaultdict
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

__all__ = ["CommMeter", "CopyCounter", "MeterFanout", "phase"]

_PHASE: contextvars.ContextVar[str] = contextvars.ContextVar("steptune_comm_phase", default="layout")

# op name -> how to find the written tensors: "out" kwarg, first arg (in-place), or the result.
_WRITES = {
    "aten::copy_": "arg0",
    "aten::_foreach_copy_": "arg0",
    "aten::split_with_sizes_copy": "out",
    "aten::_chunk_cat": "out_or_result",
    "aten::cat": "out_or_result",
    "aten::_to_copy": "result",
    "aten::clone": "result",
    "aten::contiguous": "result",
    "fsdp::all_gather_copy_in": "arg0_sources",
    "fsdp::split_with_sizes_copy": "out",
    "fsdp::chunk_cat": "out",
}


@contextlib.contextmanager
def phase(name: str) -> Iterator[None]:
    """Attribute copies inside the block to ``name`` instead of ``layout``."""
    token = _PHASE.set(name)
    try:
        yield
    finally:
        _PHASE.reset(token)


def _nbytes(x: Any) -> int:
    if isinstance(x, torch.Tensor):
        return x.numel() * x.element_size()
    if isinstance(x, (list, tuple)):
        return sum(_nbytes(t) for t in x)
    return 0


class CopyCounter(TorchDispatchMode):
    """Bytes written by copy-like ops, keyed by ``(phase, op name)``."""

    def __init__(self) -> None:
        super().__init__()
        self.bytes: dict[tuple[str, str], int] = defaultdict(int)

    def __torch_dispatch__(
        self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: Any = None
    ) -> Any:
        kwargs = kwargs or {}
        result = func(*args, **kwargs)
        name = func._schema.name
        how = _WRITES.get(name)
        if how is not None:
            if how in ("arg0", "arg0_sources"):  # copy-in writes exactly its inputs into its rank slice
                written = _nbytes(args[0])
            elif how == "out":
                written = _nbytes(kwargs.get("out"))
            elif how == "out_or_result":
                written = _nbytes(kwargs.get("out", result))
            else:
                written = _nbytes(result)
            self.bytes[(_PHASE.get(), name)] += written
        return result

    def total(self, phase_name: str = "layout") -> int:
        return sum(b for (ph, _), b in self.bytes.items() if ph == phase_name)


@dataclass
class CommMeter:
    """One run's collective-path figures (per rank), filled by the FSDP2 entry points while active."""

    copies: CopyCounter = field(default_factory=CopyCounter)
    wire_bytes: dict[str, dict[str, int]] = field(
        default_factory=lambda: defaultdict(lambda: defaultdict(int))
    )
    """``{"all_gather" | "reduce_scatter": {dtype: bytes}}`` sent by this rank."""
    rs_staging_high_water: int = 0
    """Largest staging a single reduce-scatter needed (stock: its full-group input buffer)."""
    rs_staging_allocated: int = 0
    """Sum over reduce-scatters of staging newly allocated for them."""
    calls: dict[str, int] = field(default_factory=lambda: defaultdict(int))

    def add_wire(self, op: str, dtype: torch.dtype, nbytes: int) -> None:
        self.wire_bytes[op][str(dtype).removeprefix("torch.")] += nbytes

    def count(self, call: str) -> None:
        self.calls[call] += 1

    def add_staging(self, nbytes: int, allocated: int) -> None:
        self.rs_staging_high_water = max(self.rs_staging_high_water, nbytes)
        self.rs_staging_allocated += allocated

    def summary(self) -> dict[str, Any]:
        return {
            "layout_bytes": self.copies.total("layout"),
            "reduce_term_bytes": self.copies.total("reduce"),
            "collective_internal_bytes": self.copies.total("collective"),
            "copies_by_op": {f"{ph}:{op}": b for (ph, op), b in sorted(self.copies.bytes.items())},
            "wire_bytes": {op: dict(d) for op, d in self.wire_bytes.items()},
            "rs_staging_high_water_bytes": self.rs_staging_high_water,
            "rs_staging_allocated_bytes": self.rs_staging_allocated,
            "calls": dict(self.calls),
        }


class MeterFanout:
    """Several meters fed as one: nested ``measure`` blocks each count everything inside them."""

    def __init__(self, meters: list[CommMeter]) -> None:
        self.meters = list(meters)

    @property
    def copies(self) -> contextlib.AbstractContextManager[Any]:
        stack = contextlib.ExitStack()
        for m in self.meters:  # nested dispatch modes: each counter sees every op once
            stack.enter_context(m.copies)
        return stack

    def add_wire(self, op: str, dtype: torch.dtype, nbytes: int) -> None:
        for m in self.meters:
            m.add_wire(op, dtype, nbytes)

    def add_staging(self, nbytes: int, allocated: int) -> None:
        for m in self.meters:
            m.add_staging(nbytes, allocated)

    def count(self, call: str) -> None:
        for m in self.meters:
            m.count(call)
