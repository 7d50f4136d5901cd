"""What the search loop talks to: candidates, feedback, and the two services (LLM and evaluation).

Contract: the orchestrator (search.py) sees only these protocols. Real mode implements them over
`llm.LLMClient` and `pool.EvalPool` (real.py); simulation implements them as coroutines that sleep on the
virtual clock (sim.py). Both run on asyncio, so the same policy objects drive both lanes.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Protocol

__all__ = [
    "PROBLEM_ERROR",
    "Candidate",
    "Delta",
    "EvalOutcome",
    "EvalService",
    "Feedback",
    "Generation",
    "LLMService",
    "Prompt",
]

PROBLEM_ERROR = "problem error (not the candidate's): "
"""Starts the reason of a verdict the problem file caused (its import, get_inputs or reference failed, or the
reference is not deterministic): no candidate can pass, so the search stops and the CLI says to fix it."""


@dataclass(slots=True)
class Candidate:
    """A kernel proposed by the LLM: from the main trace's answer, a draft inside its reasoning, a fork, or
    one of several samples."""

    code: str
    origin: str
    """`final` (a main generation's answer), `draft` (code inside the reasoning), `fork`, `probe`."""
    iteration: int
    created_s: float
    key: str
    """Normalized hash: the same kernel proposed twice is evaluated once."""
    progress: float = 1.0
    """Fraction of its generation's reasoning written when it was proposed (1.0 for answers)."""


@dataclass(slots=True)
class EvalOutcome:
    verdict: str
    speedup: float | None = None
    reason: str = ""
    service_s: float = 0.0
    """Seconds a worker spent on it (for the allocator and utilization)."""


@dataclass(slots=True)
class Feedback:
    """One evaluated candidate, as the next prompt sees it."""

    candidate: Candidate
    verdict: str
    speedup: float | None
    reason: str
    at_s: float
    profiled: bool


@dataclass(slots=True)
class Prompt:
    """What an iteration's generations are conditioned on."""

    problem: str
    iteration: int
    feedback: list[Feedback] = field(default_factory=list)
    best_speedup: float | None = None


@dataclass(slots=True)
class Delta:
    kind: str
    """`reasoning` or `content`."""
    text: str
    tokens: int


class Generation(Protocol):
    """One streaming generation. Iterate once; `aclose` aborts it (the server sees the disconnect)."""

    reasoning: str
    content: str
    tokens: int
    aborted: bool

    def __aiter__(self) -> AsyncIterator[Delta]: ...

    async def aclose(self) -> None: ...


class LLMService(Protocol):
    async def reason(self, prompt: Prompt, stream_id: str) -> Generation:
        """Start a reasoning generation (thinking, then an answer with code)."""
        ...

    async def fork(
        self, prompt: Prompt, stream_id: str, reasoning_prefix: str, prefix_tokens: int
    ) -> Generation:
        """A non-reasoning generation conditioned on a partial reasoning trace of `stream_id`: it writes the
        code at once (its content is the code after an opening fence)."""
        ...


class EvalService(Protocol):
    num_workers: int

    def submit(self, candidate: Candidate, kind: str, priority: int) -> asyncio.Future[EvalOutcome]:
        """Queue a `validate` or `profile` request; higher priority runs first."""
        ...

    def set_roles(self, roles: list[str]) -> None: ...

    def busy_seconds(self) -> float:
        """Worker-seconds spent busy so far (for utilization)."""
        ...
