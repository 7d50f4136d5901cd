"""A live DP x PP job under ``Runtime``: real pipeline stages over gloo, ResiHP's planner moving layers.

Layout: ``dp`` replicas of a ``pp``-stage pipeline, rank = replica * pp + stage (tp = 1), the device
numbering of ``plan.initial_plan``. Every rank builds the same tiny decoder (embedding, 32 blocks, head:
one module per layer of the 8B preset) but owns only its stage's layers; the others are filled with NaN,
so a layer that was not moved correctly poisons the loss.

Each step:
- ``plan_dp`` assigns the step's variable-length microbatches to replicas by predicted cost over each
  replica's modelled throughput (its bottleneck stage under the current partition and detected speeds).
- Each replica runs 1F1B: activations forward and their gradients backward travel as real gloo
  send/recv between stage ranks. Every F and B+W is a ``Runtime.timed`` block on this stage's layers
  (emulated device time x the injected slowdown); waiting for a neighbour is not in the sample.
- Gradients are summed over the world per layer (each rank contributes the layers it owns; zeros
  elsewhere). The sync is therefore layer-wise, which is what lets replicas hold different partitions.
  SGD with momentum then steps the owned layers.
- ``Runtime.end_step`` gathers the samples, runs predictor and detector and updates the speeds. When
  the detected speeds change, ``progressive_replan`` (TP -> PP -> DP, ski-rental gated) gives the next
  plan. Layers whose owner changes travel at this safe point: parameters and momentum buffers, sent by
  the old owner and received by the new one. The emulated transfer time (16 bytes per parameter of the
  8B layer over the node's link) is slept on both ends.
- With ``stage_sync`` in the spec (set where a link fault is injected), each stage's gradient all-reduce
  among its DP replicas is emulated over the link as well (``Runtime.comm_timed`` on the stage's ranks;
  emulated time only: the real layer-wise sync is world-wide, and on a shared CPU it takes longer than
  the modelled all-reduce), so a slow link (``link_faults``) slows its stage's all-reduce and is found
  and localized as in the DP job. Activations between stages are not slowed: a microbatch's take
  ~4.5 ms over the network against ~1.4 s of its stage's compute (0.3%; 1.3% through a 4x slower
  link), overlapped by 1F1B.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager
from typing import Any

import torch
from torch import nn

from steptune.resilience.live import (
    PROXY_MAX,
    global_batch,
    link_bandwidth,
    report_row,
    run_each,
    run_spawned,
    stage_model,
    stage_sync_seconds,
    sum_and_step,
    summarize,
)
from steptune.resilience.plan import ClusterState, ExecutionPlan, ReconfigCosts
from steptune.resilience.planners import plan_dp
from steptune.resilience.progressive import progressive_replan
from steptune.resilience.replans import initial_plan
from steptune.resilience.runtime import LinkFault, Runtime, RuntimeConfig, SlowFault
from steptune.resilience.workload import StageModel, features

__all__ = [
    "compare_pipelined",
    "one_f_one_b_order",
    "owned_layers",
    "parse_layout",
    "pipelined_rank",
    "planner_layer_costs",
    "replica_rates",
    "run_pipelined",
    "run_stage",
]

_HIDDEN = 32
_VOCAB = 64
_BYTES_PER_PARAM = 16.0
"""bf16 weights + fp32 master, grads and two Adam moments: what moving a layer costs on a real cluster."""


def parse_layout(text: str) -> tuple[int, int, int]:
    """``"dp=2,pp=2"`` -> (dp, pp, tp). Live, TP and PP do not combine (one of them is 1)."""
    out = {"dp": 1, "pp": 1, "tp": 1}
    seen: set[str] = set()
    for part in text.split(","):
        key, _, value = part.partition("=")
        if key.strip() not in out or not value.strip().isdigit() or int(value) < 1:
            raise ValueError(f"layout {text!r}: use comma-separated dp=N,pp=N or dp=N,tp=N with N >= 1")
        if key.strip() in seen:
            raise ValueError(f"layout {text!r}: {key.strip()} is given twice")
        seen.add(key.strip())
        out[key.strip()] = int(value)
    if out["tp"] > 1 and out["pp"] > 1:
        raise ValueError(f"layout {text!r}: the live jobs run TP or PP, not both; use dp=N,pp=M or dp=N,tp=M")
    if out["tp"] & (out["tp"] - 1):
        raise ValueError(f"layout {text!r}: tp must be a power of two (ResiHP's TP degrees)")
    return out["dp"], out["pp"], out["tp"]


def one_f_one_b_order(stage: int, num_stages: int, m: int) -> list[tuple[str, int]]:
    """This stage's 1F1B order: ``num_stages - stage - 1`` warm-up forwards, then one F one B."""
    order = [("F", k) for k in range(min(num_stages - stage - 1, m))]
    f = len(order)
    for b in range(m):
        if f < m:
            order.append(("F", f))
            f += 1
        order.append(("B", b))
    return order


