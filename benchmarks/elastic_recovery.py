"""How long an ``elastic`` recovery takes when the survivors must exchange state: a split sync (it
completes on some ranks, which step and fail in the next step, and fails on another), with peer
recovery (the ranks behind receive the state of a rank ahead) and with snapshots (the ranks ahead roll
back), on the same model and faults, runs interleaved.

    PYTHONPATH=src python benchmarks/elastic_recovery.py --ranks 4 --repeats 3 --json runs/recovery.json

In step 2 rank 1 dies once its sync completed and rank 2 sees that sync fail (``toy_train``'s
``sync_kills`` / ``sync_misses``, on a bigger model); each survivor records how long its recovery took
(``recoveries[i]["seconds"]``: from the failed attempt to the settled state, rejoin included). Reported
per mode: the slowest survivor's recovery, the job's wall time, and whether every survivor's losses
equal a failure-free run of the same loop on one rank (fp32 tolerance 1e-5).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path
from typing import Any

import torch
from torch import nn

MODES = ("peer", "snapshot")


def train(ctx: Any, cfg: dict[str, Any]) -> dict[int, float]:
    """The docstring's loop: a ``layers`` x (width-4width-width) MLP, AdamW, a global batch per step."""
    from steptune.resilience.elastic import PeerLost

    torch.manual_seed(0)
    w = cfg["width"]
    model = nn.Sequential(
        *(nn.Sequential(nn.Linear(w, 4 * w), nn.GELU(), nn.Linear(4 * w, w)) for _ in range(cfg["layers"]))
    )
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    ctx.track(model, opt, restore=cfg["restore"])
    losses: dict[int, float] = {}
    while ctx.step < cfg["steps"]:
        with ctx.attempt():
            g = torch.Generator().manual_seed(ctx.step)
            x = torch.randn(cfg["items"], w, generator=g)
            mine = list(ctx.shard(len(x)))
            loss = ((model(x[mine]) - torch.tanh(x[mine])) ** 2).sum() / len(x)
            loss.backward()
            losses[ctx.step] = ctx.sync(model, loss)
            if cfg["faults"] and ctx.generation == 0 and ctx.step == 2:
                if ctx.orig == 1:  # its sync completed: the others that saw it complete step and go on
                    import os
                    import signal

                    os.kill(os.getpid(), signal.SIGKILL)
                if ctx.orig == 2:
                    raise PeerLost("injected: rank 2 sees step 2's sync fail")
            opt.step()
            opt.zero_grad()
    return losses


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--ranks", type=int, default=4)
    p.add_argument("--width", type=int, default=512)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--items", type=int, default=64, help="global batch (split over the ranks)")
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--repeats", type=int, default=3, help="runs per mode, the modes alternating")
    p.add_argument("--quick", action="store_true", help="a tiny model, one run per mode (a dry run)")
    p.add_argument("--json", type=Path)
    a = p.parse_args(argv)
    if a.ranks < 3:
        p.error("--ranks must be >= 3 (one dies, one sees the split, one is ahead)")
    if a.quick:
        a.width, a.layers, a.repeats = 16, 1, 1
    from steptune.core.dist import master_store
    from steptune.resilience.elastic import Elastic, launch

    base = {"width": a.width, "layers": a.layers, "items": a.items, "steps": a.steps}
    ref = train(Elastic(master_store(), 0, [0], timeout_s=5), {**base, "restore": "peer", "faults": False})
    runs: dict[str, list[dict[str, Any]]] = {m: [] for m in MODES}
    for r in range(a.repeats):
        for mode in MODES if r % 2 == 0 else MODES[::-1]:
            res = launch(train, a.ranks, {**base, "restore": mode, "faults": True}, timeout_s=300)
            recs = [rec for rank in res["survivors"] for rec in res["recoveries"][rank]]
            worst = max(
                abs(res["results"][k][s] - ref[s]) / abs(ref[s]) for k in res["survivors"] for s in ref
            )
            runs[mode].append({
                "survivors": res["survivors"], "wall_s": res["wall_s"],
                "recovery_s": max(rec["seconds"] for rec in recs),
                "resume_steps": sorted({rec["resume_step"] for rec in recs}),
                "state_from": sorted({rec["state_from"] for rec in recs}, key=str),
                "max_loss_rel_diff": worst,
            })  # fmt: skip
    params = a.layers * (2 * 4 * a.width * a.width + 5 * a.width)  # two Linear layers a block
    out = {"config": {**base, "ranks": a.ranks, "repeats": a.repeats, "params": params}, "runs": runs,
           "median_recovery_s": {m: statistics.median(x["recovery_s"] for x in runs[m]) for m in MODES},
           "median_wall_s": {m: statistics.median(x["wall_s"] for x in runs[m]) for m in MODES}}  # fmt: skip
    worst = {m: max(x["max_loss_rel_diff"] for x in runs[m]) for m in MODES}
    out["max_loss_rel_diff"] = worst
    for m in MODES:
        last = runs[m][-1]
        print(
            f"{m:9s} recovery {out['median_recovery_s'][m]:6.2f} s (slowest survivor, median)  "
            f"wall {out['median_wall_s'][m]:6.1f} s  resumed at {last['resume_steps']} "
            f"state from {last['state_from']}  max loss diff {worst[m]:.1e}"
        )
    if a.json:
        a.json.parent.mkdir(parents=True, exist_ok=True)
        a.json.write_text(json.dumps(out, indent=1))
        print(f"wrote: {a.json}")
    return out


if __name__ == "__main__":
    sys.exit(0 if main() else 1)
