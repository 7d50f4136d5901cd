"""When to stop: the termination criterion of one iteration's reasoning, and the budget of the whole search.

Contract: `Termination` sees the profiled results of one iteration in the order they arrive
(`observe(speedup, correct)`) and answers `continue`, `stop_iteration` (close the reasoning stream and its
forks: a good enough candidate is in hand) or `stop_search` (the target is reached: stop everything). A
result counts only if it is correct, its speedup is finite and positive, and it exceeds `min_speedup`;
anything else answers `continue` and does not advance the patience count. The improvement bar compares with
`best_before`, the best speedup known when the iteration started (not updated within the iteration); with
no `best_before` any counting result clears it. Decisions are sticky: after a stop, later results (forks
still in flight) get the same stop, or `stop_search` if one of them reaches the target. `start_iteration`
clears the iteration state, but not a `stop_search`.

`BudgetTracker` counts generated tokens (main stream, forks and probes alike: the caller adds them all) and
iterations against a `Budget`, and says which budget, if any, is spent. Time is passed in as `now` (any
monotonic clock, virtual in simulation), so neither class reads a clock or does I/O.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from enum import StrEnum

__all__ = ["Budget", "BudgetTracker", "Decision", "Termination", "TerminationConfig"]


class Decision(StrEnum):
    """What the iteration should do after a result (ordered: a later decision never weakens an earlier)."""

    CONTINUE = "continue"
    STOP_ITERATION = "stop_iteration"
    STOP_SEARCH = "stop_search"


_RANK = {Decision.CONTINUE: 0, Decision.STOP_ITERATION: 1, Decision.STOP_SEARCH: 2}


@dataclass(frozen=True, slots=True, kw_only=True)
class TerminationConfig:
    """When a profiled candidate ends the iteration's reasoning, or the whole search."""

    target_speedup: float | None = None
    """Stop the iteration and the whole search once a profiled candidate reaches this speedup."""
    improvement: float = 0.05
    """Stop the iteration early once a candidate beats the best speedup known before it by this fraction."""
    patience: int = 0
    """Further profiled results of the iteration, none better, to wait for before stopping (0: at once)."""
    min_speedup: float = 1.0
    """A candidate must also exceed this speedup to count."""

    def __post_init__(self) -> None:
        if self.target_speedup is not None and not (
            self.target_speedup > 0 and math.isfinite(self.target_speedup)
        ):
            raise ValueError(
                f"target_speedup is {self.target_speedup}: use a positive speedup, or None for none"
            )
        if not (self.improvement >= 0 and math.isfinite(self.improvement)):
            raise ValueError(f"improvement is {self.improvement}: use a fraction >= 0 (0.05 means 5% better)")
        if self.patience < 0:
            raise ValueError(f"patience is {self.patience}: use 0 (stop at once) or a positive count")
        if not (self.min_speedup >= 0 and math.isfinite(self.min_speedup)):
            raise ValueError(
                f"min_speedup is {self.min_speedup}: use a speedup >= 0 (1.0: beat the reference)"
            )


