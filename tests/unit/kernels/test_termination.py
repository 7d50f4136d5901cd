"""The termination criterion (target, improvement with patience, nothing stopped by a worse or wrong
result) and the search budget (wall time, generated tokens, iterations)."""

import math

import pytest

from steptune.kernels.termination import Budget, BudgetTracker, Decision, Termination, TerminationConfig

pytestmark = pytest.mark.timeout(60)

CONTINUE, STOP_ITERATION, STOP_SEARCH = "continue", "stop_iteration", "stop_search"


def test_target_stops_the_search_and_stays_stopped() -> None:
    term = Termination(TerminationConfig(target_speedup=2.0, improvement=10.0))
    term.start_iteration(1.5)
    assert term.observe(1.9, correct=True) == CONTINUE  # better than before, far below the 10x bar
    assert term.observe(2.0, correct=True) == STOP_SEARCH
    assert term.reason is not None and "target" in term.reason
    assert term.observe(1.0, correct=False) == STOP_SEARCH  # late results do not undo it
    term.start_iteration(term.best)
    assert term.observe(None, correct=False) is Decision.STOP_SEARCH
    assert term.best == 2.0


def test_improvement_stops_the_iteration_at_once_without_patience() -> None:
    term = Termination(TerminationConfig(improvement=0.1))
    term.start_iteration(1.5)
    assert term.threshold == pytest.approx(1.65)
    assert term.observe(1.6, correct=True) == CONTINUE
    assert term.observe(1.7, correct=True) == STOP_ITERATION
    assert term.observe(1.1, correct=True) == STOP_ITERATION  # sticky within the iteration
    assert term.observe(5.0, correct=True) == STOP_ITERATION  # no target: never a search stop
    term.start_iteration(term.best)
    assert term.best == 5.0 and term.reason is None
    assert term.observe(5.2, correct=True) == CONTINUE  # the bar moved to 5.5


def test_improvement_with_patience_waits_for_results_that_are_not_better() -> None:
    term = Termination(TerminationConfig(improvement=0.1, patience=2))
    term.start_iteration(1.0)
    assert term.observe(1.05, correct=True) == CONTINUE  # below the bar: does not arm it
    assert term.observe(1.2, correct=True) == CONTINUE  # clears the bar: wait for 2 more
    assert term.observe(1.15, correct=True) == CONTINUE  # 1 without a better one
    assert term.observe(9.0, correct=False) == CONTINUE  # incorrect: does not count
    assert term.observe(None, correct=True) == CONTINUE  # not profiled: does not count
    assert term.observe(1.3, correct=True) == CONTINUE  # better: the wait restarts
    assert term.observe(1.0, correct=True) == CONTINUE  # not above min_speedup: does not count
    assert term.observe(1.25, correct=True) == CONTINUE
    assert term.observe(1.29, correct=True) == STOP_ITERATION
    assert term.reason is not None and "1.3x" in term.reason and "2 more" in term.reason


def test_first_iteration_needs_only_to_beat_min_speedup() -> None:
    term = Termination(TerminationConfig(min_speedup=1.0))
    term.start_iteration(None)
    assert term.observe(0.9, correct=True) == CONTINUE
    assert term.best is None  # 0.9 does not count
    assert term.observe(1.01, correct=True) == STOP_ITERATION


@pytest.mark.parametrize("patience", [0, 3])
def test_a_worse_or_incorrect_candidate_never_stops_anything(patience: int) -> None:
    term = Termination(TerminationConfig(target_speedup=3.0, improvement=0.05, patience=patience))
    term.start_iteration(2.0)
    results = [
        (1.9, True),
        (2.05, True),  # better, but not by 5%
        (50.0, False),
        (None, True),
        (None, False),
        (math.inf, True),
        (math.nan, True),
        (-1.0, True),
        (0.0, True),
    ] * 3
    for speedup, correct in results:
        assert term.observe(speedup, correct) == CONTINUE
    assert term.best == 2.05 and term.reason is None


def test_a_target_result_upgrades_an_earlier_iteration_stop() -> None:
    term = Termination(TerminationConfig(target_speedup=4.0))
    term.start_iteration(1.0)
    assert term.observe(1.5, correct=True) == STOP_ITERATION
    assert term.observe(4.5, correct=True) == STOP_SEARCH


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"target_speedup": 0.0}, "target_speedup"),
        ({"improvement": -0.1}, "improvement"),
        ({"patience": -1}, "patience"),
        ({"min_speedup": math.nan}, "min_speedup"),
    ],
)
def test_termination_config_errors(kwargs: dict[str, float], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        TerminationConfig(**kwargs)


def test_token_budget_counts_every_generation() -> None:
    tracker = BudgetTracker(Budget(tokens=1000), start=0.0)
    tracker.add_tokens(600)  # main reasoning
    tracker.add_tokens(250)  # forks
    assert tracker.exhausted(now=1e9) is None and tracker.remaining_tokens() == 150
    assert tracker.remaining_s(now=1e9) is None
    tracker.add_tokens(200)  # probes
    assert tracker.exhausted(now=0.0) == "token budget 1000 spent (1050 generated)"
    assert tracker.remaining_tokens() == 0
    with pytest.raises(ValueError, match="only grow"):
        tracker.add_tokens(-1)


def test_wall_budget_on_the_callers_clock() -> None:
    tracker = BudgetTracker(Budget(wall_s=3600), start=100.0)
    assert tracker.exhausted(now=3699.0) is None
    assert tracker.remaining_s(now=3699.0) == pytest.approx(1.0)
    assert tracker.exhausted(now=3700.0) == "wall time 3600 s spent"
    assert tracker.remaining_s(now=5000.0) == 0.0


def test_iteration_budget_and_which_budget_is_named() -> None:
    tracker = BudgetTracker(Budget(wall_s=10.0, tokens=100, iterations=2), start=0.0)
    tracker.add_iteration()
    assert tracker.exhausted(now=1.0) is None
    tracker.add_iteration()
    assert tracker.exhausted(now=1.0) == "iteration budget 2 spent"
    tracker.add_tokens(100)
    assert tracker.exhausted(now=1.0) is not None and "token" in str(tracker.exhausted(now=1.0))
    assert tracker.exhausted(now=10.0) == "wall time 10 s spent"
    assert BudgetTracker(Budget(), start=0.0).exhausted(now=1e12) is None


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [({"wall_s": 0}, "wall_s"), ({"tokens": 0}, "tokens"), ({"iterations": -2}, "iterations")],
)
def test_budget_errors(kwargs: dict[str, float], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        Budget(**kwargs)
