"""Ranks as threads of one process, each with its own real gloo group on a ``TCPStore(port=0)``.

A rank that raises drops its group, so peers blocked in a collective fail within milliseconds;
the harness then raises ``RankFailure`` carrying the *first* failing rank's traceback (the
peers' "connection closed" errors are consequences, not causes). A world that is still running
at the deadline is aborted and reported as ``TimeoutError`` naming the stuck ranks.
"""

from __future__ import annotations

import datetime
import gc
import itertools
import threading
import time
import traceback
from collections.abc import Callable
from typing import Any

from steptune.core.dist import abort_group, connect_store, master_store, new_gloo_group

__all__ = ["RankFailure", "run_threads"]

_world_ids = itertools.count()


class RankFailure(RuntimeError):
    """A rank raised; ``rank`` is the first one that did, ``remote_traceback`` its traceback."""

    def __init__(self, rank: int, remote_traceback: str) -> None:
        super().__init__(f"rank {rank} failed:\n{remote_traceback}")
        self.rank = rank
        self.remote_traceback = remote_traceback


def run_threads(
    fn: Callable[..., Any],
    world_size: int,
    *args: Any,
    timeout: float = 30.0,
    group_timeout: float | None = None,
) -> list[Any]:
    """Run ``fn(rank, group, *args)`` on ``world_size`` thread ranks; return the results by rank."""
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    store = master_store()
    prefix = f"threads{next(_world_ids)}"
    pg_timeout = datetime.timedelta(seconds=group_timeout or timeout)
    results: list[Any] = [None] * world_size
    groups: list[Any] = [None] * world_size
    failures: list[tuple[float, int, str]] = []
    lock = threading.Lock()

    def body(rank: int) -> None:
        try:
            groups[rank] = new_gloo_group(
                connect_store(store.port), rank, world_size, prefix=prefix, timeout=pg_timeout
            )
            results[rank] = fn(rank, groups[rank], *args)
            return
        except BaseException:
            tb = traceback.format_exc()
        with lock:
            failures.append((time.monotonic(), rank, tb))
        # Dropping the last reference destroys the group and closes its sockets: peers blocked on
        # this rank fail within milliseconds. (abort() alone leaves the sockets open.)
        group, groups[rank] = groups[rank], None
        if group is not None:
            abort_group(group)
        del group
        # If anything still holds the group in a reference cycle (a traceback frame), it would only close
        # its sockets at some later GC pass: peers then waited out the 5 s grace period (seen twice in
        # full-suite runs). Collect now so the sockets close within milliseconds.
        gc.collect()

    threads = [
        threading.Thread(target=body, args=(r,), name=f"rank{r}", daemon=True) for r in range(world_size)
    ]
    for t in threads:
        t.start()
    deadline = time.monotonic() + timeout
    first_failure_at: float | None = None
    while any(t.is_alive() for t in threads):
        now = time.monotonic()
        if failures and first_failure_at is None:
            first_failure_at = now
        # After a failure, peers get a short grace period to unwind, then we stop waiting.
        if now > deadline or (first_failure_at is not None and now - first_failure_at > 5.0):
            break
        for t in threads:
            t.join(0.01)
    stuck = [r for r, t in enumerate(threads) if t.is_alive()]
    if stuck:
        for g in groups:
            if g is not None:
                abort_group(g)
    if failures:
        _, rank, tb = min(failures)
        raise RankFailure(rank, tb)
    if stuck:
        raise TimeoutError(
            f"ranks {stuck} of {world_size} still running after {timeout:g} s (aborted; a rank blocked in a "
            "collective may only be waiting for a stuck peer, and a thread that never returns to torch keeps "
            "running: Python cannot stop it)"
        )
    return results