class Termination:
    """The termination criterion, one iteration at a time (see the module docstring)."""

    def __init__(self, config: TerminationConfig | None = None) -> None:
        self.config = config if config is not None else TerminationConfig()
        self._best: float | None = None
        self._search_done: str | None = None
        self.start_iteration(None)

    def start_iteration(self, best_before: float | None) -> None:
        """Start an iteration whose improvement bar is relative to `best_before` (None: no candidate yet)."""
        self._best_before = best_before
        if best_before is not None and (self._best is None or best_before > self._best):
            self._best = best_before
        self._iteration_best: float | None = None  # best counting result that cleared the bar
        self._waited = 0  # counting results since then, none better
        self._decision = Decision.STOP_SEARCH if self._search_done else Decision.CONTINUE
        self._reason: str | None = self._search_done

    @property
    def best(self) -> float | None:
        """The best correct speedup known: `best_before` values and every counting result so far."""
        return self._best

    @property
    def threshold(self) -> float:
        """The speedup a result of this iteration must exceed to stop it."""
        bar = self.config.min_speedup
        if self._best_before is not None:
            bar = max(bar, self._best_before * (1 + self.config.improvement))
        return bar

    @property
    def reason(self) -> str | None:
        """Why the iteration (or search) stopped, or None while it continues."""
        return self._reason

    def observe(self, speedup: float | None, correct: bool) -> Decision:
        """Record one result of the iteration and decide."""
        config = self.config
        counts = (
            correct
            and speedup is not None
            and math.isfinite(speedup)
            and speedup > max(config.min_speedup, 0)
        )
        if not counts:
            return self._decision
        assert speedup is not None
        if self._best is None or speedup > self._best:
            self._best = speedup
        if config.target_speedup is not None and speedup >= config.target_speedup:
            self._search_done = f"speedup {speedup:.3g}x reached the target {config.target_speedup:.3g}x"
            return self._decide(Decision.STOP_SEARCH, self._search_done)
        if self._iteration_best is not None and speedup <= self._iteration_best:
            self._waited += 1
        elif speedup > self.threshold:
            self._iteration_best, self._waited = speedup, 0
        if self._iteration_best is not None and self._waited >= config.patience:
            return self._decide(
                Decision.STOP_ITERATION,
                f"speedup {self._iteration_best:.3g}x beat the bar {self.threshold:.3g}x"
                + (f" and held for {self._waited} more results" if config.patience else ""),
            )
        return self._decision

    def _decide(self, decision: Decision, reason: str) -> Decision:
        if _RANK[decision] > _RANK[self._decision]:
            self._decision, self._reason = decision, reason
        return self._decision


@dataclass(frozen=True, slots=True, kw_only=True)
class Budget:
    """Limits on the whole search; None means unlimited."""

    wall_s: float | None = None
    """Wall-clock seconds from the start of the search."""
    tokens: int | None = None
    """Generated tokens: main reasoning, forks and probes all count (prompt tokens do not)."""
    iterations: int | None = None
    """Iterations (reasoning streams started)."""

    def __post_init__(self) -> None:
        if self.wall_s is not None and not self.wall_s > 0:
            raise ValueError(
                f"wall_s is {self.wall_s}: use a positive number of seconds, or None for no limit"
            )
        if self.tokens is not None and self.tokens <= 0:
            raise ValueError(f"tokens is {self.tokens}: use a positive token count, or None for no limit")
        if self.iterations is not None and self.iterations <= 0:
            raise ValueError(f"iterations is {self.iterations}: use a positive count, or None for no limit")


class BudgetTracker:
    """What has been spent of a `Budget` since `start` (a time on the caller's clock)."""

    def __init__(self, budget: Budget, start: float) -> None:
        self.budget = budget
        self.start = start
        self.tokens = 0
        self.iterations = 0

    def add_tokens(self, n: int) -> None:
        """Count `n` more generated tokens."""
        if n < 0:
            raise ValueError(f"add_tokens got {n}: token counts only grow; pass the tokens generated since")
        self.tokens += n

    def add_iteration(self) -> None:
        """Count one more iteration (call when it starts)."""
        self.iterations += 1

    def exhausted(self, now: float) -> str | None:
        """Which budget is spent, in words, or None while all remain."""
        budget = self.budget
        if budget.wall_s is not None and now - self.start >= budget.wall_s:
            return f"wall time {budget.wall_s:g} s spent"
        if budget.tokens is not None and self.tokens >= budget.tokens:
            return f"token budget {budget.tokens} spent ({self.tokens} generated)"
        if budget.iterations is not None and self.iterations >= budget.iterations:
            return f"iteration budget {budget.iterations} spent"
        return None

    def remaining_s(self, now: float) -> float | None:
        """Seconds of wall time left (never negative), or None without a wall budget."""
        if self.budget.wall_s is None:
            return None
        return max(0.0, self.budget.wall_s - (now - self.start))

    def remaining_tokens(self) -> int | None:
        """Tokens left (never negative), or None without a token budget."""
        if self.budget.tokens is None:
            return None
        return max(0, self.budget.tokens - self.tokens)
