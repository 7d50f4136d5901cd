"""A live DP x TP job under ``Runtime``: Megatron-style tensor-parallel blocks over gloo, and ResiHP's
selective TP exclusion for real (a degraded member leaves its group, its shard moves to the survivors,
and it comes back when it recovers).

Layout: ``dp`` replicas of a ``tp``-way TP group, rank = replica * tp + member (pp = 1), the device
numbering of ``plan.initial_plan``. The model is a tiny decoder: embedding, ``_BLOCKS`` pre-norm MLP
blocks and an LM head. Each block's first linear is split by output rows and its second by input
columns into ``tp`` units (Megatron's column/row-parallel pair); a member computes its units and the
group sums the partial outputs. Embedding, norms, the second bias and the head are replicated in the
group. Every rank keeps full-shape tensors but holds only its units: the rest are NaN, so a shard that
did not travel correctly poisons the loss.

TP collectives are point-to-point on the job's gloo group (gloo cannot build a subgroup after the
fact, and a group of 2-4 needs no ring): every member sends its partial to every other and sums them
in member order, so all members get bit-identical results. Before each microbatch the group meets at a
barrier outside the timed block, so the sample of a healthy member does not include waiting for a slow
one; the wait is in the step time, as on a GPU.

Each step:
- ``plan_dp`` assigns the step's microbatches to replicas by predicted cost over each replica's group
  speed (k x the slowest member's detected speed).
- Each member times F+B+W of a microbatch as ``1/k`` of the model (``Runtime.timed(fraction=)``).
- Gradients are summed over the world per unit: a unit's owner contributes it, the group leader
  contributes the replicated tensors, so the update does not depend on who holds what. SGD with
  momentum steps what this rank holds.
- At the safe point, ``progressive_replan`` decides (TP exclusion first: ``plan_tp`` keeps the power-of-
  two subgroup maximizing k x min speed, behind the ski-rental gate). A changed group moves state:
  every unit whose holder changes is sent with its momentum by the old holder; a member that joins
  gets the replicated tensors from the group leader. An excluded device runs one probe microbatch per
  step, so the detector sees it recover; then the first plan is restored (same moves, reversed).
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager
from typing import Any

import torch
from torch import nn
from torch.nn import functional as F

from steptune.pipeline.stages import lm_loss
from steptune.resilience.live import (
    PROXY_MAX,
    global_batch,
    link_bandwidth,
    report_row,
    run_each,
    run_spawned,
    stage_model,
    summarize,
)
from steptune.resilience.plan import ClusterState, ExecutionPlan, ReconfigCosts, water_fill
from steptune.resilience.planners import makespan, plan_dp, should_apply
from steptune.resilience.progressive import progressive_replan
from steptune.resilience.replans import initial_plan
from steptune.resilience.runtime import Runtime, RuntimeConfig, SlowFault

__all__ = [
    "TP_POLICIES",
    "Owners",
    "TPModel",
    "compare_tensor_parallel",
    "equal_owners",
    "held",
    "members",
    "replica_speed",
    "run_tensor_parallel",
    "tp_rank",
    "uneven_owners",
]

_HIDDEN = 32
_FFN = 128
_VOCAB = 64
_BLOCKS = 2
"""Each block costs two TP sums forward and one backward (gloo messages of ~4 ms on a busy 2-core box), so
few blocks keep real work well inside the emulated time."""
_UNITS_PER_DEVICE = 4
"""TP units per device of the first plan: the granularity of uneven shares (a 1/3-speed member of a pair
can hold 2 of 8 units)."""
TP_POLICIES = ("resihp", "uneven")
"""resihp: ResiHP's selective exclusion with equal shares (the paper). uneven: steptune's shares in
proportion to speed, so a slow member keeps working on less (exclusion only when its share rounds to 0)."""
_BYTES_PER_PARAM = 16.0
"""bf16 weights + fp32 master, grads and two Adam moments: what moving a shard costs on a real cluster."""
_TAG = 50_000_000


class _Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(_HIDDEN)
        self.w1 = nn.Parameter(torch.randn(_FFN, _HIDDEN) / math.sqrt(_HIDDEN))
        self.b1 = nn.Parameter(torch.zeros(_FFN))
        self.w2 = nn.Parameter(torch.randn(_HIDDEN, _FFN) / math.sqrt(_FFN))
        self.b2 = nn.Parameter(torch.zeros(_HIDDEN))


class TPModel(nn.Module):
    """The tiny decoder; ``forward(ids, tp, rows)`` runs this member's rows of every block."""

    def __init__(self, seed: int) -> None:
        super().__init__()
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            self.tok = nn.Embedding(_VOCAB, _HIDDEN)
            self.pos = nn.Embedding(PROXY_MAX, _HIDDEN)
            self.blocks = nn.ModuleList(_Block() for _ in range(_BLOCKS))
            self.norm = nn.LayerNorm(_HIDDEN)
            self.out = nn.Linear(_HIDDEN, _VOCAB, bias=False)

    def sharded(self) -> list[tuple[nn.Parameter, int]]:
        """(parameter, dimension split into units) for every sharded tensor."""
        blocks = [b for b in self.blocks if isinstance(b, _Block)]
        return [x for b in blocks for x in ((b.w1, 0), (b.b1, 0), (b.w2, 1))]

    def replicated(self) -> list[nn.Parameter]:
        split = {id(p) for p, _ in self.sharded()}
        return [p for p in self.parameters() if id(p) not in split]

    def forward(self, ids: torch.Tensor, tp: _TPGroup, rows: slice) -> torch.Tensor:
        x = self.tok(ids) + self.pos(torch.arange(ids.shape[1]))
        for b in self.blocks:
            assert isinstance(b, _Block)
            h = _Copy.apply(b.norm(x), tp)  # type: ignore[no-untyped-call]
            u = F.gelu(F.linear(h, b.w1[rows], b.b1[rows]))
            x = x + _Reduce.apply(F.linear(u, b.w2[:, rows]), tp) + b.b2  # type: ignore[no-untyped-call]
        logits: torch.Tensor = self.out(self.norm(x))
        return logits


