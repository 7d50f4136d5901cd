"""One host agent of a two-host ``elastic`` job, for the tests that cut, heal or stop a host from
outside (``test_elastic_host_faults.py``):
``python two_hosts_agent.py NODE_RANK MASTER HOST|auto STEPS MARK_PATH``. Each step sleeps 0.2 s, so
the fault lands mid-run; rank 0 creates MARK_PATH once it reaches step 3. Prints one JSON line: the
survivors, lost ranks, and this host's first rank's losses and recoveries, or the error it raised."""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import Any

import torch
from torch import nn

from steptune.resilience.elastic import Elastic, launch, toy_train


class _Paced:
    """``ctx`` with a 0.2 s sleep before each sync (so that a fault made from outside lands mid-run), and
    rank 0 creating ``mark`` once it reaches step 3."""

    def __init__(self, ctx: Elastic, mark: str) -> None:
        self._ctx, self._mark = ctx, mark

    def __getattr__(self, name: str) -> Any:
        return getattr(self._ctx, name)

    def sync(self, model: nn.Module, loss: torch.Tensor) -> float:
        if self._ctx.orig == 0 and self._ctx.step == 3:
            Path(self._mark).touch()
        time.sleep(0.2)
        return self._ctx.sync(model, loss)


def train(ctx: Elastic, steps: int, mark: str) -> dict[int, float]:
    """``toy_train``'s loop (whose failure-free losses the tests compare with), paced."""
    return toy_train(_Paced(ctx, mark), steps)  # type: ignore[arg-type]


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
