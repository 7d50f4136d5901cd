"""Virtual time for asyncio: the same orchestration code runs in real time and in simulation.

Contract: `VirtualTimeLoop` is a normal asyncio event loop whose `time()` is virtual. Its selector never
blocks: when nothing is ready it advances virtual time straight to the next scheduled timer, so
`asyncio.sleep`, `wait_for`, queues, events, tasks and cancellation all behave as in real time, only
instantly. It must not be used for real I/O (sockets, subprocesses): in simulation every service (LLM,
evaluation) is itself a coroutine that sleeps for its modelled duration. If nothing is scheduled and
nothing is ready, the program is deadlocked; the loop raises instead of hanging.

`run(coro, virtual=True)` runs a coroutine on a fresh loop of either kind; code reads the time with
`now()` (the running loop's clock) in both modes.
"""

from __future__ import annotations

import asyncio
import selectors
from collections.abc import Coroutine
from typing import Any, TypeVar

__all__ = ["VirtualTimeLoop", "now", "run"]

T = TypeVar("T")


class _VirtualSelector(selectors.DefaultSelector):
    def __init__(self) -> None:
        super().__init__()
        self.now = 0.0

    def select(self, timeout: float | None = None) -> list[tuple[selectors.SelectorKey, int]]:
        ready = super().select(0)  # the loop's self-pipe (call_soon_threadsafe) still works
        if ready:
            return ready
        if timeout is None:
            raise RuntimeError("virtual-time deadlock: no timer is scheduled and nothing is ready")
        if timeout > 0:
            self.now += timeout
        return []


class VirtualTimeLoop(asyncio.SelectorEventLoop):
    """An event loop on virtual time (starts at 0.0 s)."""

    def __init__(self) -> None:
        self._vsel = _VirtualSelector()
        super().__init__(self._vsel)

    def time(self) -> float:
        return self._vsel.now


def now() -> float:
    """Seconds on the running loop's clock (virtual in simulation, monotonic in real mode)."""
    return asyncio.get_running_loop().time()


def run(coro: Coroutine[Any, Any, T], *, virtual: bool) -> T:
    """Run `coro` to completion on a fresh loop: virtual time or real time."""
    if not virtual:
        return asyncio.run(coro)
    loop = VirtualTimeLoop()
    try:
        return loop.run_until_complete(coro)
    finally:
        # as asyncio.run does: cancel what is left (simulated services, stray forks), then close
        pending = [t for t in asyncio.all_tasks(loop) if not t.done()]
        for t in pending:
            t.cancel()
        if pending:
            loop.run_until_complete(asyncio.gather(*pending, return_exceptions=True))
        loop.run_until_complete(loop.shutdown_asyncgens())
        loop.close()
