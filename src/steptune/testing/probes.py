"""Small rank functions used to check a multi-rank setup (and by the harness's own tests).

They live in a light, importable module because spawned workers re-import the module that
defines the function they run.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from steptune.core.dist import recv, send

__all__ = ["all_reduce_sum", "raise_on", "registered_ring", "ring_send_recv", "sleep_on", "whoami"]


def whoami(rank: int, group: Any) -> tuple[int, int]:
    return rank, group.size()


def all_reduce_sum(rank: int, group: Any, n: int = 4) -> list[float]:
    t = torch.full((n,), float(rank + 1))
    dist.all_reduce(t, group=group)
    return t.tolist()


def ring_send_recv(rank: int, group: Any) -> float:
    """Each rank sends its rank to the next one and returns what it received from the previous."""
    world = group.size()
    out = torch.tensor([float(rank)])
    got = torch.zeros(1)
    nxt, prv = (rank + 1) % world, (rank - 1) % world
    # Even ranks send first, odd ranks receive first: no deadlock with blocking P2P.
    if rank % 2 == 0:
        send(out, nxt, group)
        recv(got, prv, group)
    else:
        recv(got, prv, group)
        send(out, nxt, group)
    return float(got.item())


def raise_on(rank: int, group: Any, bad_rank: int = 1) -> list[float]:
    """``bad_rank`` raises before the collective; the others block in it until the group aborts."""
    if rank == bad_rank:
        raise ValueError(f"injected failure on rank {rank}")
    return all_reduce_sum(rank, group)


def sleep_on(rank: int, group: Any, bad_rank: int = 1, seconds: float = 60.0) -> int:
    """``bad_rank`` hangs (a dead-slow peer); the harness must time out, not wait forever."""
    import time

    if rank == bad_rank:
        time.sleep(seconds)
    return rank


def registered_ring(rank: int, group: Any) -> float:
    """P2P through torch.distributed, which needs a registered group (SpawnPool(default_group=True))."""
    world = group.size()
    got = torch.zeros(1)
    ops = [
        dist.P2POp(dist.isend, torch.tensor([float(rank)]), (rank + 1) % world, group),
        dist.P2POp(dist.irecv, got, (rank - 1) % world, group),
    ]
    for work in dist.batch_isend_irecv(ops):
        work.wait()
    return float(got.item())


def exit_on(rank: int, group: Any, bad_rank: int = 1, code: int = 3) -> list[float]:
    """``bad_rank``'s process dies without a word (``os._exit``) while the others wait in a collective;
    the harness must blame it, not the peer whose collective then fails."""
    import os
    import time

    if rank == bad_rank:
        time.sleep(0.5)
        os._exit(code)
    return all_reduce_sum(rank, group)


def unpicklable_result(rank: int, group: Any) -> Any:
    """Returns what cannot be sent back to the parent (a lambda)."""
    return lambda: rank


def raise_then_die(rank: int, group: Any) -> int:
    """Rank 0 raises at once; rank 1's process dies 0.5 s later (a knock-on abort): the harness must blame
    rank 0, whose traceback came first, and mention rank 1's death beside it."""
    import os
    import time

    if rank == 0:
        raise ValueError("injected failure on rank 0")
    time.sleep(0.5)
    os._exit(6)
