"""Fail-stop survival for DP x TP: the dead member's TP shard comes back from its DP peers.

Layout ``dp`` replicas of a ``tp``-way group of ``tensorpar``'s Megatron-style model (original rank =
replica * tp + member); each member holds its units of every block's FFN (the rest NaN) and the group's
replicated tensors. Each step the microbatches are split over the replicas by ``plan_dp`` (each replica's
speed: ``replica_speed``), TP sums are point-to-point messages, and gradients are summed over the world
per unit (``tensorpar._sync_and_step``), so the update does not depend on who holds what.

When a member dies, the survivors run ``failstop``'s protocol (new gloo group, common safe point,
rollback). Then ``survivor_owners`` gives the new layout: a group that lost a member shares all its units
equally among the members it has left (Megatron with a smaller TP degree); untouched groups stay. A unit
whose holder is gone is sent, with its momentum, by a survivor that holds the same unit in another replica
(``restore_moves``). The replicated tensors need nothing: every member holds them. When no survivor holds
some unit, the job stops with an error naming the units (a checkpoint would be the fallback: see
``failstop_pipe`` for that path).
"""

from __future__ import annotations

import datetime
import os
import signal
import time
from collections.abc import Sequence
from typing import Any

import torch

from steptune.core.dist import LostGroups, connect_store, new_gloo_group
from steptune.pipeline.stages import lm_loss
from steptune.resilience.failstop import compare_failstop, doomed, finish, split_sync
from steptune.resilience.live import global_batch, link_bandwidth, stage_model
from steptune.resilience.planners import plan_dp
from steptune.resilience.recovery import Recovery, Snapshots
from steptune.resilience.tensorpar import (
    _BYTES_PER_PARAM,
    _UNITS_PER_DEVICE,
    Owners,
    TPModel,
    _Holder,
    _rows,
    _sync_and_step,
    _TPGroup,
    equal_owners,
    held,
    members,
    replica_speed,
)

__all__ = ["compare_failstop_tp", "reference_model", "restore_moves", "survivor_owners"]


def survivor_owners(owners: Owners, alive: Sequence[int]) -> Owners:
    """Groups that lost a member share their units equally among the members left (in member order);
    a group with nobody left is dropped. Raises ``ValueError`` if no group has a member left."""
    live = set(alive)
    units = len(owners[0])
    groups = [tuple(m for m in members(row) if m in live) for row in owners]
    keep = [(row, g) for row, g in zip(owners, groups, strict=True) if g]
    if not keep:
        raise ValueError("no rank survived")
    return tuple(row if len(g) == len(members(row)) else equal_owners([g], units)[0] for row, g in keep)


def restore_moves(old: Owners, new: Owners, alive: Sequence[int]) -> list[tuple[int, int, int]]:
    """(unit, source rank, destination rank) for every unit a survivor holds in ``new`` and not in ``old``;
    the source is the lowest surviving rank holding that unit in ``old`` (its own group first, else a DP
    peer). Raises ``LookupError`` naming the units no survivor holds."""
    live = set(alive)
    moves, lost = [], set()
    for row in new:
        for u, dst in enumerate(row):
            if any(r[u] == dst for r in old):
                continue
            same = [r[u] for r in old if dst in r and r[u] in live]  # its own group, if the holder lived
            peers = sorted(r[u] for r in old if r[u] in live)
            src = (same or peers or [None])[0]
            if src is None:
                lost.add(u)
            else:
                moves.append((u, src, dst))
    if lost:
        raise LookupError(f"no surviving copy of TP units {sorted(lost)}: only a checkpoint has them")
    return moves


def _renumber(owners: Owners, members_: list[int]) -> Owners:
    return tuple(tuple(members_.index(r) for r in row) for row in owners)