def _layers(seed: int, num_blocks: int) -> list[nn.Module]:
    from steptune.pipeline.stages import tiny_decoder_layers

    return tiny_decoder_layers(
        vocab=_VOCAB, hidden=_HIDDEN, num_layers=num_blocks, seq_len=PROXY_MAX, seed=seed
    )


def owned_layers(part: Sequence[int], stage: int) -> range:
    start = sum(part[:stage])
    return range(start, start + part[stage])


class _Stage:
    """This rank's view: the full list of layers, the owned range, the optimizer and the transfers."""

    def __init__(self, rank: int, group: Any, layers: list[nn.Module], opt: torch.optim.Optimizer) -> None:
        self.rank, self.group, self.layers, self.opt = rank, group, layers, opt
        self.owned: range = range(0)

    def poison(self, idx: int) -> None:
        with torch.no_grad():
            for p in self.layers[idx].parameters():
                p.fill_(math.nan)
                self.opt.state.pop(p, None)

    def _flat(self, idx: int) -> torch.Tensor:
        parts = []
        for p in self.layers[idx].parameters():
            buf = self.opt.state.get(p, {}).get("momentum_buffer")
            parts += [p.detach().reshape(-1), (buf if buf is not None else torch.zeros_like(p)).reshape(-1)]
        return torch.cat(parts)

    def _load(self, idx: int, flat: torch.Tensor) -> None:
        off = 0
        with torch.no_grad():
            for p in self.layers[idx].parameters():
                n = p.numel()
                p.copy_(flat[off : off + n].view_as(p))
                self.opt.state[p] = {"momentum_buffer": flat[off + n : off + 2 * n].view_as(p).clone()}
                off += 2 * n

    def move(self, moves: list[tuple[int, int, int]], *, keep_sent: bool = False) -> None:
        """Send or receive each (layer, src rank, dst rank) this rank takes part in.

        Every send is posted before the first blocking receive, so ranks that both give and take layers
        (deeper pipelines) cannot wait on each other.
        """
        works = []
        for idx, src, dst in moves:
            if src == self.rank:
                flat = self._flat(idx)
                works.append((self.group.send([flat], dst, 1_000_000 + idx), flat))
        for idx, src, dst in moves:
            if dst == self.rank:
                n = 2 * sum(p.numel() for p in self.layers[idx].parameters())
                buf = torch.empty(n)
                self.group.recv([buf], src, 1_000_000 + idx).wait()
                self._load(idx, buf)
        for work, _ in works:
            work.wait()
        for idx, src, _ in moves:
            if src == self.rank and not keep_sent:  # keep_sent: a copy (restoring a lost replica)
                self.poison(idx)


def _moves(old: ExecutionPlan, new: ExecutionPlan, pp: int) -> list[tuple[int, int, int]]:
    """(layer, old owner rank, new owner rank) for every layer that changes stage in some replica."""
    out = []
    for r, (a, b) in enumerate(zip(old.layer_partition, new.layer_partition, strict=True)):
        owner_a = [s for s, n in enumerate(a) for _ in range(n)]
        owner_b = [s for s, n in enumerate(b) for _ in range(n)]
        out += [
            (i, r * pp + x, r * pp + y)
            for i, (x, y) in enumerate(zip(owner_a, owner_b, strict=True))
            if x != y
        ]
    return out


def replica_rates(
    plan: ExecutionPlan, layer_costs: Sequence[float], speeds: Sequence[float], pp: int
) -> tuple[list[float], list[float]]:
    """Per replica: throughput (microbatch cost units per second) and pipeline fill (seconds), modelled."""
    total = sum(layer_costs)
    rates, base = [], []
    for r, part in enumerate(plan.layer_partition):
        t = [
            sum(layer_costs[i] for i in owned_layers(part, s)) / total / speeds[r * pp + s] for s in range(pp)
        ]
        rates.append(1.0 / max(t))
        base.append(total * (sum(t) - max(t)))
    return rates, base


