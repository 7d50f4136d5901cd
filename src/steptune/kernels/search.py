"""The search loop and its policies: Sequential, ParallelSampling, EarlyExit, SpecGen (and its ablations).

Contract: `Search(llm, evaluator, config).run()` is a coroutine that uses only `agent.LLMService`,
`agent.EvalService` and the running loop's clock, so one policy object drives the simulated lane (virtual
time, sim.py) and the real one (replay or vLLM server, the sandboxed pool; real.py) unchanged. It runs until
the wall/token/iteration budget is spent (or, with `stop_at_target`, until the target is reached), and
returns a `SearchReport`.

Shared by every policy: candidates are deduplicated by normalized hash; each is validated, then profiled if
correct, as one chain; every profiled result is feedback for later prompts and is shown to the termination
rule. Priorities (when enabled): a main generation's answer first, then newer forks and drafts before older.
With reallocation on, an `ElasticAllocator` re-splits the evaluation workers every `realloc_every_s` from
measured arrival rates and service times; roles change at job boundaries only.

Policies, per iteration:
- `sequential`: one reasoning generation; its answer is evaluated; then the next iteration.
- `parallel`: `parallel_n` generations at once (best-of-N); the iteration ends when all answers are evaluated.
- `early_exit` (Dynasor-style certainty probes): every `probe_every_tokens`, a probe fork writes the code it
  would answer now; when `probe_agree` consecutive probes agree, the reasoning stops and that code is the
  answer. Probes are not evaluated.
- `specgen`: the reasoning streams while a trigger detector forks non-reasoning generations at plan ends,
  reflection cues and periodically (capped, spaced), and code drafts inside the reasoning are taken for free;
  their candidates are evaluated while the reasoning continues; when one meets the termination rule, the main
  stream and outstanding forks are closed and the next iteration starts. Ablations: `forks=False` (drafts
  only), `realloc=False` (static split), `priority=False` (FIFO), and the KV tier is a property of the LLM
  service (NullTier in sim).
"""

from __future__ import annotations

import asyncio
import contextlib
import statistics
from dataclasses import asdict, dataclass, field
from typing import Any

from steptune.kernels.agent import (
    PROBLEM_ERROR,
    Candidate,
    EvalService,
    Feedback,
    Generation,
    LLMService,
    Prompt,
)
from steptune.kernels.allocator import AllocatorConfig, ElasticAllocator
from steptune.kernels.clock import now
from steptune.kernels.extract import code_blocks, fork_code, normalized_hash
from steptune.kernels.termination import Budget, BudgetTracker, Termination, TerminationConfig
from steptune.kernels.triggers import TriggerConfig, TriggerDetector

__all__ = ["POLICIES", "Search", "SearchConfig", "SearchReport"]

POLICIES = ("sequential", "parallel", "early_exit", "specgen")
MAIN_PRIORITY = 10**12


async def _cancel(tasks: Any) -> None:
    pending = [t for t in list(tasks) if not t.done()]
    for t in pending:
        t.cancel()
    if pending:
        await asyncio.gather(*pending, return_exceptions=True)


@dataclass(frozen=True, slots=True, kw_only=True)
class SearchConfig:
    """A policy and its knobs; budgets and termination are shared by all policies."""

    policy: str = "specgen"
    """One of sequential, parallel, early_exit, specgen."""
    budget: Budget = field(default_factory=lambda: Budget(wall_s=7200.0, tokens=None, iterations=None))
    termination: TerminationConfig = field(default_factory=lambda: TerminationConfig(target_speedup=2.0))
    stop_at_target: bool = False
    """Stop the search at the target (optimize); off in benchmarks, which run every policy to the budget."""
    triggers: TriggerConfig = field(
        default_factory=lambda: TriggerConfig(min_gap_tokens=150, periodic_tokens=600, max_outstanding=8)
    )
    """SpecGen forks as often as the evaluation pool can absorb (the fork cost is counted in tokens)."""
    allocator: AllocatorConfig = field(default_factory=AllocatorConfig)
    parallel_n: int = 4
    probe_every_tokens: int = 1500
    probe_agree: int = 2
    forks: bool = True
    realloc: bool = True
    priority: bool = True
    realloc_every_s: float = 5.0
    early_stop: bool = True
    """SpecGen: close the reasoning once a candidate meets the termination rule."""