def _tp_worker(orig: int, world: int, port: int, spec: dict[str, Any], out: Any) -> None:
    torch.set_num_threads(1)
    seed, steps, scale = int(spec["seed"]), int(spec["steps"]), float(spec["time_scale"])
    dp, tp = int(spec["dp"]), int(spec["tp"])
    units = tp * _UNITS_PER_DEVICE
    timeout = datetime.timedelta(seconds=20)
    store = connect_store(port, timeout=datetime.timedelta(seconds=60))
    full = stage_model()
    model = TPModel(seed)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    members_, gen = list(spec.get("members", range(world))), int(spec.get("gen", 0))
    if members_ != list(range(world)):
        raise ValueError("the DP x TP fail-stop job survives in place only (no restart mode)")
    group = new_gloo_group(store, orig, world, prefix=f"gen{gen}", timeout=timeout)
    owners = equal_owners([tuple(range(r * tp, (r + 1) * tp)) for r in range(dp)], units)  # original ranks
    holder = _Holder(orig, group, model, opt, units)
    holder.drop_unheld(owners)
    unit_bytes = sum(x.params for x in full.layers) / units * _BYTES_PER_PARAM
    link = link_bandwidth(spec.get("cluster", "dgx-h100"), world)
    step, losses = 0, {}
    info: dict[str, Any] = {"recoveries": []}
    snapshots = Snapshots(model, opt)
    recovery = Recovery(store, orig, spec, snapshots, timeout)
    lost = LostGroups()  # a broken group, freed once its worker threads are idle
    while step < steps:
        snapshots.take(step)
        die = doomed(spec, orig, step)
        try:
            g_owners = _renumber(owners, members_)
            synced = split_sync(spec, orig, step, gen)
            losses[step] = _tp_step(
                model, opt, group, members_.index(orig), g_owners, step, spec, full, die, synced
            )
            step += 1
        except RuntimeError:
            failed = True
        else:
            failed = False
        while failed:  # outside the except block: its traceback holds the broken group (see failstop)
            lost.add(group)
            holder.group = group = None
            lost.free()
            opt.zero_grad()
            joined, step, losses, adopted = recovery.rejoin(gen + 1, step, losses)
            members_, group, gen = joined.members, joined.group, joined.generation
            del joined  # it holds the group: when that group breaks, only `lost` may keep it (peers wait)
            if adopted is not None:  # a peer committed it
                owners = adopted
                info["recoveries"].append({"from": "committed by peers", "step": step, "owners": owners})
            t0 = time.perf_counter()
            new = survivor_owners(owners, members_)
            moves = restore_moves(owners, new, members_)  # LookupError: no copy left (stated, not hidden)
            rank = members_.index(orig)
            holder.group, holder.rank = group, rank
            moved = [(u, members_.index(s), members_.index(d)) for u, s, d in moves]
            if not recovery.copy(group, gen, new, lambda moved=moved: holder.transfer(moved)):
                info["recoveries"].append({"from": "aborted", "step": step, "generation": gen})
                continue  # a survivor died during the copy: every rank keeps the old owners
            mine = sum(1 for _, s, d in moves if orig in (s, d))  # the emulated transfer of the real shard
            time.sleep(mine * unit_bytes / link * scale)
            owners = new
            holder.drop_unheld(_renumber(owners, members_))
            info["recoveries"].append(
                {"from": "peers", "step": step, "moves": moves, "owners": owners,
                 "restore_s": time.perf_counter() - t0}
            )  # fmt: skip
            snapshots.clear()
            failed = False
    finish(out, (orig, {k: losses[k] for k in sorted(losses)}, {**info, "owners": owners}))


def _tp_step(model: TPModel, opt: Any, group: Any, rank: int, owners: Owners, step: int,
             spec: dict[str, Any], full: Any, die: bool, synced: Any = None) -> float:  # fmt: skip
    """One step of this rank (group ranks in ``owners``): its replica's microbatches, then the sync
    (``synced``: a context around its all-reduces)."""
    seed, scale = int(spec["seed"]), float(spec["time_scale"])
    mbs, tokens = global_batch(seed, step)
    total = sum(t.shape[1] - 1 for t in tokens)
    costs = [sum(full.time(mb, ph) for ph in "FBW") for mb in mbs]
    assignment = plan_dp(costs, [replica_speed(row, [1.0] * group.size()) for row in owners])
    loss_sum = torch.zeros(())
    mine = next((r for r, row in enumerate(owners) if rank in row), None)
    if mine is not None:
        g = members(owners[mine])
        tpg = _TPGroup(group, rank, g)
        rows = _rows(rank, owners)
        fraction = len(held(rank, owners)) / len(owners[0])
        for k, i in enumerate(assignment[mine]):
            if die and k == len(assignment[mine]) // 2:
                os.kill(os.getpid(), signal.SIGKILL)  # mid-step: its group is waiting on its partial sums
            t0 = time.perf_counter()
            x = tokens[i]
            loss = lm_loss(model(x[:, :-1], tpg, rows), x[:, 1:]) * (x.shape[1] - 1) / total
            loss.backward()
            if rank == g[0]:
                loss_sum += loss.detach()
            rest = costs[i] * fraction * scale - (time.perf_counter() - t0)
            if rest > 0:
                time.sleep(rest)
    return _sync_and_step(model, opt, group, loss_sum, rank, owners, synced)


def compare_failstop_tp(spec: dict[str, Any], reference: list[float] | None = None) -> dict[str, Any]:
    """Survive in place (the dead member's shard from DP peers) against the failure-free losses.

    ``reference``: failure-free losses by step (``reference_model`` + ``live.reference_losses`` gives
    them in one process); without it a failure-free job runs too. No restart run: the restart baseline's
    checkpoint path is ``failstop`` / ``failstop_pipe``'s."""
    base = {"dp": 2, "tp": 2, "ranks": int(spec.get("dp", 2)) * int(spec.get("tp", 2)), **spec}
    return compare_failstop(base, _tp_worker, reference, restart=False)


def reference_model(spec: dict[str, Any]) -> tuple[TPModel, Any]:
    """The whole TP model in one process and its forward (one member holding every unit)."""
    solo = _TPGroup(None, 0, [0])
    return TPModel(int(spec.get("seed", 0))), lambda m, x: m(x, solo, slice(None))
