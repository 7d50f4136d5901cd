"""`steptune kernels optimize`: one search against a real OpenAI-compatible server and the sandboxed pool.

Contract: `optimize` runs `Search` with `RealLLM` (the server at `base_url`) and `RealEval` (a pool it
owns for the run) and returns the search report plus every evaluated candidate, best first (correct ones
still waiting for profiling when the search ended are there too, unprofiled). Nothing is lost: the caller
writes the best kernel and a JSON of all results.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import Any

from steptune.kernels.agent import Feedback
from steptune.kernels.pool import EvalPool, PoolConfig
from steptune.kernels.problems import Problem
from steptune.kernels.search import Search, SearchConfig, SearchReport

__all__ = ["OptimizeResult", "optimize"]


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


def _ranked(report: SearchReport, feedback: list[Feedback]) -> OptimizeResult:
    def key(f: Feedback) -> tuple[bool, bool, float, float]:
        correct = f.verdict == "correct"
        return (not (correct and f.speedup is not None), not correct, -(f.speedup or 0.0), f.at_s)

    return OptimizeResult(report, sorted(feedback, key=key))


async def _run(problem: Problem, base_url: str, model: str, config: SearchConfig, pool: EvalPool,
               api_key: str | None, progress: Any) -> tuple[SearchReport, list[Feedback]]:  # fmt: skip
    from steptune.kernels.llm import LLMClient
    from steptune.kernels.real import RealEval, RealLLM

    async with LLMClient(base_url, model, api_key=api_key) as client:
        llm = RealLLM(client, problem, forks=config.policy in ("specgen", "early_exit"))
        search = Search(llm, RealEval(pool, problem), config, problem=problem.name, progress=progress)
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
    with EvalPool(pool_config or PoolConfig(num_workers=2, roles=("validate", "profile"))) as pool:
        report, feedback = asyncio.run(_run(problem, base_url, model, config, pool, api_key, progress))
    return _ranked(report, feedback)
