"""Inputs that change between timed calls, so that a kernel cannot be timed returning what it memoized.

A candidate that caches its output by the input's address and a few sampled values is right on every
validation trial (each trial draws new values) and, timed on one fixed draw, returns a copy of the cached
output: 3.6x over torch's softmax, all of it unreal (2026-12-05). Before every timed call the profiler
therefore rewrites about 1% of the elements of each floating-point input with values copied from other
positions of the same tensor (``poke``): the values stay in the input's own range (a positive input stays
positive). Every call sees the draw with one poke (the last call's is undone first), so the call the
profiler checks in each round looks like any other: it runs on a ``variant``, the draw with a poke fixed
before the candidate was imported, whose reference output was computed then. A memoizing candidate then
either misses its cache (and is timed doing the work) or returns an output for other values, which the
checked call shows.

Inputs whose structure a poke breaks (a symmetric positive-definite matrix, sorted values) are found
before the candidate is imported: the reference raises on a variant, or returns NaN or inf where it did
not on the draw. Those inputs are not varied (``Variants.why_not`` says so) and are timed as before.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch

__all__ = ["FRACTION", "Pokes", "Variants", "float_leaves", "poke", "pokes"]

FRACTION = 0.01
"""The share of each floating-point input's elements a poke rewrites (at least one)."""


def float_leaves(xs: Any) -> list[torch.Tensor]:
    """The contiguous floating-point and complex tensors in ``xs`` (inside lists, tuples and dicts too) with
    two elements or more: what a poke may rewrite."""
    if isinstance(xs, torch.Tensor):
        ok = (xs.is_floating_point() or xs.is_complex()) and xs.numel() >= 2 and xs.is_contiguous()
        return [xs] if ok else []
    if isinstance(xs, list | tuple):
        return [t for x in xs for t in float_leaves(x)]
    if isinstance(xs, dict):
        return [t for x in xs.values() for t in float_leaves(x)]
    return []


Pokes = list[tuple[torch.Tensor, torch.Tensor]]
"""Per leaf: (positions written, positions read), flat indices on the leaf's device."""


def pokes(
    leaves: list[torch.Tensor], gen: torch.Generator, fraction: float = FRACTION, calls: int = 0
) -> Pokes:
    """Random positions for one poke of each leaf (drawn on the CPU from ``gen``, moved to its device).
    ``calls`` > 0: for that many calls at once, each index tensor with a leading dimension of ``calls``
    (row ``i`` is call ``i``'s)."""
    out = []
    for t in leaves:
        n = t.numel()
        m = max(1, math.ceil(fraction * n))
        shape = (calls, m) if calls else (m,)
        dst = torch.randint(n, shape, generator=gen).to(t.device)
        src = torch.randint(n, shape, generator=gen).to(t.device)
        out.append((dst, src))
    return out


def poke(leaves: list[torch.Tensor], plan: Pokes) -> None:
    """Rewrite each leaf's ``dst`` positions with the values at its ``src`` positions (in place)."""
    with torch.no_grad():
        for t, (dst, src) in zip(leaves, plan, strict=True):
            flat = t.view(-1)
            flat[dst] = flat[src]


@dataclass
class Variants:
    """The pokes of each round's checked call and the reference's outputs on them, made before the
    candidate is imported; ``plans`` is empty, with the reason in ``why_not``, when inputs are not varied."""

    plans: list[Pokes]
    outputs: list[Any]
    why_not: str = ""
