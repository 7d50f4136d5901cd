"""Inputs that change between timed calls, so that a kernel cannot be timed returning what it memoized.

A candidate that caches its output by the input's address and a few sampled values is right on every
validation trial (each trial draws new values) and, timed on one fixed draw, returns a copy of the cached
output: 3.6x over torch's softmax, all of it unreal (2026-12-05). Before every timed call the profiler
therefore rewrites some elements of each floating-point input (``FRACTION`` of them, at most ``MAX_POKES``)
with values copied from other positions of the same tensor (``poke``): the values stay in the input's own
range. The last call's poke is undone first (``unpoke``: only the positions it wrote), so each call sees
the draw with one poke of its own, drawn at random for every call. The one call the profiler
checks in each round runs on the draw itself, unpoked, and is compared with the reference's output on it,
computed before the candidate was imported: a memoizing candidate there returns the output of another
call's values, or missed its cache on every call and was timed doing the work. Checking on the draw, not a
poked copy, keeps a poke that breaks what the problem promises of its inputs (sorted values for
``searchsorted``) from failing an honest kernel.

Before the candidate is imported, the reference runs on two poked copies: if it raises, or
returns NaN or inf where it did not on the draw (a Cholesky factor of a matrix a poke left indefinite),
the inputs are timed unvaried, and the result says why.
"""

from __future__ import annotations

import math
from typing import Any

import torch

__all__ = ["FRACTION", "MAX_INDICES", "MAX_POKES", "Pokes", "float_leaves", "poke", "pokes", "unpoke"]

FRACTION = 0.01
"""The share of each floating-point input's elements a poke rewrites (at least one)."""
MAX_POKES = 1024
"""At most this many per input and call: a 16M-element input gets 1024, not 160k, writes per call."""
MAX_INDICES = 2**20
"""At most this many positions per input drawn for a round's calls (fewer per call when calls are many)."""


def float_leaves(xs: Any) -> list[torch.Tensor]:
    """The floating-point and complex tensors in ``xs`` (inside lists, tuples and dicts too) with two
    elements or more, in a fixed order: the same positions in ``xs`` and in a deep copy of it."""
    if isinstance(xs, torch.Tensor):
        return [xs] if (xs.is_floating_point() or xs.is_complex()) and xs.numel() >= 2 else []
    if isinstance(xs, list | tuple):
        return [t for x in xs for t in float_leaves(x)]
    if isinstance(xs, dict):
        return [t for x in xs.values() for t in float_leaves(x)]
    return []


Pokes = list[tuple[torch.Tensor, torch.Tensor]]
"""Per leaf: (positions written, positions read), ``[calls, m]`` linear indices (row-major, any strides)
on the leaf's device; row ``i`` is call ``i``'s poke."""


def pokes(leaves: list[torch.Tensor], gen: torch.Generator, calls: int = 1) -> Pokes:
    """A different random poke of each leaf for each of ``calls`` calls, drawn on the CPU from ``gen``."""
    out = []
    for t in leaves:
        n = t.numel()
        m = min(MAX_POKES, max(1, math.ceil(FRACTION * n)), max(1, MAX_INDICES // calls))
        dst, src = (torch.randint(n, (calls, m), generator=gen).to(t.device) for _ in range(2))
        out.append((dst, src))
    return out


def poke(leaves: list[torch.Tensor], plan: Pokes, call: int = 0) -> None:
    """Call ``call``'s poke: each leaf's written positions get the values at its read positions."""
    with torch.no_grad():
        for t, (dst, src) in zip(leaves, plan, strict=True):
            t.put_(dst[call], t.take(src[call]))


def unpoke(leaves: list[torch.Tensor], base: list[torch.Tensor], plan: Pokes, call: int = 0) -> None:
    """Undo call ``call``'s poke: its written positions back to ``base``'s values."""
    with torch.no_grad():
        for t, b, (dst, _) in zip(leaves, base, plan, strict=True):
            t.put_(dst[call], b.take(dst[call]))