def planner_layer_costs(spec: dict[str, Any], full: StageModel) -> tuple[float, ...]:
    """The live planner's per-layer F+B+W seconds: one sequence as long as step 0's mean microbatch. It
    overweights attention against packed microbatches, but the split only depends on relative layer
    costs, and every block is the same layer."""
    mbs0, _ = global_batch(int(spec.get("seed", 0)), 0, spec)
    ref = [round(sum(features(mb)[0] for mb in mbs0) / len(mbs0))]
    return tuple(
        max(sum(StageModel(layers=(x,), device=full.device).time(ref, p) for p in "FBW"), 1e-9)
        for x in full.layers
    )


def pipelined_rank(rank: int, group: Any, spec: dict[str, Any]) -> dict[str, Any]:
    steps, seed = int(spec.get("steps", 60)), int(spec.get("seed", 0))
    dp, pp = int(spec["dp"]), int(spec["pp"])
    replica, stage = divmod(rank, pp)
    cfg = RuntimeConfig(
        adapt=bool(spec.get("adapt", True)), time_scale=float(spec.get("time_scale", 0.02)), seed=seed
    )
    full = stage_model(spec.get("model", "llama3.1-8b"), spec.get("cluster", "dgx-h100"))
    rt = Runtime(
        group,
        full,
        cfg,
        faults=[SlowFault(**f) for f in spec.get("faults", [])],
        link_faults=[LinkFault(**f) for f in spec.get("link_faults", [])],
    )
    peers = [r for r in range(dp * pp) if r % pp == stage]  # this stage's DP group
    num_layers = len(full.layers)
    layers = _layers(seed, num_layers - 2)
    params = [p for m in layers for p in m.parameters()]
    param_layer = [i for i, m in enumerate(layers) for _ in m.parameters()]
    opt = torch.optim.SGD(params, lr=0.05, momentum=0.9)
    me = _Stage(rank, group, layers, opt)
    layer_costs = planner_layer_costs(spec, full)
    link = link_bandwidth(spec.get("cluster", "dgx-h100"), dp * pp)

    def state(speeds: Sequence[float]) -> ClusterState:
        return ClusterState(speeds=tuple(min(1.0, v) for v in speeds), layer_costs=layer_costs, num_heads=1)

    plan = initial_plan(
        state([1.0] * dp * pp), tp=1, pp=pp, dp=dp, global_microbatches=int(spec.get("microbatches", 16))
    )
    me.owned = owned_layers(plan.layer_partition[replica], stage)
    for i in range(num_layers):
        if i not in me.owned:
            me.poison(i)
    planned_speeds = tuple(rt.speeds)
    losses, rows = [], []
    for step in range(steps):
        mbs, tokens = global_batch(seed, step, spec)
        total = sum(t.shape[1] - 1 for t in tokens)
        rates, base = replica_rates(plan, layer_costs, rt.speeds, pp)
        mb_costs = [rt.cost(mb) for mb in mbs]
        replicas = [range(r * pp, (r + 1) * pp) for r in range(dp)]  # a replica left idle gets probed
        assignment = rt.add_probes(plan_dp(mb_costs, rates, base=base), mb_costs, rates, replicas, base)
        mine = assignment[replica]
        part = StageModel(layers=tuple(full.layers[i] for i in me.owned), device=full.device)
        prev, nxt = (rank - 1 if stage > 0 else None), (rank + 1 if stage < pp - 1 else None)
        loss_sum = run_stage(
            me, prev, nxt, stage, pp, mine, tokens, total,
            lambda i, ph: rt.timed(mbs[i], part=part, phases=ph),  # noqa: B023 (called within the step)
        )  # fmt: skip
        owned = {k for k, i in enumerate(param_layer) if i in me.owned}  # layer-wise gradient sync
        losses.append(sum_and_step(params, opt, group, loss_sum, owned))
        if spec.get("stage_sync"):  # the 8B stage's DP all-reduce over the link: emulated time only, since
            # the real sync above is the emulation's world-wide layer-wise one, slower here than the model
            with rt.comm_timed(stage_sync_seconds(spec, me.owned, dp, dp * pp), ranks=peers):
                pass
        report = rt.end_step(tokens=sum(sum(mb) for mb in mbs))
        row: dict[str, Any] = {
            **report_row(report),
            "partition": [list(p) for p in plan.layer_partition],
            "microbatches_per_replica": [len(a) for a in assignment],
            "plan_log": [],
        }
        if cfg.adapt and tuple(rt.speeds) != planned_speeds:
            planned_speeds = tuple(rt.speeds)
            new, log = progressive_replan(
                state(rt.speeds),
                plan,
                expected_fault_duration_s=float(spec.get("expected_slow_s", 24 * 60.0)),
                reconfig_costs=ReconfigCosts(tp_s=1.0, pp_s=float(spec.get("pp_stall_s", 5.0)), dp_s=0.0),
                per_replica_partitions=bool(spec.get("per_replica_partitions", True)),
            )
            row["plan_log"] = log
            if new.layer_partition != plan.layer_partition:
                moves = _moves(plan, new, pp)
                me.move(moves)
                mine_moved = sum(1 for _, s, d in moves if rank in (s, d))
                rt.sleep_device(mine_moved * _layer_bytes(full, moves) / link)
                me.owned = owned_layers(new.layer_partition[replica], stage)
                row["moved_layers"] = len(moves)
            plan = new
        rows.append(row)
    return {"rank": rank, "losses": losses, "reports": rows}


