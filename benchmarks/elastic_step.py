"""What elasticity costs a failure-free step: ``resilience.elastic``'s ``ctx.ddp`` and ``ctx.sync`` against
torch's DDP and a packed all-reduce on a fixed gloo group, interleaved in the same ranks.

    PYTHONPATH=src python benchmarks/elastic_step.py --ranks 2 --repeats 5 --json runs/elastic_step.json

Every variant trains its own copy of the same model (same init, same batches) in the same spawned
processes; rounds alternate the variants, and each round times ``--steps`` steps after one warm-up step.
Variants:
- ``ddp``: ``DistributedDataParallel`` on a fixed gloo group (the anchor: no elasticity).
- ``packed``: one packed all-reduce of the gradients on a fixed group (``core.dist.allreduce_grads``).
- ``ctx.ddp``: the model under ``ctx.ddp`` inside ``ctx.attempt()`` (DDP's hook on the elastic group;
  ``ctx.track``'s default peer recovery: no per-step copy).
- ``ctx.sync``: ``ctx.sync`` inside ``ctx.attempt()`` (the packed all-reduce; peer recovery).
- ``ctx.ddp/snapshot``, ``ctx.sync/snapshot``: the same with ``restore="snapshot"`` (each step deep-copies
  model and optimizer; two copies kept).
``held_bytes``: what the recovery state holds after the last step (copies, buffers), per variant.
The figures are CPU ones: gloo on loopback, ranks sharing the box's cores.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch
from torch import nn

VARIANTS = ("ddp", "packed", "ctx.ddp", "ctx.sync", "ctx.ddp/snapshot", "ctx.sync/snapshot")


def _model(width: int, layers: int) -> nn.Module:
    torch.manual_seed(0)  # every variant and rank: the same initial weights
    return nn.Sequential(*(_block(width) for _ in range(layers)))


def _block(width: int) -> nn.Module:
    return nn.Sequential(nn.Linear(width, 4 * width), nn.GELU(), nn.Linear(4 * width, width))


def _batch(step: int, width: int, items: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(step)
    x = torch.randn(items, width, generator=g)
    return x, torch.tanh(x)


def bench_rank(ctx: Any, cfg: dict[str, Any]) -> dict[str, list[float]]:
    """One rank's rounds: ``{variant: [seconds per step, one per round]}``."""
    from torch.nn.parallel import DistributedDataParallel

    from steptune.core.dist import allreduce_grads, as_process_group, new_gloo_group

    width, items = cfg["width"], cfg["items"]
    # The anchors' fixed group, on the job's store (a prefix of its own): the same ranks, no elasticity.
    fixed = new_gloo_group(ctx._store, ctx.rank, ctx.world, prefix="bench-fixed")
    models = {v: _model(width, cfg["layers"]) for v in VARIANTS}
    opts = {v: torch.optim.AdamW(m.parameters(), lr=1e-3) for v, m in models.items()}
    nets: dict[str, nn.Module] = {
        "ddp": DistributedDataParallel(
            models["ddp"], process_group=as_process_group(fixed, ctx._store, ctx.rank, ctx.world, prefix="bd")
        ),
        "packed": models["packed"],
        "ctx.ddp": ctx.ddp(models["ctx.ddp"], average=False),
        "ctx.sync": models["ctx.sync"],
        "ctx.ddp/snapshot": ctx.ddp(models["ctx.ddp/snapshot"], average=False),
        "ctx.sync/snapshot": models["ctx.sync/snapshot"],
    }
    held: dict[str, float] = {}
    step_of = dict.fromkeys(VARIANTS, 0)

    def one_step(v: str) -> None:
        x, y = _batch(step_of[v], width, items)
        mine = list(ctx.shard(items))
        loss = ((nets[v](x[mine]) - y[mine]) ** 2).sum() / items
        loss.backward()
        if v == "packed":
            allreduce_grads(list(models[v].parameters()), fixed)
        elif v.startswith("ctx.sync"):
            ctx.sync(models[v], loss)
        if v == "ddp":  # DDP averages: scale back to the sum, as the others have it
            for p in models[v].parameters():
                p.grad.mul_(ctx.world)
        opts[v].step()
        opts[v].zero_grad()
        step_of[v] += 1

    def track(v: str) -> None:  # outside the timed region: once per variant and round
        if v.startswith("ctx."):
            mode = "snapshot" if v.endswith("/snapshot") else "peer"
            ctx.track(models[v], opts[v], restore=mode, replace=True)

    def run(v: str, steps: int) -> None:
        if v.startswith("ctx."):
            for _ in range(steps):
                with ctx.attempt():
                    one_step(v)
        else:
            for _ in range(steps):
                one_step(v)

    times: dict[str, list[float]] = {v: [] for v in VARIANTS}
    for v in VARIANTS:
        track(v)
        run(v, 1)  # warm-up: DDP's first-iteration work, allocator, gloo's first messages
    for r in range(cfg["repeats"]):
        order = VARIANTS if r % 2 == 0 else VARIANTS[::-1]
        for v in order:
            track(v)
            ctx.all_reduce(torch.zeros(1))  # the ranks start each variant together
            t0 = time.perf_counter()
            run(v, cfg["steps"])
            times[v].append((time.perf_counter() - t0) / cfg["steps"])
            if v.startswith("ctx."):
                held[v] = float(ctx.held_bytes)
    pairs = zip(models["ddp"].parameters(), models["ctx.sync"].parameters(), strict=True)
    same = max(float((a - b).detach().abs().max()) for a, b in pairs)  # the same training, both ways
    times["max_param_diff_ddp_vs_ctx.sync"] = [same]
    times.update({f"held_bytes:{v}": [b] for v, b in held.items()})
    return times


