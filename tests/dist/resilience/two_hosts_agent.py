"""One host agent of a two-host ``elastic`` job, for the tests that cut, heal or stop a host from
outside (``test_elastic_netns.py``, ``test_elastic_nodes.py``):
``python two_hosts_agent.py NODE_RANK MASTER HOST|auto STEPS MARK_PATH``. Each step sleeps 0.2 s, so
the fault lands mid-run; rank 0 creates MARK_PATH once it reaches step 3. Prints one JSON line: the
survivors, lost ranks, and this host's first rank's losses and recoveries, or the error it raised."""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import torch
from torch import nn

from steptune.resilience.elastic import Elastic, launch


def train(ctx: Elastic, steps: int, mark: str | None) -> dict[int, float]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 1))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    ctx.track(model, opt)
    losses: dict[int, float] = {}
    while ctx.step < steps:
        with ctx.attempt():
            g = torch.Generator().manual_seed(ctx.step)
            x = torch.randn(24, 16, generator=g)
            y = torch.sin(x.sum(1, keepdim=True))
            mine = list(ctx.shard(len(x)))
            loss = ((model(x[mine]) - y[mine]) ** 2).sum() / len(x)
            loss.backward()
            if mark is not None and ctx.orig == 0 and ctx.step == 3:
                Path(mark).touch()
            if mark is not None:
                time.sleep(0.2)
            losses[ctx.step] = ctx.sync(model, loss)
            opt.step()
            opt.zero_grad()
    return losses


def main() -> None:
    node, master, host, steps, mark = sys.argv[1:6]
    t0 = time.monotonic()
    try:
        res = launch(
            train, 2, int(steps), mark, nnodes=2, node_rank=int(node), master=master,
            host=None if host == "auto" else host, group_timeout_s=8.0, node_timeout_s=2.0, timeout_s=150.0,
        )  # fmt: skip
    except Exception as err:
        print(json.dumps({"error": f"{type(err).__name__}: {err}", "after_s": time.monotonic() - t0}))
        sys.exit(1)
    first = min(res["results"])
    print(json.dumps({"survivors": res["survivors"], "lost": res["lost"], "losses": res["results"][first],
                      "recoveries": res["recoveries"][first]}))  # fmt: skip


if __name__ == "__main__":
    main()
