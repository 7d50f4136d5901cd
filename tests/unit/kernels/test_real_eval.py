"""RealEval's bridge from the pool's threads to the search's event loop."""

from __future__ import annotations

import asyncio
import logging
from concurrent.futures import Future
from types import SimpleNamespace

import pytest

from steptune.kernels.real import RealEval


class _Pool:
    config = SimpleNamespace(num_workers=1)

    def __init__(self) -> None:
        self.futures: list[Future] = []

    def submit(self, problem, code, *, kind, priority):
        f: Future = Future()
        self.futures.append(f)
        return f


def _result() -> SimpleNamespace:
    return SimpleNamespace(verdict="correct", speedup=1.5, reason="", wall_s=0.1, extra={})


def test_result_reaches_the_waiting_search() -> None:
    pool = _Pool()
    ev = RealEval(pool, SimpleNamespace(name="p"))  # type: ignore[arg-type]

    async def go() -> object:
        out = ev.submit(SimpleNamespace(code="x"), "validate", 0)  # type: ignore[arg-type]
        pool.futures[0].set_result(_result())
        return await asyncio.wait_for(out, 5)

    outcome = asyncio.run(go())
    assert outcome.verdict == "correct" and outcome.speedup == 1.5  # type: ignore[attr-defined]


def test_a_result_after_the_loop_closed_is_dropped_quietly(caplog: pytest.LogCaptureFixture) -> None:
    pool = _Pool()
    ev = RealEval(pool, SimpleNamespace(name="p"))  # type: ignore[arg-type]

    async def go() -> None:
        ev.submit(SimpleNamespace(code="x"), "validate", 0)  # type: ignore[arg-type]

    asyncio.run(go())  # the search ends with the evaluation still running
    with caplog.at_level(logging.ERROR, logger="concurrent.futures"):
        pool.futures[0].set_result(_result())
    assert not [r for r in caplog.records if "exception calling callback" in r.getMessage()]