def summarize(results: dict[int, dict[str, list[float]]], cfg: dict[str, Any]) -> dict[str, Any]:
    """Per variant the median over rounds of the slowest rank's seconds per step, and ratios to ``ddp``."""
    rounds = cfg["repeats"]
    per_round = {v: [max(res[v][i] for res in results.values()) for i in range(rounds)] for v in VARIANTS}
    med = {v: statistics.median(xs) for v, xs in per_round.items()}
    ratios = {
        v: statistics.median(a / b for a, b in zip(per_round[v], per_round["ddp"], strict=True))
        for v in VARIANTS
    }
    params = sum(p.numel() for p in _model(cfg["width"], cfg["layers"]).parameters())
    diff = max(res["max_param_diff_ddp_vs_ctx.sync"][0] for res in results.values())
    held = {v: results[0][f"held_bytes:{v}"][0] for v in VARIANTS if v.startswith("ctx.")}
    return {"config": {**cfg, "params": params}, "step_s": per_round, "median_step_s": med,
            "ratio_to_ddp": ratios, "max_param_diff_ddp_vs_ctx_sync": diff, "held_bytes": held}  # fmt: skip


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--ranks", type=int, default=2)
    p.add_argument("--width", type=int, default=512)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--items", type=int, default=64, help="global batch (split over the ranks)")
    p.add_argument("--steps", type=int, default=8, help="timed steps per variant and round")
    p.add_argument("--repeats", type=int, default=5, help="rounds (variants alternate their order)")
    p.add_argument("--quick", action="store_true", help="a tiny model, 2 rounds of 2 steps (a dry run)")
    p.add_argument("--json", type=Path)
    a = p.parse_args(argv)
    if a.quick:
        a.width, a.layers, a.steps, a.repeats = 32, 1, 2, 2
    cfg = {k: getattr(a, k) for k in ("width", "layers", "items", "steps", "repeats")}
    from steptune.resilience.elastic import launch

    res = launch(bench_rank, a.ranks, cfg, timeout_s=600)
    if res["lost"]:
        raise RuntimeError(f"ranks lost during the benchmark: {res['lost']}")
    out = summarize(res["results"], {**cfg, "ranks": a.ranks})
    print(f"{out['config']['params'] / 1e6:.2f} M params, {a.ranks} ranks, global batch {a.items}")
    for v in VARIANTS:
        held = f"  holds {out['held_bytes'][v] / 2**20:7.1f} MiB" if v in out["held_bytes"] else ""
        ms, ratio = out["median_step_s"][v] * 1e3, out["ratio_to_ddp"][v]
        print(f"  {v:17s} {ms:8.1f} ms/step  x{ratio:.3f} of ddp{held}")
    diff = out["max_param_diff_ddp_vs_ctx_sync"]
    print(f"  max |param| diff, ddp vs ctx.sync after the same steps: {diff:.2e}")
    if a.json:
        a.json.parent.mkdir(parents=True, exist_ok=True)
        a.json.write_text(json.dumps(out, indent=1))
    return out


if __name__ == "__main__":
    sys.exit(0 if main() else 1)
