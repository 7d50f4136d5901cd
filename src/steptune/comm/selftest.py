"""A small, exact self-test of TIDE's collectives on a real process group, run by ``enable_tide``.

Every rank builds the same seeded tensors for a plan with uneven and zero-row shards, runs TIDE's all-gather
(checked bitwise) and reduce-scatter (checked against an fp64 reduction of the same bf16 gradients), then
the ranks agree on one verdict with an all-reduce, so either every rank enables TIDE or none does.
"""

from __future__ import annotations

from typing import Any

import torch

from steptune.comm.ag import all_gather_into
from steptune.comm.config import TideConfig
from steptune.comm.layout import GroupLayout, ParamSpec
from steptune.comm.rs import reduce_scatter_into
from steptune.comm.transport import select_transport

__all__ = ["self_test"]

_SHAPES = ((5, 3), (2,), (1, 4), (9,))
_TAG = 0x7300


def _tensors(seed: int, dtype: torch.dtype) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(s, generator=g).to(dtype) for s in _SHAPES]


def _check(group: Any, device: torch.device, config: TideConfig) -> str | None:
    rank, w = group.rank(), group.size()
    layout = GroupLayout(tuple(ParamSpec(s) for s in _SHAPES), w, 2, config.align_bytes)
    transport = select_transport(group, device)
    full = _tensors(1234, torch.float32)
    shards = []
    for p, t in enumerate(full):
        first, rows = layout.owner_rows(p, rank)
        shards.append(t[first : first + rows].reshape(-1).to(device))
    slot = torch.full((layout.slot_numel,), float("nan"), dtype=torch.bfloat16, device=device)
    out = torch.empty(layout.out_numel, dtype=torch.float32, device=device)
    grads = [g.reshape(-1).to(device) for g in _tensors(99 + rank, torch.bfloat16)]
    # Both collectives run on every rank before any check: a rank that stopped early would hang its peers.
    all_gather_into(layout, slot, shards, transport, algorithm=config.ag_algorithm, tag=_TAG)
    reduce_scatter_into(layout, grads, out, transport, chunk_numel=4, num_slots=2, divide_by=w, tag=_TAG + 64)
    for p, t in enumerate(full):
        got = slot.narrow(0, layout.slot_offset(p), t.numel()).cpu()
        if not torch.equal(got, t.to(torch.bfloat16).reshape(-1)):
            return f"all-gather of parameter {p} {tuple(t.shape)} differs"
    every = [_tensors(99 + q, torch.bfloat16) for q in range(w)]
    for p in range(len(_SHAPES)):
        first, rows = layout.owner_rows(p, rank)
        if rows == 0:
            continue
        ref = sum(e[p][first : first + rows].double() for e in every) / w
        got = out.narrow(0, layout.out_offset(p), ref.numel()).cpu().double().reshape(ref.shape)
        if (got - ref).abs().max().item() > 1e-6 * max(1.0, ref.abs().max().item()):
            return f"reduce-scatter of parameter {p} differs from the fp64 reference"
    return None


def self_test(group: Any, device: torch.device, config: TideConfig) -> str | None:
    """None when TIDE's collectives are exact on ``group``; else the first failure (same on every rank)."""
    try:
        problem = _check(group, device, config)
    except Exception as exc:  # a transport that cannot run here is a verdict, not a crash
        problem = f"{type(exc).__name__}: {exc}"
    flag = torch.tensor([0.0 if problem is None else 1.0], device=device)
    group.allreduce([flag]).wait()
    if flag.item() == 0:
        return None
    return problem or "another rank's self-test failed"
