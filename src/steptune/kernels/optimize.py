"""`steptune kernels optimize`: one search against a real OpenAI-compatible server and the sandboxed pool.

Contract: `optimize` runs `Search` with `RealLLM` (the server at `base_url`) and `RealEval` (a pool it
owns for the run) and returns the search report plus every evaluated candidate, best first (correct ones
still waiting for profiling when the search ended are there too, unprofiled). Nothing is lost: the caller
writes the best kernel and a JSON of all results. Ctrl-C or SIGTERM during the search raises
`OptimizeInterrupted` (a KeyboardInterrupt) carrying the result so far, its stop_reason `interrupted (...)`.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import Any

from steptune.kernels.agent import Feedback
from steptune.kernels.pool import EvalPool, PoolConfig
from steptune.kernels.problems import Problem
from steptune.kernels.search import Search, SearchConfig, SearchReport

__all__ = ["OptimizeInterrupted", "OptimizeResult", "optimize"]


@dataclass(slots=True)
class OptimizeResult:
    report: SearchReport
    feedback: list[Feedback]
    """Every evaluated candidate: the fastest correct one first, then the other correct ones (unprofiled, or
    with a speedup not credited), the rest."""

    @property
    def best(self) -> Feedback | None:
        """The fastest profiled correct candidate."""
        first = self.best_correct
        return first if first is not None and first.speedup is not None else None

    @property
    def best_correct(self) -> Feedback | None:
        """`best`, else the first correct candidate without a speedup (validated, not profiled in time)."""
        first = self.feedback[0] if self.feedback else None
        return first if first is not None and first.verdict == "correct" else None


class OptimizeInterrupted(KeyboardInterrupt):
    """Ctrl-C or SIGTERM stopped the search: `result` holds what it found; `__cause__` is the interrupt."""

    def __init__(self, result: OptimizeResult) -> None:
        super().__init__(result.report.stop_reason)
        self.result = result


def _ranked(report: SearchReport, feedback: list[Feedback]) -> OptimizeResult:
    def key(f: Feedback) -> tuple[bool, bool, float, float]:
        correct = f.verdict == "correct"
        return (not (correct and f.speedup is not None), not correct, -(f.speedup or 0.0), f.at_s)

    return OptimizeResult(report, sorted(feedback, key=key))


async def _run(problem: Problem, base_url: str, model: str, config: SearchConfig, pool: EvalPool,
               api_key: str | None, progress: Any,
               searches: list[Search]) -> tuple[SearchReport, list[Feedback]]:  # fmt: skip
    from steptune.kernels.llm import LLMClient
    from steptune.kernels.real import RealEval, RealLLM

    async with LLMClient(base_url, model, api_key=api_key) as client:
        llm = RealLLM(client, problem, forks=config.policy in ("specgen", "early_exit"))
        search = Search(llm, RealEval(pool, problem), config, problem=problem.name, progress=progress)
        searches.append(search)
        report = await search.run()
        return report, list(search.feedback)


def optimize(
    problem: Problem,
    *,
    base_url: str,
    model: str,
    config: SearchConfig,
    pool_config: PoolConfig | None = None,
    api_key: str | None = None,
    progress: Any = None,
) -> OptimizeResult:
    searches: list[Search] = []
    try:
        with EvalPool(pool_config or PoolConfig(num_workers=2, roles=("validate", "profile"))) as pool:
            report, feedback = asyncio.run(
                _run(problem, base_url, model, config, pool, api_key, progress, searches)
            )
    except (KeyboardInterrupt, SystemExit, asyncio.CancelledError) as exc:
        # Ctrl-C cancels asyncio.run's task (then KeyboardInterrupt), SIGTERM raises SystemExit (steptune's
        # CLI): either way the search kept its report; the pool has ended its sandboxes on the way out
        search = searches[0] if searches else None
        if search is None or search.report is None:
            raise
        if search.report.stop_reason == "interrupted":  # else it had ended, and the pool's exit was cut short
            what = {SystemExit: "SIGTERM", KeyboardInterrupt: "Ctrl-C"}.get(type(exc), type(exc).__name__)
            search.report.stop_reason = f"interrupted ({what})"
        raise OptimizeInterrupted(_ranked(search.report, list(search.feedback))) from exc
    return _ranked(report, feedback)
