"""PyTorch's private auto-SAC as an anchor: ``torch.distributed._tools``' per-module decision model
(``SACEstimator._get_sac_stats`` + ``sac_ilp.get_optimal_checkpointing_policy_per_module``, itself
from xformers' ``get_optimal_checkpoint_policy``), reproduced on the op statistics we measure.

Why a reproduction: as shipped it does not run on a CPU-only machine (the estimator asserts
FakeTensorMode, its benchmark mode times with CUDA events, its cost model needs CUDA capabilities,
and its ILP needs pulp). What is kept exactly: the op stream minus ``OPS_TO_ALWAYS_SKIP``; memory
per op = bytes of its output storages, 0 for view-like ops; in-place ops tied to the op that made
the storage they write (saved when there is none); random ops decided together; the last non-view,
non-in-place op costs no memory; the ILP maximizes saved runtime subject to saved memory <=
``ceil(budget x total op memory)``. What differs: runtimes are our measured per-op replay times
(the estimator's "operator-level-benchmark" mode measures the same thing on GPU), and the ILP is
solved exactly by scipy's HiGHS instead of CBC with a 5% gap. The decisions are applied as a torch
SAC policy (MUST_SAVE / PREFER_RECOMPUTE by op position in the block), early stop on.
"""

from __future__ import annotations

import itertools
import math
from typing import Any

import numpy as np

from steptune.memory.profile import BlockProfile

__all__ = ["auto_sac_context", "auto_sac_decisions"]


def _skipped() -> set[Any]:
    from torch.distributed._tools.sac_estimator import OPS_TO_ALWAYS_SKIP

    return set(OPS_TO_ALWAYS_SKIP)


def _is_view_like(func: Any) -> bool:
    from torch.testing._internal.composite_compliance import is_inplace_view_fn, is_view_fn

    return bool(is_view_fn(func) or is_inplace_view_fn(func))


def auto_sac_decisions(profile: BlockProfile, memory_budget: float) -> list[tuple[Any, bool]]:
    """``(op, save)`` for each op auto-SAC's model sees in one block's forward, in order."""
    if not 0.0 <= memory_budget <= 1.0:
        raise ValueError(
            f"memory_budget must be in [0, 1] (a fraction of the block's op memory); got {memory_budget}"
        )
    from scipy.optimize import Bounds, LinearConstraint, milp

    tape = profile.tape
    skipped = _skipped()
    nodes = [n for n in tape.nodes if callable(n.func) and n.func not in skipped]
    runtimes = [profile.cost_s[n.index] for n in nodes]
    memory: list[float] = []
    views: list[int] = []
    inplace: list[tuple[int, int]] = []
    rand: list[int] = []
    creator: dict[int, int] = {}  # storage group -> position of the first op that output it
    for i, node in enumerate(nodes):
        groups = {tape.slots[sid].group for _, sid in node.outs}
        view_like = _is_view_like(node.func)
        memory.append(0.0 if view_like else float(sum(profile.group_bytes[g] for g in groups)))
        if view_like:
            views.append(i)
        if node.writes:
            parents = [creator[g] for g in node.writes if g in creator]
            inplace.append((i, parents[0] if parents else i))
        if node.random:
            rand.append(i)
        for g in groups:
            creator.setdefault(g, i)
    skip = set(views) | {op for op, _ in inplace}
    last = len(nodes) - 1
    while last in skip and last > 0:
        last -= 1
    if nodes:
        memory[last] = 0.0
    num = len(nodes)
    rows: list[tuple[dict[int, float], float, float]] = []
    for i in views:
        rows.append(({i: 1.0}, 0.0, 0.0))
    for op, parent in inplace:
        rows.append(({op: 1.0, parent: -1.0}, 0.0, 0.0) if op != parent else ({op: 1.0}, 1.0, 1.0))
    for a, b in itertools.pairwise(rand):
        rows.append(({a: 1.0, b: -1.0}, 0.0, 0.0))
    rows.append(
        ({i: m for i, m in enumerate(memory)}, -np.inf, float(math.ceil(memory_budget * sum(memory))))
    )
    a = np.zeros((len(rows), num))
    lb, ub = [], []
    for r, (row, lo, hi) in enumerate(rows):
        for col, val in row.items():
            a[r, col] += val
        lb.append(lo)
        ub.append(hi)
    res = milp(
        -np.array(runtimes),
        constraints=LinearConstraint(a, lb, ub),
        integrality=np.ones(num),
        bounds=Bounds(0, 1),
        options={"time_limit": 10.0},
    )
    if res.x is None:
        raise ValueError(f"auto-SAC's ILP found no solution at memory_budget={memory_budget}: {res.message}")
    return [(node.func, bool(round(x))) for node, x in zip(nodes, res.x, strict=True)]


def auto_sac_context(decisions: list[tuple[Any, bool]]) -> Any:
    """A torch SAC ``context_fn`` applying ``decisions`` by op position in each block call."""
    from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

    skipped = _skipped()

    def make() -> Any:
        position = {"forward": 0, "recompute": 0}

        def policy(ctx: Any, func: Any, *args: Any, **kwargs: Any) -> Any:
            if func in skipped:
                return CheckpointPolicy.PREFER_RECOMPUTE
            mode = "recompute" if getattr(ctx, "is_recompute", False) else "forward"
            i = position[mode]
            position[mode] += 1
            if i < len(decisions) and decisions[i][0] == func and decisions[i][1]:
                return CheckpointPolicy.MUST_SAVE
            return CheckpointPolicy.PREFER_RECOMPUTE

        # Auto-SAC ties an in-place op to the op whose output it writes and saves both; torch SAC
        # then sees a cached tensor mutated (pytorch/pytorch#119590) unless told to allow it.
        return create_selective_checkpoint_contexts(policy, allow_cache_entry_mutation=True)

    return make
