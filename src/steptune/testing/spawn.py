"""A pool of spawned worker processes with one persistent gloo group, reused across tests.

Spawning costs seconds per rank on a small machine (each process imports torch), so a pool is
created once per module or session and each ``run`` only sends a function and its arguments.
When any rank fails or the deadline passes, the pool kills its workers and raises; the next
``run`` spawns a fresh world (a collective that failed leaves a group unusable).

Functions must be top-level in an importable module (spawned workers re-import it).
"""

from __future__ import annotations

import datetime
import itertools
import math
import os
import queue
import time
import traceback
from collections.abc import Callable
from typing import Any

from steptune.core.dist import (
    abort_group,
    cannot_pickle,
    connect_store,
    init_default_group,
    master_store,
    new_gloo_group,
    start_context,
)
from steptune.testing.threads import RankFailure

__all__ = ["SpawnPool"]


def _worker(
    rank: int,
    world_size: int,
    port: int,
    prefix: str,
    group_timeout: float,
    tasks: Any,
    results: Any,
    default_group: bool = False,
) -> None:
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    import torch

    torch.set_num_threads(1)
    try:
        timeout = datetime.timedelta(seconds=group_timeout)
        if default_group:
            # For code that needs torch's registered default group (torch.distributed.pipelining maps
            # group ranks through it): one process per rank, loopback only.
            import torch.distributed as dist

            os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
            store = dist.PrefixStore(prefix, connect_store(port))  # type: ignore[attr-defined]
            group: Any = init_default_group(store=store, rank=rank, world_size=world_size, timeout=timeout)
        else:
            group = new_gloo_group(connect_store(port), rank, world_size, prefix=prefix, timeout=timeout)
    except BaseException:
        results.put((-1, rank, False, traceback.format_exc()))
        return
    while True:
        task = tasks.get()
        if task is None:
            break
        task_id, fn, args = task
        try:
            value = fn(rank, group, *args)
            why = cannot_pickle(value)
            if why:
                raise TypeError(f"rank {rank}'s result {type(value).__name__} cannot be sent back: {why}")
            results.put((task_id, rank, True, value))
        except BaseException:
            results.put((task_id, rank, False, traceback.format_exc()))
            abort_group(group)
            return  # this world is broken; the parent respawns


