"""A small discrete-event engine: a virtual clock, processes, resources and queues.

Processes are generators that yield *waitables*: ``env.timeout(dt)``, ``resource.request()``,
``queue.get()``, another ``Process`` (join) or ``env.all_of([...])``. Ties are broken by
``(time, priority, insertion order)`` so a simulation is deterministic for the same inputs.

Contract: the engine owns the clock; callers never advance ``now`` themselves. A generator that
raises stops the run and the exception propagates from ``Environment.run`` with the process name.
"""

from __future__ import annotations

import heapq
import itertools
import math
from collections import deque
from collections.abc import Callable, Generator, Iterable
from typing import Any

__all__ = ["Environment", "Event", "Process", "Queue", "Resource", "SimulationError"]


class SimulationError(RuntimeError):
    """A process raised, or the simulation deadlocked with processes still waiting."""


class Event:
    """Something that happens once; processes that wait on it resume when it triggers."""

    __slots__ = ("_callbacks", "env", "processed", "triggered", "value")

    def __init__(self, env: Environment) -> None:
        self.env = env
        self.triggered = False  # succeed() was called; callbacks run when the clock gets there
        self.processed = False  # callbacks have run
        self.value: Any = None
        self._callbacks: list[Callable[[Event], None]] = []

    def succeed(self, value: Any = None, *, delay: float = 0.0, priority: int = 0) -> Event:
        if self.triggered:
            raise SimulationError("event triggered twice")
        self.triggered = True
        self.value = value
        self.env._schedule(delay, priority, self._fire)
        return self

    def _fire(self) -> None:
        self.processed = True
        callbacks, self._callbacks = self._callbacks, []
        for cb in callbacks:
            cb(self)

    def _add_callback(self, cb: Callable[[Event], None]) -> None:
        if self.processed:  # waiting on an event of the past resumes now, after queued work
            self.env._schedule(0.0, 0, lambda: cb(self))
        else:
            self._callbacks.append(cb)


ProcessGen = Generator[Event, Any, Any]


class Process(Event):
    """A running generator. It is itself an event that triggers with the generator's return value."""

    __slots__ = ("_gen", "name")

    def __init__(self, env: Environment, gen: ProcessGen, name: str) -> None:
        super().__init__(env)
        self._gen = gen
        self.name = name
        env._live.add(self)
        env._schedule(0.0, 0, lambda: self._resume(None))

    def _resume(self, value: Any) -> None:
        try:
            target = self._gen.send(value)
        except StopIteration as stop:
            self.env._live.discard(self)
            self.succeed(stop.value)
            return
        except Exception as exc:
            raise SimulationError(f"process {self.name!r} raised at t={self.env.now:.6g}: {exc!r}") from exc
        if not isinstance(target, Event):
            raise SimulationError(f"process {self.name!r} yielded {target!r}; yield an Event")
        target._add_callback(lambda ev: self._resume(ev.value))


class Environment:
    """The virtual clock and the event queue."""

    def __init__(self, *, start: float = 0.0) -> None:
        if not math.isfinite(start):
            raise ValueError(f"Environment(start={start}): the clock starts at a finite time")
        self.now = start
        self._heap: list[tuple[float, int, int, Callable[[], None]]] = []
        self._seq = itertools.count()
        self._live: set[Process] = set()

    def _schedule(self, delay: float, priority: int, fn: Callable[[], None]) -> None:
        if not 0 <= delay < math.inf:  # NaN too: the clock would become NaN, then run backwards
            raise SimulationError(f"delay {delay}: must be finite and >= 0")
        heapq.heappush(self._heap, (self.now + delay, priority, next(self._seq), fn))

    def event(self) -> Event:
        return Event(self)

    def timeout(self, delay: float, value: Any = None) -> Event:
        if not 0 <= delay < math.inf:
            raise ValueError(f"timeout delay must be finite and >= 0, got {delay}")
        return Event(self).succeed(value, delay=delay)

    def process(self, gen: ProcessGen, *, name: str = "process") -> Process:
        return Process(self, gen, name)

    def all_of(self, events: Iterable[Event]) -> Event:
        """An event that triggers when every one of ``events`` has, with their values as a list."""
        events = list(events)
        done = Event(self)
        remaining = [len(events)]
        if not events:
            return done.succeed([])

        def one(_: Event) -> None:
            remaining[0] -= 1
            if remaining[0] == 0:
                done.succeed([e.value for e in events])

        for e in events:
            e._add_callback(one)
        return done

    def call_at(self, time: float, fn: Callable[[], None], *, priority: int = 0) -> None:
        if not self.now <= time < math.inf:
            raise ValueError(f"call_at({time}): must be finite and not in the past (now={self.now})")
        self._schedule(time - self.now, priority, fn)

    def run(self, until: float | None = None) -> float:
        """Run until no event is left (or the clock passes ``until``); return the final time.

        Raises ``SimulationError`` if processes are still waiting when nothing else can happen.
        """
        if until is not None and not self.now <= until:  # NaN too
            raise ValueError(f"run(until={until}): the clock is at {self.now} and does not run backwards")
        while self._heap:
            t, _, _, fn = self._heap[0]
            if until is not None and t > until:
                self.now = until
                return self.now
            heapq.heappop(self._heap)
            self.now = t
            fn()
        if until is None and self._live:
            names = sorted(p.name for p in self._live)
            raise SimulationError(f"deadlock: {len(names)} process(es) still waiting: {', '.join(names[:8])}")
        return self.now


class Resource:
    """``capacity`` identical servers with a FIFO wait queue (a stream, a link, a GPU)."""

    def __init__(self, env: Environment, *, capacity: int = 1, name: str = "resource") -> None:
        if capacity < 1:
            raise ValueError(f"capacity must be >= 1, got {capacity}")
        self.env = env
        self.capacity = capacity
        self.name = name
        self.in_use = 0
        self._waiters: deque[Event] = deque()
        self.busy_time = 0.0
        self._last = env.now

    def _account(self) -> None:
        self.busy_time += self.in_use * (self.env.now - self._last)
        self._last = self.env.now

    def request(self) -> Event:
        ev = Event(self.env)
        if self.in_use < self.capacity:
            self._account()
            self.in_use += 1
            ev.succeed()
        else:
            self._waiters.append(ev)
        return ev

    def release(self) -> None:
        if self.in_use == 0:
            raise SimulationError(f"release of {self.name!r} without a request")
        self._account()
        if self._waiters:
            self._waiters.popleft().succeed()  # hand the server over directly
        else:
            self.in_use -= 1

    def use(self, duration: float) -> ProcessGen:
        """``yield from resource.use(dt)``: acquire, hold for ``dt``, release."""
        yield self.request()
        yield self.env.timeout(duration)
        self.release()

    def utilization(self) -> float:
        self._account()
        return self.busy_time / (self.capacity * self.env.now) if self.env.now > 0 else 0.0


class Queue:
    """An unbounded FIFO of items; ``get`` waits while it is empty."""

    def __init__(self, env: Environment, *, name: str = "queue") -> None:
        self.env = env
        self.name = name
        self._items: deque[Any] = deque()
        self._getters: deque[Event] = deque()

    def __len__(self) -> int:
        return len(self._items)

    def put(self, item: Any) -> None:
        if self._getters:
            self._getters.popleft().succeed(item)
        else:
            self._items.append(item)

    def get(self) -> Event:
        ev = Event(self.env)
        if self._items:
            ev.succeed(self._items.popleft())
        else:
            self._getters.append(ev)
        return ev