class _TPGroup:
    """Sum over the members by point-to-point messages on the job's group (identical bits everywhere)."""

    def __init__(self, group: Any, rank: int, members: Sequence[int]) -> None:
        self.group, self.rank, self.members = group, rank, tuple(members)
        self._calls = 0

    def allreduce(self, t: torch.Tensor) -> torch.Tensor:
        if len(self.members) == 1:
            return t
        self._calls += 1
        tag = _TAG + self._calls
        t = t.detach().contiguous()
        works = [self.group.send([t], m, tag) for m in self.members if m != self.rank]
        parts = []
        for m in self.members:
            if m == self.rank:
                parts.append(t)
            else:
                buf = torch.empty_like(t)
                self.group.recv([buf], m, tag).wait()
                parts.append(buf)
        for w in works:
            w.wait()
        out = parts[0].clone()
        for x in parts[1:]:
            out += x
        return out

    def barrier(self) -> None:
        self.allreduce(torch.zeros(1))


class _Copy(torch.autograd.Function):
    """Megatron's f: identity forward, sum of the members' input gradients backward."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, tp: _TPGroup) -> torch.Tensor:
        ctx.tp = tp
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> tuple[torch.Tensor, None]:
        return ctx.tp.allreduce(g), None


class _Reduce(torch.autograd.Function):
    """Megatron's g: sum of the members' partial outputs forward, identity backward."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, tp: _TPGroup) -> torch.Tensor:
        return tp.allreduce(x)

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> tuple[torch.Tensor, None]:
        return g, None


Owners = tuple[tuple[int, ...], ...]
"""Per replica, the rank holding each TP unit (``tp * _UNITS_PER_DEVICE`` units, contiguous per member)."""