def _layer_bytes(full: StageModel, moves: list[tuple[int, int, int]]) -> float:
    if not moves:
        return 0.0
    return max(full.layers[i].params for i, _, _ in moves) * _BYTES_PER_PARAM


def run_stage(
    me: _Stage,
    prev: int | None,
    nxt: int | None,
    stage: int,
    num_stages: int,
    mine: list[int],
    tokens: list[torch.Tensor],
    total: int,
    timed: Callable[[int, tuple[str, ...]], AbstractContextManager[Any]],
) -> torch.Tensor:
    """This stage's 1F1B over its pipeline's microbatches ``mine``; returns the summed weighted loss.

    ``prev``/``nxt``: the neighbouring stages' ranks in ``me.group`` (None at the ends). ``timed(i,
    phases)`` wraps each F and B+W of microbatch ``i`` (the emulated device time); waiting for a
    neighbour is outside it.
    """
    from steptune.pipeline.stages import lm_loss

    kept: dict[int, tuple[torch.Tensor | None, torch.Tensor]] = {}
    sends = []
    loss_sum = torch.zeros(())
    for kind, k in one_f_one_b_order(stage, num_stages, len(mine)):
        i = mine[k]
        seq = tokens[i].shape[1] - 1
        if kind == "F":
            x: torch.Tensor | None = None
            if prev is None:
                h = tokens[i][:, :-1]
            else:
                x = torch.empty(1, seq, _HIDDEN)
                me.group.recv([x], prev, 2 * i).wait()
                x.requires_grad_()
                h = x
            with timed(i, ("F",)):
                for idx in me.owned:
                    h = me.layers[idx](h)
                if nxt is None:
                    h = lm_loss(h, tokens[i][:, 1:]) * seq / total
            if nxt is None:
                loss_sum += h.detach()
            else:
                out = h.detach().contiguous()
                sends.append((me.group.send([out], nxt, 2 * i), out))
            kept[k] = (x, h)
        else:
            x, h = kept.pop(k)
            grad = None
            if nxt is not None:
                grad = torch.empty(1, seq, _HIDDEN)
                me.group.recv([grad], nxt, 2 * i + 1).wait()
            with timed(i, ("B", "W")):
                h.backward(grad)
            if x is not None:
                assert x.grad is not None and prev is not None
                g = x.grad.contiguous()
                sends.append((me.group.send([g], prev, 2 * i + 1), g))
    for work, _ in sends:
        work.wait()
    return loss_sum


def run_pipelined(spec: dict[str, Any], pool: Any = None) -> dict[str, Any]:
    """One run on dp x pp spawned processes (``pool``: reuse a ``SpawnPool``'s ranks)."""
    return run_spawned(pipelined_rank, spec, int(spec["dp"]) * int(spec["pp"]), pool)


def compare_pipelined(spec: dict[str, Any], progress: Callable[[str], None] | None = None) -> dict[str, Any]:
    """Healthy, unmitigated and adapted runs of the same seeds: ``live.summarize``'s fields plus the
    adapted run's plan changes and final partitions."""
    from steptune.testing.spawn import SpawnPool

    ranks = int(spec["dp"]) * int(spec["pp"])
    with SpawnPool(ranks, timeout=600) as pool:  # one spawn for three runs
        jobs = {
            "healthy": lambda: run_pipelined({**spec, "faults": [], "link_faults": []}, pool),
            "unmitigated": lambda: run_pipelined({**spec, "adapt": False}, pool),
            "adapted": lambda: run_pipelined({**spec, "adapt": True}, pool),
        }
        runs = run_each(jobs, progress)
    adapted = runs["adapted"]["reports"]
    return {
        **summarize(spec, ranks, runs),
        "plan_changes": [
            {"step": r["step"], "log": r["plan_log"], "moved_layers": r.get("moved_layers", 0)}
            for r in adapted
            if r["plan_log"]
        ],
        "partitions": adapted[-1]["partition"],
    }