@dataclass(slots=True)
class SearchReport:
    policy: str
    elapsed_s: float
    e2e_time_s: float | None
    """Time until a profiled candidate first reached the target speedup (None: never, within budget)."""
    feedback_count: int
    """Profiling results delivered (the feedback SpecGen multiplies)."""
    validated: int
    feedback_latency_s: float | None
    """Median seconds from a correct candidate's creation to its profiling result (what priority shortens);
    candidates still waiting at the end count at their age (censored: a lower bound). None: no candidate
    passed validation."""
    unprofiled_at_end: int
    """Correct candidates still queued or running for profiling when the search ended."""
    eval_utilization: float
    best_speedup: float | None
    tokens: dict[str, int]
    iterations: int
    early_stops: int
    aborted_streams: int
    best_timeline: list[tuple[float, float]]
    roles_timeline: list[tuple[float, list[str]]]
    stop_reason: str
    notes: list[str] = field(default_factory=list)
    """What changed how the run went (e.g. a server that cannot be forked), for the user to read."""

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(slots=True)
class _Iteration:
    index: int
    stop: asyncio.Event = field(default_factory=asyncio.Event)
    gens: list[Generation] = field(default_factory=list)
    tasks: set[asyncio.Task[Any]] = field(default_factory=set)


class Search:
    """One optimization run of one policy (see the module docstring)."""

    def __init__(self, llm: LLMService, evaluator: EvalService, config: SearchConfig, *, problem: str = "sim",
                 progress: Any = None) -> None:  # fmt: skip
        if config.policy not in POLICIES:
            raise ValueError(f"unknown policy {config.policy!r}: choose one of {', '.join(POLICIES)}")
        self.llm, self.ev, self.cfg, self.problem = llm, evaluator, config, problem
        self.progress = progress
        self.feedback: list[Feedback] = []
        self.seen: set[str] = set()
        self.best: float | None = None
        self.tokens = {"main": 0, "fork": 0, "probe": 0}
        self.validated = 0
        self.early_stops = 0
        self.aborted = 0
        self.e2e: float | None = None
        self.best_timeline: list[tuple[float, float]] = []
        self.roles_timeline: list[tuple[float, list[str]]] = []
        self.done = asyncio.Event()
        self.problem_error: str | None = None
        """Set by the first verdict the problem file caused; it ends the search (its stop_reason)."""
        self.cur: _Iteration | None = None
        self.eval_tasks: set[asyncio.Task[Any]] = set()
        self.awaiting_profile: dict[str, Candidate] = {}
        """Correct candidates queued or running for profiling (their latency is censored at the end)."""
        self.validated_at: dict[str, float] = {}
        """When each of those passed validation (their feedback's time if the search ends first)."""
        self.index = 0
        self._body: asyncio.Future[Any] | None = None
        self.report: SearchReport | None = None
        """Set when `run` ends, however it ends (an interrupted search's report says `interrupted`)."""

    # -- shared machinery --
    def _t(self) -> float:
        return now() - self.t0

    def _count(self, kind: str, n: int) -> None:
        self.tokens[kind] += n
        self.budget.add_tokens(n)
        if self.budget.exhausted(now()):
            self.done.set()

    def _can_fork(self) -> bool:
        """False once the LLM service said it cannot fork (RealLLM on a server without /tokenize)."""
        return getattr(self.llm, "fork_unavailable", None) is None

    def _candidate(self, code: str, origin: str, it: int, progress: float) -> Candidate:
        return Candidate(code, origin, it, self._t(), normalized_hash(code), progress)

    def _prio(self, cand: Candidate) -> int:
        if not self.cfg.priority:
            return 0
        return MAIN_PRIORITY if cand.origin == "final" else int(cand.created_s * 1000)

    def _slots(self, kind: str) -> int:
        """Jobs of `kind` a worker runs at once (a validation GPU may run several): the allocator needs
        service time per slot."""
        capacity = getattr(self.ev, "capacity", None)
        return max(1, int(capacity(kind))) if capacity is not None else 1

    def evaluate(self, cand: Candidate) -> asyncio.Task[Feedback | None] | None:
        """Validate then profile `cand` (once per distinct kernel); returns the chain's task."""
        if cand.key in self.seen:
            return None
        self.seen.add(cand.key)
        task = asyncio.get_running_loop().create_task(self._chain(cand))
        self.eval_tasks.add(task)
        task.add_done_callback(self.eval_tasks.discard)
        return task

    async def _chain(self, cand: Candidate) -> Feedback | None:
        prio = self._prio(cand)
        self.alloc.observe_arrival("validate", now())
        v = await self.ev.submit(cand, "validate", prio)
        self.alloc.observe_service("validate", v.service_s / self._slots("validate"), now())
        self.validated += 1
        if v.verdict != "correct":
            fb = Feedback(cand, v.verdict, None, v.reason, self._t(), profiled=False)
            self.feedback.append(fb)
            if v.reason.startswith(PROBLEM_ERROR) and self.problem_error is None:
                # the problem file is broken (no candidate can pass): stop instead of spending the budget
                self.problem_error = v.reason
                self.done.set()
            return fb
        self.alloc.observe_arrival("profile", now())
        self.awaiting_profile[cand.key] = cand
        self.validated_at[cand.key] = self._t()
        p = await self.ev.submit(cand, "profile", prio)
        del self.awaiting_profile[cand.key]
        self.alloc.observe_service("profile", p.service_s / self._slots("profile"), now())
        fb = Feedback(cand, p.verdict, p.speedup, p.reason, self._t(), profiled=True)
        self.feedback.append(fb)
        ok = p.verdict == "correct" and p.speedup is not None
        if ok and (self.best is None or p.speedup > self.best):  # type: ignore[operator]
            self.best = p.speedup
            self.best_timeline.append((self._t(), float(p.speedup)))  # type: ignore[arg-type]
            target = self.cfg.termination.target_speedup
            if target is not None and self.e2e is None and self.best >= target:  # type: ignore[operator]
                self.e2e = self._t()
                if self.cfg.stop_at_target:
                    self.done.set()
        cur = self.cur
        if cur is not None and cand.iteration == cur.index:
            threshold = self.term.threshold  # the bar before this result
            decision = self.term.observe(p.speedup if ok else None, ok)
            # Only a result that clears the bar stops the reasoning: a search-wide stop (the target, reached
            # earlier) persists in `decision` and must not cut every later iteration at its first result.
            counts = ok and p.speedup is not None and p.speedup >= threshold
            if decision != "continue" and counts and self.cfg.policy == "specgen" and self.cfg.early_stop:
                cur.stop.set()
        if self.progress is not None:
            self.progress(self)
        return fb

    async def _stream(self, gen: Generation, kind: str, stream_id: str, it: _Iteration,
                      on_delta: Any = None) -> bool:  # fmt: skip
        """Read `gen` to its end (True) or until the iteration or search stops (False, closed)."""
        record = getattr(self.llm, "record_progress", None)
        it.gens.append(gen)
        try:
            async for delta in gen:
                self._count(kind, delta.tokens)
                if record is not None and kind == "main":
                    record(stream_id, gen.tokens)
                if on_delta is not None:
                    on_delta(gen)
                if it.stop.is_set() or self.done.is_set():
                    return False
            return True
        finally:
            await self._close(gen)  # a no-op for a finished stream; an abort otherwise

    async def _close(self, gen: Generation) -> None:
        before = gen.aborted
        with contextlib.suppress(Exception):
            await gen.aclose()
        if gen.aborted and not before:
            self.aborted += 1

    async def _answer(self, gen: Generation, it: _Iteration) -> None:
        blocks = code_blocks(gen.content)
        if blocks:
            task = self.evaluate(self._candidate(blocks[-1], "final", it.index, 1.0))
            if task is not None:
                await self._until(task, it)

    async def _until(self, task: asyncio.Future[Any], it: _Iteration) -> None:
        """Wait for `task`, the iteration's stop, or the search's end."""
        stop = asyncio.ensure_future(it.stop.wait())
        done = asyncio.ensure_future(self.done.wait())
        try:
            await asyncio.wait({task, stop, done}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            stop.cancel()
            done.cancel()

    # -- policies --
    async def _sequential(self, prompt: Prompt, it: _Iteration, j: int = 0) -> None:
        sid = f"it{it.index}/s{j}"
        gen = await self.llm.reason(prompt, sid)
        if await self._stream(gen, "main", sid, it):
            await self._answer(gen, it)

    async def _parallel(self, prompt: Prompt, it: _Iteration) -> None:
        await asyncio.gather(*(self._sequential(prompt, it, j) for j in range(self.cfg.parallel_n)))

    async def _fork_task(self, prompt: Prompt, sid: str, prefix: str, tokens: int, it: _Iteration,
                         kind: str) -> str | None:  # fmt: skip
        gen = await self.llm.fork(prompt, sid, prefix, tokens)
        if not await self._stream(gen, kind, sid, it):
            return None
        return fork_code(gen.content)

    async def _early_exit(self, prompt: Prompt, it: _Iteration) -> None:
        sid = f"it{it.index}/s0"
        gen = await self.llm.reason(prompt, sid)
        keys: list[tuple[int, str, str]] = []  # (probe index, key, code), in probe order
        exit_code: list[str] = []
        next_probe = [self.cfg.probe_every_tokens]
        probes: set[asyncio.Task[Any]] = set()

        def on_done(idx: int, task: asyncio.Task[str | None]) -> None:
            if task.cancelled() or task.exception() is not None or task.result() is None:
                return
            code = task.result()
            assert code is not None
            keys.append((idx, normalized_hash(code), code))
            keys.sort()
            tail = keys[-self.cfg.probe_agree :]
            if len(tail) == self.cfg.probe_agree and len({k for _, k, _ in tail}) == 1 and not exit_code:
                exit_code.append(code)
                it.stop.set()

        def on_delta(g: Generation) -> None:
            if g.tokens >= next_probe[0] and not exit_code and self._can_fork():
                next_probe[0] += self.cfg.probe_every_tokens
                idx = len(probes)
                t = asyncio.get_running_loop().create_task(
                    self._fork_task(prompt, sid, g.reasoning, g.tokens, it, "probe")
                )
                probes.add(t)
                t.add_done_callback(lambda task, i=idx: on_done(i, task))

        try:
            finished = await self._stream(gen, "main", sid, it, on_delta)
        finally:
            await _cancel(probes)
        if exit_code:
            self.early_stops += 1
            it.stop.clear()
            task = self.evaluate(self._candidate(exit_code[0], "final", it.index, 1.0))
            if task is not None:
                await self._until(task, it)
        elif finished:
            await self._answer(gen, it)

    async def _specgen(self, prompt: Prompt, it: _Iteration) -> None:
        sid = f"it{it.index}/s0"
        gen = await self.llm.reason(prompt, sid)
        det = TriggerDetector(self.cfg.triggers)
        forks: set[asyncio.Task[Any]] = set()

        def fork_done(task: asyncio.Task[str | None], progress: float) -> None:
            forks.discard(task)
            if task.cancelled() or task.exception() is not None:
                return
            code = task.result()
            if code is not None:
                self.evaluate(self._candidate(code, "fork", it.index, progress))

        def on_delta(g: Generation) -> None:
            for trig in det.feed(g.reasoning, g.tokens, now(), len(forks)):
                if trig.kind == "draft" and trig.code is not None:
                    self.evaluate(
                        self._candidate(trig.code, "draft", it.index, trig.tokens / max(1, g.tokens))
                    )
                elif not trig.suppressed and self.cfg.forks and trig.kind != "draft" and self._can_fork():
                    prefix = g.reasoning[: trig.chars]
                    t = asyncio.get_running_loop().create_task(
                        self._fork_task(prompt, sid, prefix, trig.tokens, it, "fork")
                    )
                    forks.add(t)
                    progress = trig.tokens
                    t.add_done_callback(lambda task, p=progress: fork_done(task, p / max(1, gen.tokens)))

        try:
            finished = await self._stream(gen, "main", sid, it, on_delta)
            if finished:
                await self._answer(gen, it)
            if it.stop.is_set():
                self.early_stops += 1
        finally:
            await _cancel(forks)

    # -- the loop --
    async def _realloc_loop(self) -> None:
        while not self.done.is_set():
            await asyncio.sleep(self.cfg.realloc_every_s)
            k = self.alloc.decide(now())
            if k is not None:
                roles = self.alloc.roles(k)
                self.ev.set_roles(roles)
                self.roles_timeline.append((self._t(), roles))

    async def _budget_watch(self) -> None:
        remaining = self.budget.remaining_s(now())
        if remaining is not None:
            await asyncio.sleep(max(0.0, remaining))
            self.done.set()

    async def run(self) -> SearchReport:
        """Search until a budget, the target, a broken problem or a failed LLM server ends it. Cancelled (or
        a KeyboardInterrupt or SystemExit through the loop), it sets `report` to what was found so far
        (stop_reason `interrupted`) before the exception goes on: the caller can still write it out."""
        self.t0 = now()
        self.budget = BudgetTracker(self.cfg.budget, self.t0)
        self.alloc = ElasticAllocator(self.ev.num_workers, self.cfg.allocator)
        self.term = Termination(self.cfg.termination)
        self.index = 0
        helpers = [asyncio.ensure_future(self._budget_watch())]
        if self.cfg.realloc and self.cfg.policy == "specgen":
            helpers.append(asyncio.ensure_future(self._realloc_loop()))
        try:
            stop_reason = await self._loop()
        except (asyncio.CancelledError, KeyboardInterrupt, SystemExit):
            # Ctrl-C or SIGTERM: keep what was found; stop the rest without waiting (this task is going away)
            self.report = self._finish("interrupted")
            self.done.set()
            for t in (*helpers, *self.eval_tasks, *([self._body] if self._body else [])):
                t.cancel()
            raise
        self.done.set()
        await _cancel(helpers)
        await _cancel(self.eval_tasks)
        # after the cancels: a profile landing while they run would otherwise join `feedback` beside the
        # unprofiled entry _finish made for the same candidate (a review)
        self.report = self._finish(stop_reason)
        return self.report

    async def _loop(self) -> str:
        """The iterations; returns why they stopped (before the final reason is settled in `_finish`)."""
        policy = {"sequential": self._sequential, "parallel": self._parallel,
                  "early_exit": self._early_exit, "specgen": self._specgen}[self.cfg.policy]  # fmt: skip
        stop_reason = "budget"
        while not self.done.is_set():
            if self.budget.exhausted(now()):
                break
            max_it = self.cfg.budget.iterations
            if max_it is not None and self.index >= max_it:
                stop_reason = "iterations"
                break
            it = _Iteration(self.index)
            self.cur = it
            self.term.start_iteration(self.best)
            prompt = Prompt(self.problem, self.index, list(self.feedback), self.best)
            body = self._body = asyncio.ensure_future(policy(prompt, it))
            finished = asyncio.ensure_future(self.done.wait())
            try:
                await asyncio.wait({body, finished}, return_when=asyncio.FIRST_COMPLETED)
            finally:
                finished.cancel()
            if not body.done():
                it.stop.set()
                body.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await body
            elif (exc := body.exception()) is not None:
                if not isinstance(exc, getattr(self.llm, "errors", ())):
                    raise exc
                # The LLM server failed (an HTTP error, a broken stream, a dropped connection): stop here
                # and report what was found, instead of losing it; candidates in flight get their verdicts.
                stop_reason = f"llm error: {exc}"
                for g in it.gens:
                    await self._close(g)
                break
            for g in it.gens:
                await self._close(g)
            self.index += 1
        self._body = None
        if (stop_reason == "iterations" or stop_reason.startswith("llm error")) and self.eval_tasks:
            # every proposed candidate still gets its verdict, within what is left of the wall budget
            await asyncio.wait(set(self.eval_tasks), timeout=self.budget.remaining_s(now()))
        return stop_reason

    def _finish(self, stop_reason: str) -> SearchReport:
        """The report of the search so far (synchronous: it also runs while the search is interrupted).
        Correct candidates still waiting for profiling join `feedback`, unprofiled, so none is lost."""
        if stop_reason == "interrupted":
            pass
        elif self.problem_error is not None:
            stop_reason = self.problem_error
        elif stop_reason.startswith("llm error"):
            pass  # the reason the search ended, whatever else holds
        elif self.e2e is not None and self.cfg.stop_at_target:
            stop_reason = "target"
        elif self.budget.exhausted(now()):
            stop_reason = str(self.budget.exhausted(now()))
        elapsed = self._t()
        busy = self.ev.busy_seconds()
        latencies = [f.at_s - f.candidate.created_s for f in self.feedback if f.profiled]
        # Correct candidates still waiting for profiling count at their age: a lower bound on their latency,
        # so a policy that starves old candidates (newest first) cannot hide them from the median.
        latencies += [elapsed - c.created_s for c in self.awaiting_profile.values()]
        why = stop_reason.splitlines()[0] if stop_reason else "stopped"
        why = why if len(why) <= 120 else why[:117] + "..."
        for key, cand in self.awaiting_profile.items():
            reason = f"validated; not profiled before the search ended ({why})"
            at = self.validated_at[key]
            self.feedback.append(Feedback(cand, "correct", None, reason, at, profiled=False))
        return SearchReport(
            policy=self.cfg.policy,
            elapsed_s=elapsed,
            e2e_time_s=self.e2e,
            feedback_count=sum(1 for f in self.feedback if f.profiled),
            validated=self.validated,
            feedback_latency_s=statistics.median(latencies) if latencies else None,
            unprofiled_at_end=len(self.awaiting_profile),
            eval_utilization=busy / max(1e-9, self.ev.num_workers * elapsed),
            best_speedup=self.best,
            tokens=dict(self.tokens),
            iterations=self.index,
            early_stops=self.early_stops,
            aborted_streams=self.aborted,
            best_timeline=self.best_timeline,
            roles_timeline=self.roles_timeline,
            stop_reason=stop_reason,
            notes=[n for n in (getattr(self.llm, "fork_unavailable", None),) if n],
        )
