"""Fail-stop survival in your own data-parallel loop: SIGKILL a rank mid-step and watch the others go on.

    python examples/elastic_dp.py --ranks 4 --steps 20 --kill 2:7

Each rank trains the same small regression MLP on its share of every step's global batch; the rank named
by --kill dies in that step. The survivors rejoin, redo the step among themselves, and end with the
losses of a failure-free single-process run (printed side by side). See steptune.resilience.elastic.

Across hosts (here two "hosts" on one machine; --ranks is per host, and --kill-host R:S makes rank R kill
its host agent in step S, so the whole host is lost):

    python examples/elastic_dp.py --nnodes 2 --node-rank 0 --master file:/tmp/rdzv --ranks 2 --kill-host 2:5 &
    python examples/elastic_dp.py --nnodes 2 --node-rank 1 --master file:/tmp/rdzv --ranks 2 --kill-host 2:5
"""

from __future__ import annotations

import argparse
import os
import signal
import time

import torch
from torch import nn

from steptune.core.argtypes import positive_int
from steptune.resilience.elastic import Elastic, launch, lost_reason, recovery_text


def train(
    ctx: Elastic, steps: int, kill: tuple[int, int] | None, kill_host: tuple[int, int] | None = None,
    ddp: bool = False,
) -> dict[int, float]:  # fmt: skip
    torch.manual_seed(0)  # every rank builds the same model
    model = nn.Sequential(nn.Linear(16, 64), nn.GELU(), nn.Linear(64, 1))
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    ctx.track(model, opt)  # what a recovery restores (from a peer that holds it)
    # With --ddp: torch's DistributedDataParallel over the survivors, summing (not averaging) gradients
    # in the backward, so the loss below (scaled by the global batch) gives the same update as ctx.sync.
    net = ctx.ddp(model, average=False) if ddp else model
    losses: dict[int, float] = {}
    while ctx.step < steps:
        with ctx.attempt():  # a peer's death abandons the step here; the next attempt rejoins and redoes it
            g = torch.Generator().manual_seed(ctx.step)  # the step's global batch, the same on every rank
            x = torch.randn(64, 16, generator=g)
            y = torch.sin(x.sum(1, keepdim=True))
            mine = list(ctx.shard(len(x)))  # this rank's share among the current survivors
            loss = ((net(x[mine]) - y[mine]) ** 2).sum() / len(x)  # scaled by the global batch
            if kill == (
                ctx.orig,
                ctx.step,
            ):  # mid-step: the others' all-reduce (DDP's backward, or sync) fails
                os.kill(os.getpid(), signal.SIGKILL)
            loss.backward()
            if kill_host == (ctx.orig, ctx.step):  # the host agent; its ranks die with it
                os.kill(os.getppid(), signal.SIGKILL)
                time.sleep(60)
            if ddp:  # the gradients were summed in the backward: only the loss, for the log
                losses[ctx.step] = float(ctx.all_reduce(loss.detach().reshape(1).clone()))
            else:
                losses[ctx.step] = ctx.sync(model, loss)  # SUM of gradients and loss over the survivors
            opt.step()
            opt.zero_grad()
    return losses


def _rank_step(text: str) -> tuple[int, int] | None:
    """RANK:STEP (two non-negative integers), or 'none'."""
    if text == "none":
        return None
    parts = text.split(":")
    if len(parts) != 2 or not all(p.isdigit() for p in parts):
        raise argparse.ArgumentTypeError(f"expected RANK:STEP such as 2:7, or 'none'; got {text!r}")
    return int(parts[0]), int(parts[1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--ranks", type=positive_int, default=4, help="processes to spawn (default 4)")
    ap.add_argument("--steps", type=positive_int, default=20, help="training steps (default 20)")
    ap.add_argument(
        "--kill", type=_rank_step, default="2:7", help="RANK:STEP to SIGKILL, or 'none' (default 2:7)"
    )
    ap.add_argument("--nnodes", type=positive_int, default=1, help="hosts in the job (default 1)")
    ap.add_argument("--node-rank", type=int, default=0, help="this host's index (default 0)")
    ap.add_argument("--master", default=None, help="HOST:PORT of node 0, or file:PATH (with --nnodes > 1)")
    ap.add_argument("--host", default="127.0.0.1", help="this host's address for gloo (default 127.0.0.1)")
    ap.add_argument(
        "--kill-host", type=_rank_step, default="none", help="RANK:STEP: that rank kills its host agent"
    )
    ap.add_argument(
        "--ddp", action="store_true", help="train under ctx.ddp (torch's DDP) instead of ctx.sync"
    )
    ap.add_argument(
        "--node-timeout", type=float, default=5.0, help="silent seconds that lose a host (default 5)"
    )
    args = ap.parse_args()
    kill, kill_host = args.kill, args.kill_host
    world = args.ranks * args.nnodes
    for flag, value in (("--kill", kill), ("--kill-host", kill_host)):
        if value is not None and (value[0] >= world or value[1] >= args.steps):
            ap.error(
                f"{flag} {value[0]}:{value[1]}: the job has ranks 0-{world - 1} and steps "
                f"0-{args.steps - 1}, so it would never fire"
            )
    if not 0 <= args.node_rank < args.nnodes:
        ap.error(f"--node-rank {args.node_rank}: the hosts are 0..{args.nnodes - 1} (--nnodes {args.nnodes})")
    if args.nnodes > 1 and not args.master:
        ap.error(
            "--nnodes > 1 needs --master: HOST:PORT of node 0, or file:PATH on a filesystem every host sees"
        )
    if kill_host is not None and args.nnodes == 1:
        ap.error("--kill-host kills a host agent: it needs --nnodes > 1")
    ref = launch(train, 1, args.steps, None)["results"][0]
    nodes = {"nnodes": args.nnodes, "node_rank": args.node_rank, "master": args.master, "host": args.host,
             "node_timeout_s": args.node_timeout}  # fmt: skip
    res = launch(train, args.ranks, args.steps, kill, kill_host, args.ddp, **nodes)
    if not res["results"]:
        print(f"no rank of this host survived; survivors {res['survivors']}")
        return
    first = min(res["results"])  # this host's first finished rank
    for rank, code in res["lost"].items():
        print(f"rank {rank} lost ({lost_reason(code)})")
    for rec in res["recoveries"][first]:
        print(recovery_text(rec))
    losses = res["results"][first]
    worst = max(abs(losses[k] - ref[k]) / abs(ref[k]) for k in ref)
    print(f"survivors {res['survivors']}: {len(losses)} of {args.steps} steps, losses vs the failure-free "
          f"single-process run: max relative difference {worst:.1e}; {res['wall_s']:.1f} s")  # fmt: skip


if __name__ == "__main__":
    main()
