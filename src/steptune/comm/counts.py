"""Exact byte counts the cost model charges, per rank, for a given set of FSDP2 parameter groups.

These are the model's accounting rules applied to real parameter shapes (with FSDP2's padding), so they
can be checked against what ``CommMeter`` measures on gloo (tests/dist/comm/test_fsdp.py):

- stock, per all-gather: the bf16 cast and the copy-in each write the padded local shard (2 bytes each per
  element), the copy-out writes ``W`` padded shards; per reduce-scatter: ``chunk_cat`` writes ``W`` padded
  shards in fp32. Wire: ``(W-1)/W`` of each collective's buffer.
- TIDE, per all-gather: the cast writes this rank's real rows only; per reduce-scatter the reduce term writes
  them in fp32. Wire: the bytes the all-gather plan (``ag``'s rounds) and the reduce-scatter plan send.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from steptune.comm.ag import ag_rounds, window_segments
from steptune.comm.layout import GroupLayout, ParamSpec

__all__ = ["GroupShapes", "predicted_counts"]


@dataclass(frozen=True, slots=True)
class GroupShapes:
    shapes: tuple[tuple[int, ...], ...]
    all_gathers_per_step: int
    """2 for units resharded after forward, 1 for FSDP2's root group."""


def predicted_counts(
    groups: Sequence[GroupShapes], w: int, rank: int, *, steps: int = 1, ag_algorithm: str = "rd"
) -> dict[str, dict[str, int]]:
    """``{"stock" | "tide": {"layout_bytes", "reduce_term_bytes", "ag_wire_bytes", "rs_wire_bytes"}}``."""
    stock = dict.fromkeys(("layout_bytes", "reduce_term_bytes", "ag_wire_bytes", "rs_wire_bytes"), 0)
    tide = dict(stock)
    for g in groups:
        lay = GroupLayout(tuple(ParamSpec(s) for s in g.shapes), w)
        padded = sum(lay.shard_numel(p) for p in range(len(g.shapes)))
        real = sum(lay.real_numel(p, rank) for p in range(len(g.shapes)))
        n_ag = g.all_gathers_per_step
        stock["layout_bytes"] += n_ag * (2 * padded + 2 * padded + 2 * w * padded) + 4 * w * padded
        stock["ag_wire_bytes"] += n_ag * 2 * (w - 1) * padded
        stock["rs_wire_bytes"] += 4 * (w - 1) * padded
        tide["layout_bytes"] += n_ag * 2 * real
        tide["reduce_term_bytes"] += 4 * real
        sent = 0
        for _, send_first, _, _, count in ag_rounds(lay, rank, ag_algorithm):
            sent += sum(seg.numel for seg in window_segments(lay, range(len(g.shapes)), send_first, count))
        tide["ag_wire_bytes"] += n_ag * 2 * sent
        tide["rs_wire_bytes"] += 2 * sum(lay.rs_numel(q) for q in range(w) if q != rank)
    return {k: {m: v * steps for m, v in d.items()} for k, d in (("stock", stock), ("tide", tide))}