def equal_owners(groups: Sequence[Sequence[int]], units: int) -> Owners:
    """ResiHP's layout: each member of a group of k holds units/k consecutive units, in member order."""
    return tuple(tuple(g[u * len(g) // units] for u in range(units)) for g in groups)


def uneven_owners(groups: Sequence[Sequence[int]], speeds: Sequence[float], units: int) -> Owners:
    """steptune's layout: units in proportion to speed. Each unit goes to the member that would finish its
    share soonest (count + 1) / speed, which minimizes max(count / speed) exactly (water-filling); a
    member left with 0 units is out of the group. Contiguous in the group's member order."""
    out = []
    for g in groups:
        if not any(speeds[d] > 0 for d in g):
            raise ValueError(f"TP group {tuple(g)} has no live member")
        counts = water_fill(g, speeds, units)
        out.append(tuple(d for d, c in zip(g, counts, strict=True) for _ in range(c)))
    return tuple(out)


def members(row: Sequence[int]) -> tuple[int, ...]:
    """A replica's group: the ranks holding its units, in order (the first is the leader)."""
    return tuple(dict.fromkeys(row))


def held(rank: int, owners: Owners) -> range:
    for row in owners:
        if rank in row:
            first = row.index(rank)
            return range(first, first + row.count(rank))
    return range(0)


def replica_speed(row: Sequence[int], speeds: Sequence[float]) -> float:
    """Throughput in healthy devices: the member that finishes its share last paces every TP sum."""
    return 1.0 / max(row.count(d) / len(row) / speeds[d] for d in members(row))


def _leader(rank: int, owners: Owners) -> bool:
    return any(row[0] == rank for row in owners)


def _in_group(rank: int, owners: Owners) -> bool:
    return any(rank in row for row in owners)


class _Holder:
    """This rank's state: which units and whether the replicated tensors; moves them between ranks."""

    def __init__(self, rank: int, group: Any, model: TPModel, opt: torch.optim.Optimizer, units: int) -> None:
        self.rank, self.group, self.model, self.opt, self.units = rank, group, model, opt, units
        self.unit = _FFN // units

    def _views(self, u: int | None, source: str) -> list[torch.Tensor]:
        """Views of unit ``u`` (None: the replicated tensors) in the parameters or momentum buffers."""
        out = []
        tensors: list[tuple[nn.Parameter, int | None]]
        if u is None:
            tensors = [(p, None) for p in self.model.replicated()]
        else:
            tensors = [(p, d) for p, d in self.model.sharded()]
        for p, dim in tensors:
            t = p.data if source == "param" else self._buffer(p)
            if dim is not None and u is not None:
                t = t.narrow(dim, u * self.unit, self.unit)
            out.append(t)
        return out

    def _buffer(self, p: nn.Parameter) -> torch.Tensor:
        st = self.opt.state.setdefault(p, {})
        if st.get("momentum_buffer") is None:
            st["momentum_buffer"] = torch.zeros_like(p)
        buf: torch.Tensor = st["momentum_buffer"]
        return buf

    def pack(self, u: int | None) -> torch.Tensor:
        return torch.cat([v.reshape(-1) for src in ("param", "buffer") for v in self._views(u, src)])

    def unpack(self, u: int | None, flat: torch.Tensor) -> None:
        off = 0
        with torch.no_grad():
            for src in ("param", "buffer"):
                for v in self._views(u, src):
                    v.copy_(flat[off : off + v.numel()].view_as(v))
                    off += v.numel()

    def poison(self, u: int | None) -> None:
        with torch.no_grad():
            for src in ("param", "buffer"):
                for v in self._views(u, src):
                    v.fill_(math.nan)

    def size(self, u: int | None) -> int:
        return 2 * sum(v.numel() for v in self._views(u, "param"))

    def move(self, old: Owners, new: Owners) -> int:
        """Apply the change of holders from ``old`` to ``new``; returns the pieces this rank moved.

        Every send is posted before the first blocking receive, so no pair of ranks waits on the other.
        """
        moves = _moves(old, new)
        self.transfer(moves)
        self.drop_unheld(new)
        return sum(1 for _, s, d in moves if self.rank in (s, d))

    def transfer(self, moves: Sequence[tuple[int | None, int, int]]) -> None:
        """Send or receive each (unit or None for the replicated tensors, source, destination) this rank
        takes part in, weights with momentum; every send is posted before the first blocking receive."""
        works = []
        for k, (u, src, dst) in enumerate(moves):
            if src == self.rank:
                flat = self.pack(u)
                works.append((self.group.send([flat], dst, _TAG - 1 - k), flat))
        for k, (u, src, dst) in enumerate(moves):
            if dst == self.rank:
                buf = torch.empty(self.size(u))
                self.group.recv([buf], src, _TAG - 1 - k).wait()
                self.unpack(u, buf)
        for w, _ in works:
            w.wait()

    def drop_unheld(self, owners: Owners) -> None:
        mine = held(self.rank, owners)
        for u in range(self.units):
            if u not in mine:
                self.poison(u)
        if not _in_group(self.rank, owners):
            self.poison(None)


def _moves(old: Owners, new: Owners) -> list[tuple[int | None, int, int]]:
    """(unit or None for the replicated tensors, source rank, destination rank), in a fixed order."""
    out: list[tuple[int | None, int, int]] = []
    for a, b in zip(old, new, strict=True):
        out += [(u, x, y) for u, (x, y) in enumerate(zip(a, b, strict=True)) if x != y]
        out += [(None, a[0], r) for r in members(b) if r not in a]
    return out


def _sync_and_step(
    model: TPModel, opt: torch.optim.Optimizer, group: Any, loss_sum: torch.Tensor, rank: int,
    owners: Owners, synced: AbstractContextManager[None] | None = None,
) -> float:  # fmt: skip
    """World sum of gradients per unit (owner contributes) and of replicated tensors (leader
    contributes); each rank then keeps the gradient of what it holds and steps. ``synced``: a context
    around the all-reduces (fault injection: ``failstop.split_sync``)."""
    mine = held(rank, owners)
    unit = _FFN // len(owners[0])
    split = dict(model.sharded())
    params = list(model.parameters())
    lead, member = _leader(rank, owners), _in_group(rank, owners)

    def contribution(p: nn.Parameter) -> torch.Tensor:
        if p.grad is None or (p not in split and not lead):
            return torch.zeros(p.numel())
        return p.grad.reshape(-1)

    flat = torch.cat([contribution(p) for p in params])
    with synced or contextlib.nullcontext():
        group.allreduce([flat]).wait()
        group.allreduce([loss_sum]).wait()
    off = 0
    for p in params:
        g = flat[off : off + p.numel()].view_as(p).clone()
        off += p.numel()
        if p in split:
            mask = torch.zeros_like(g)
            for u in mine:
                mask.narrow(split[p], u * unit, unit).fill_(1.0)
            p.grad = g * mask if len(mine) else None
        else:
            p.grad = g if member else None
    opt.step()
    opt.zero_grad()
    return float(loss_sum)


def _rows(rank: int, owners: Owners) -> slice:
    mine = held(rank, owners)
    unit = _FFN // len(owners[0])
    return slice(mine.start * unit, mine.stop * unit)


def tp_rank(rank: int, group: Any, spec: dict[str, Any]) -> dict[str, Any]:
    steps, seed = int(spec.get("steps", 60)), int(spec.get("seed", 0))
    dp, tp = int(spec["dp"]), int(spec["tp"])
    policy = spec.get("tp_policy", "resihp")
    if policy not in TP_POLICIES:
        raise ValueError(f"tp_policy {policy!r}: use one of {TP_POLICIES}")
    units = tp * _UNITS_PER_DEVICE
    if _FFN % units or tp & (tp - 1):
        raise ValueError(f"tp={tp}: the live TP job needs a power of two with {units} units dividing {_FFN}")
    cfg = RuntimeConfig(
        adapt=bool(spec.get("adapt", True)), time_scale=float(spec.get("time_scale", 0.02)), seed=seed
    )
    full = stage_model(spec.get("model", "llama3.1-8b"), spec.get("cluster", "dgx-h100"))
    rt = Runtime(group, full, cfg, faults=[SlowFault(**f) for f in spec.get("faults", [])])
    model = TPModel(seed)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    holder = _Holder(rank, group, model, opt, units)
    num_heads = 32  # the 8B preset's; a TP degree must divide it

    def state(speeds: Sequence[float]) -> ClusterState:
        return ClusterState(
            speeds=tuple(min(1.0, v) for v in speeds), layer_costs=(1.0,), num_heads=num_heads
        )

    base = initial_plan(
        state([1.0] * dp * tp), tp=tp, pp=1, dp=dp, global_microbatches=int(spec.get("microbatches", 16))
    )
    plan = base
    owners = equal_owners(plan.tp_groups, units)
    holder.drop_unheld(owners)
    unit_bytes = sum(x.params for x in full.layers) / units * _BYTES_PER_PARAM
    link = link_bandwidth(spec.get("cluster", "dgx-h100"), dp * tp)
    costs = ReconfigCosts(tp_s=float(spec.get("tp_stall_s", 1.0)), pp_s=5.0, dp_s=0.0)
    expected_s = float(spec.get("expected_slow_s", 24 * 60.0))
    planned_speeds = tuple(rt.speeds)
    losses, rows = [], []
    for step in range(steps):
        mbs, tokens = global_batch(seed, step, spec)
        total = sum(t.shape[1] - 1 for t in tokens)
        rates = [replica_speed(row, rt.speeds) for row in owners]
        mb_costs = [rt.cost(mb) for mb in mbs]  # a replica left idle gets a probe microbatch
        assignment = rt.add_probes(
            plan_dp(mb_costs, rates), mb_costs, rates, [members(row) for row in owners]
        )
        loss_sum = torch.zeros(())
        mine = next((r for r, row in enumerate(owners) if rank in row), None)
        if mine is None:  # excluded: one probe microbatch at the old share, so recovery shows
            with rt.timed(mbs[0], fraction=1 / tp):
                pass
        else:
            g = members(owners[mine])
            tpg = _TPGroup(group, rank, g)
            rows_ = _rows(rank, owners)
            fraction = len(held(rank, owners)) / units
            for i in assignment[mine]:
                tpg.barrier()  # outside the timed block: waiting for a slow member is not my time
                with rt.timed(mbs[i], fraction=fraction):
                    x = tokens[i]
                    seq = x.shape[1] - 1
                    loss = lm_loss(model(x[:, :-1], tpg, rows_), x[:, 1:]) * seq / total
                    loss.backward()
                if rank == g[0]:
                    loss_sum += loss.detach()
        losses.append(_sync_and_step(model, opt, group, loss_sum, rank, owners))
        report = rt.end_step(tokens=sum(sum(mb) for mb in mbs))
        row: dict[str, Any] = {
            **report_row(report),
            "tp_groups": [list(members(r)) for r in owners],
            "units": [[r.count(d) for d in members(r)] for r in owners],
            "microbatches_per_replica": [len(a) for a in assignment],
            "plan_log": [],
        }
        if cfg.adapt and tuple(rt.speeds) != planned_speeds:
            planned_speeds = tuple(rt.speeds)
            if policy == "resihp":
                if min(rt.speeds) >= 1.0 and plan.tp_groups != base.tp_groups:
                    plan, log = _readmit(base, plan)
                else:
                    plan, log = progressive_replan(
                        state(rt.speeds), plan, expected_fault_duration_s=expected_s, reconfig_costs=costs
                    )
                new = equal_owners(plan.tp_groups, units)
            else:
                new, log = _uneven_replan(owners, base.tp_groups, rt.speeds, len(mbs), expected_s, costs)
            row["plan_log"] = log
            if new != owners:
                moved = holder.move(owners, new)
                rt.sleep_device(moved * unit_bytes / link + costs.tp_s)
                row["moved_pieces"] = len(_moves(owners, new))
                owners = new
        rows.append(row)
    return {"rank": rank, "losses": losses, "reports": rows}


def _uneven_replan(
    owners: Owners,
    groups: Sequence[Sequence[int]],
    speeds: Sequence[float],
    microbatches: int,
    expected_s: float,
    costs: ReconfigCosts,
) -> tuple[Owners, list[str]]:
    """steptune: re-split every group's units by speed (``uneven_owners``), behind ResiHP's ski-rental
    gate on the modelled step (equal microbatches, LPT over the replicas' speeds)."""

    def step_time(o: Owners) -> float:
        rates = [replica_speed(r, speeds) for r in o]
        return makespan(plan_dp([1.0] * microbatches, rates), [1.0] * microbatches, rates)

    cand = uneven_owners(groups, speeds, len(owners[0]))
    if cand == owners:
        return owners, ["TP shares: no change"]
    t0, t1 = step_time(owners), step_time(cand)
    what = "; ".join(
        f"dp{r} {[a.count(d) for d in members(a)]} -> {dict((d, b.count(d)) for d in members(b))}"
        for r, (a, b) in enumerate(zip(owners, cand, strict=True))
        if a != b
    )
    if should_apply(t0, t1, expected_s, costs.tp_s):
        return cand, [f"TP shares (units per rank): {what}; step {t0:.4g} -> {t1:.4g}"]
    return owners, [
        f"TP shares: kept, {what} would cut the step {t0:.4g} -> {t1:.4g}: not worth {costs.tp_s} s"
    ]


def _readmit(base: ExecutionPlan, plan: ExecutionPlan) -> tuple[ExecutionPlan, list[str]]:
    """Every device is healthy again: the first plan's groups come back (a recovered device adds a
    whole device of throughput, which pays for a ``tp_s`` stall within steps)."""
    gone = sorted({d for g in base.tp_groups for d in g} - {d for g in plan.tp_groups for d in g})
    new = ExecutionPlan(
        version=plan.version + 1,
        tp_groups=base.tp_groups,
        layer_partition=base.layer_partition,
        microbatches=base.microbatches,
    )
    return new, [f"TP: readmitting recovered device(s) {gone}; groups back to {list(base.tp_groups)}"]


def run_tensor_parallel(spec: dict[str, Any], pool: Any = None) -> dict[str, Any]:
    """One run on dp x tp spawned processes (``pool``: reuse a ``SpawnPool``'s ranks)."""
    return run_spawned(tp_rank, spec, int(spec["dp"]) * int(spec["tp"]), pool)


def compare_tensor_parallel(
    spec: dict[str, Any], progress: Callable[[str], None] | None = None
) -> dict[str, Any]:
    """Healthy, unmitigated, adapted (ResiHP: exclusion, equal shares) and ``adapted_uneven`` (steptune:
    shares by speed) runs of the same seeds: ``live.summarize``'s fields, each adapted run's plan changes
    and final groups, and ``uneven_vs_resihp`` (the throughput ratio over the same window)."""
    from steptune.testing.spawn import SpawnPool

    ranks = int(spec["dp"]) * int(spec["tp"])
    with SpawnPool(ranks, timeout=600) as pool:
        jobs = {
            "healthy": lambda: run_tensor_parallel({**spec, "faults": []}, pool),
            "unmitigated": lambda: run_tensor_parallel({**spec, "adapt": False}, pool),
            "adapted": lambda: run_tensor_parallel({**spec, "adapt": True, "tp_policy": "resihp"}, pool),
            "adapted_uneven": lambda: run_tensor_parallel(
                {**spec, "adapt": True, "tp_policy": "uneven"}, pool
            ),
        }
        runs = run_each(jobs, progress)
    out = summarize(spec, ranks, runs)
    for name in ("adapted", "adapted_uneven"):
        reports = runs[name]["reports"]
        out[f"{name}_plan_changes"] = [
            {"step": r["step"], "log": r["plan_log"], "moved_pieces": r.get("moved_pieces", 0)}
            for r in reports
            if r["plan_log"]
        ]
        out[f"{name}_final"] = {"tp_groups": reports[-1]["tp_groups"], "units": reports[-1]["units"]}
    out["plan_changes"] = out["adapted_plan_changes"]
    out["losses"]["adapted_uneven"] = runs["adapted_uneven"]["losses"]
    tput = out["throughput_tokens_per_s"]
    out["uneven_vs_resihp"] = tput["adapted_uneven"] / tput["adapted"]
    return out