class SpawnPool:
    """``world_size`` spawned ranks; ``run(fn, *args)`` returns ``fn(rank, group, *args)`` by rank."""

    _ids = itertools.count()

    def __init__(
        self,
        world_size: int,
        *,
        timeout: float = 60.0,
        group_timeout: float = 30.0,
        default_group: bool = False,
    ) -> None:
        if not 1 <= world_size <= 8:
            raise ValueError(f"world_size must be in [1, 8] on a small machine, got {world_size}")
        self.world_size = world_size
        self.timeout = timeout
        self.group_timeout = group_timeout
        self.default_group = default_group
        """Workers call ``init_process_group`` and get ``group.WORLD`` (for torch APIs that need it)."""
        self._ctx = start_context(preload=["torch", "steptune.testing.spawn"])
        self._procs: list[Any] = []
        self._tasks: list[Any] = []
        self._results: Any = None
        self._store: Any = None
        self._task_ids = itertools.count()
        self.num_spawns = 0

    close_grace_s = 5.0
    """How long ``close`` waits for the ranks to leave, all together, before killing them."""

    def __enter__(self) -> SpawnPool:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, *exc: object) -> None:
        if exc_type is not None and issubclass(exc_type, KeyboardInterrupt | SystemExit):
            self._kill()  # Ctrl-C or SIGTERM: busy ranks would not see the stop request; end them now
        else:
            self.close()

    def _start(self) -> None:
        self._store = master_store()
        prefix = f"pool{os.getpid()}-{next(self._ids)}"
        self._results = self._ctx.Queue()
        self._tasks = [self._ctx.Queue() for _ in range(self.world_size)]
        self._procs = [
            self._ctx.Process(
                target=_worker,
                name=f"steptune-rank{r}",
                daemon=True,
                args=(
                    r,
                    self.world_size,
                    self._store.port,
                    prefix,
                    self.group_timeout,
                    self._tasks[r],
                    self._results,
                    self.default_group,
                ),
            )
            for r in range(self.world_size)
        ]
        for p in self._procs:
            p.start()
        self.num_spawns += 1

    def _kill(self) -> None:
        for p in self._procs:
            if p.is_alive():
                p.kill()
        for p in self._procs:
            p.join(5)
        self._procs, self._tasks, self._results, self._store = [], [], None, None

    def close(self) -> None:
        for q in self._tasks:
            q.put(None)
        deadline = time.monotonic() + self.close_grace_s  # for all ranks together (was 5 s each, in turn)
        for p in self._procs:
            p.join(max(0.0, deadline - time.monotonic()))
        self._kill()

    def run(self, fn: Callable[..., Any], *args: Any, timeout: float | None = None) -> list[Any]:
        if not self._procs or not all(p.is_alive() for p in self._procs):
            self._kill()
            self._start()
        why = cannot_pickle((fn, args))  # else only a timeout would show it
        if why:
            raise TypeError(
                f"SpawnPool.run({getattr(fn, '__qualname__', fn)!r}, ...): the function and its arguments "
                f"must pickle (a top-level function of an importable module): {why}"
            )
        task_id = next(self._task_ids)
        for q in self._tasks:
            q.put((task_id, fn, args))
        out: list[Any] = [None] * self.world_size
        pending = set(range(self.world_size))
        deadline = time.monotonic() + (timeout or self.timeout)
        first_error: tuple[int, str] | None = None  # the first traceback, and when it arrived
        raised_at = math.inf
        dead_at: dict[int, float] = {}  # when each rank was first seen dead before it answered

        def look(now: float) -> None:
            for r in pending:
                if r not in dead_at and not self._procs[r].is_alive():
                    dead_at[r] = now

        while pending:
            now = time.monotonic()
            look(now)
            trouble_at = min([raised_at, *dead_at.values()])  # a traceback or a death starts a 5 s grace
            all_gone = all(r in dead_at for r in pending)  # their last answers get 0.5 s to arrive
            if now > deadline or now - trouble_at > (0.5 if all_gone else 5.0):
                break
            try:
                tid, rank, ok, value = self._results.get(timeout=0.1)
            except queue.Empty:
                continue
            if tid not in (task_id, -1):
                continue  # a late reply to an earlier, failed task
            pending.discard(rank)
            if ok:
                out[rank] = value
            elif first_error is None:
                first_error, raised_at = (rank, value), time.monotonic()
                look(raised_at)  # a peer already dead when this traceback arrived caused it
        look(time.monotonic())
        # A rank whose process died without answering (os._exit, a signal, a segfault) before the first
        # traceback arrived is the likelier culprit: its peers' errors ("Connection closed by peer") come from
        # its death. One that died after a traceback is reported beside it.
        crashed = sorted((dead_at[r], r) for r in pending if r in dead_at)
        if crashed:
            when, r = crashed[0]
            death = f"process exited with code {self._procs[r].exitcode} without answering"
            if first_error is None:
                first_error = (r, death)
            elif when > raised_at:
                first_error = (first_error[0], f"{first_error[1]}\n(then rank {r}'s {death})")
            else:
                first_error = (r, f"{death}\nthen rank {first_error[0]} failed:\n{first_error[1]}")
        if first_error is not None or pending:
            self._kill()
            if first_error is not None:
                raise RankFailure(*first_error)
            raise TimeoutError(
                f"ranks {sorted(pending)} of {self.world_size} did not answer within "
                f"{timeout or self.timeout:g} s (pool killed)"
            )
        return out
