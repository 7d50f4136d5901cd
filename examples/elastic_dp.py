"""Fail-stop survival in your own data-parallel loop: SIGKILL a rank mid-step and watch the others go on.

    python examples/elastic_dp.py --ranks 4 --steps 20 --kill 2:7

Each rank trains the same small regression MLP on its share of every step's global batch; the rank named
by --kill dies in that step. The survivors rejoin, redo the step among themselves, and end with the
losses of a failure-free single-process run (printed side by side). See steptune.resilience.elastic.
"""

from __future__ import annotations

import argparse
import os
import signal

import torch
from torch import nn

from steptune.resilience.elastic import Elastic, launch


def train(ctx: Elastic, steps: int, kill: tuple[int, int] | None) -> dict[int, float]:
    torch.manual_seed(0)  # every rank builds the same model
    model = nn.Sequential(nn.Linear(16, 64), nn.GELU(), nn.Linear(64, 1))
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    ctx.track(model, opt)  # snapshotted at every step's start
    losses: dict[int, float] = {}
    while ctx.step < steps:
        with ctx.attempt():  # a peer's death abandons the step here; the next attempt rejoins and redoes it
            g = torch.Generator().manual_seed(ctx.step)  # the step's global batch, the same on every rank
            x = torch.randn(64, 16, generator=g)
            y = torch.sin(x.sum(1, keepdim=True))
            mine = list(ctx.shard(len(x)))  # this rank's share among the current survivors
            loss = ((model(x[mine]) - y[mine]) ** 2).sum() / len(x)  # scaled by the global batch
            loss.backward()
            if kill == (ctx.orig, ctx.step):
                os.kill(os.getpid(), signal.SIGKILL)
            losses[ctx.step] = ctx.sync(model, loss)  # SUM of gradients and loss over the survivors
            opt.step()
            opt.zero_grad()
    return losses


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--ranks", type=int, default=4, help="processes to spawn (default 4)")
    ap.add_argument("--steps", type=int, default=20, help="training steps (default 20)")
    ap.add_argument("--kill", default="2:7", help="RANK:STEP to SIGKILL, or 'none' (default 2:7)")
    args = ap.parse_args()
    kill = None if args.kill == "none" else tuple(int(v) for v in args.kill.split(":"))
    ref = launch(train, 1, args.steps, None)["results"][0]
    res = launch(train, args.ranks, args.steps, kill)
    first = res["survivors"][0]
    for rank, code in res["lost"].items():
        print(f"rank {rank} lost ({'SIGKILL' if code == -9 else f'exit code {code}'})")
    for rec in res["recoveries"][first]:
        print(f"generation {rec['generation']}: failed in step {rec['failed_at_step']}, resumed at step "
              f"{rec['resume_step']} with ranks {rec['members']}")  # fmt: skip
    losses = res["results"][first]
    worst = max(abs(losses[k] - ref[k]) / abs(ref[k]) for k in ref)
    print(f"survivors {res['survivors']}: {len(losses)} of {args.steps} steps, losses vs the failure-free "
          f"single-process run: max relative difference {worst:.1e}; {res['wall_s']:.1f} s")  # fmt: skip


if __name__ == "__main__":
    main()
