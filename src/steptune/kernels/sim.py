"""Simulated LLM and evaluation services on the virtual clock (SIMULATED; assumptions in docs/kernels.md).

Contract: `SimLLM` and `SimEval` implement `agent.LLMService` and `agent.EvalService` as coroutines that
sleep on the running loop's clock, so the orchestrator cannot tell them from the real ones; run them on
`clock.VirtualTimeLoop`. Everything random comes from the `random.Random` passed in, so a seed fixes a run.

What is modelled (each number is a field of `SimConfig` or `QualityConfig`, written down as an assumption):
- a reasoning generation is a synthetic trace (`llm.trace.synth_trace`: plan paragraphs, reflection cues,
  fenced code drafts) of lognormal length, decoded at `decode_tps` per stream (the serving engine is assumed
  not saturated: concurrent streams do not slow each other); its prefill is charged through the KV tier;
- a fork pays prefill of prompt + reasoning prefix through the KV tier, then decodes `fork_tokens`;
- serving replicas (`replicas`, default 1): each has its own prefix cache (`KVTier.replica()`; the remote
  tier is shared); a reasoning stream goes to the least-loaded replica, a fork to the least-loaded one
  (`fork_routing="load"`) or to its stream's (`"prefix"`), and a fork away from its stream's replica finds
  the prefix only in the shared tier or prefills it. The prefill's time delays the fork; it is not charged
  to the other streams on that replica (no decode interference is modelled);
- candidate quality (synthetic): valid with a probability rising with the progress of the reasoning it came
  from; log-speedup normal, its mean rising with the search's profiled feedback count (the premise of
  feedback-driven agents) and lower for early forks; past a per-trace "settle" point every fork returns the
  trace's final answer (so they deduplicate);
- evaluation GPUs: validation lognormal (`validate_s`), up to `validate_slots` at once per validation GPU;
  profiling lognormal (`profile_s`), one at a time, never sharing a GPU with validation; a worker switches
  role only when idle (timing runs are never preempted).
"""

from __future__ import annotations

import asyncio
import heapq
import itertools
import math
import random
from collections.abc import Callable
from dataclasses import dataclass, field

from steptune.kernels.agent import Candidate, Delta, EvalOutcome, Prompt
from steptune.kernels.kvtier import KVTier
from steptune.kernels.llm._tokens import split_tokens
from steptune.kernels.llm.trace import synth_trace

__all__ = ["QualityConfig", "SimConfig", "SimEval", "SimLLM", "sim_code", "sim_quality"]


@dataclass(frozen=True, slots=True, kw_only=True)
class SimConfig:
    """Service times of an H200-class deployment (assumptions, see docs/kernels.md)."""

    decode_tps: float = 40.0
    """Decode tokens/s per stream of a large reasoning MoE (GLM-5 / DeepSeek-V4 class) on H200s."""
    ttft_s: float = 0.5
    """Scheduling latency before the first token, besides prefill."""
    reasoning_tokens: float = 12_000
    """Median reasoning length of one generation (lognormal)."""
    reasoning_sigma: float = 0.35
    prompt_tokens: int = 3_000
    """Problem statement, instructions and examples."""
    feedback_tokens: int = 400
    """Prompt tokens added per feedback item (errors, timings) in later iterations."""
    fork_tokens: int = 1_200
    """Tokens a fork writes (one kernel)."""
    chunk_tokens: int = 64
    """Tokens per streamed delta (event granularity of the simulation)."""
    validate_s: float = 25.0
    """Median validation time: compile (nvcc / Triton JIT) plus correctness trials."""
    validate_sigma: float = 0.3
    profile_s: float = 40.0
    """Median profiling time: timed trials plus a hardware-counter pass."""
    profile_sigma: float = 0.2
    validate_slots: int = 4
    """Concurrent validations one validation GPU runs (validation can share a GPU, profiling cannot)."""
    timing_noise: float = 0.02
    """Relative noise of a measured speedup."""
    replicas: int = 1
    """Serving replicas (data-parallel engines), each with its own prefix cache; the KV tier's remote part
    is shared by all of them."""
    fork_routing: str = "load"
    """With several replicas, where a fork goes: "load", the replica with the fewest running streams (ties:
    its reasoning stream's replica), as a load-balancing router (vLLM's data-parallel balancer, round robin,
    least requests) does; "prefix", always its reasoning stream's replica, as a cache-aware router does."""

    def __post_init__(self) -> None:
        if not isinstance(self.replicas, int) or self.replicas < 1:
            raise ValueError(f"replicas={self.replicas}: pass 1 or more serving replicas")
        if self.fork_routing not in ("load", "prefix"):
            raise ValueError(f"fork_routing={self.fork_routing!r}: choose 'load' or 'prefix'")


@dataclass(frozen=True, slots=True, kw_only=True)
class QualityConfig:
    """Synthetic candidate quality (an assumption: it decides who wins; docs/kernels.md has the sweeps)."""

    p_valid_final: float = 0.55
    """Probability a first-iteration answer is correct (Kevin-32B's single-turn rate: 56%)."""
    p_valid_start: float = 0.25
    """Probability a fork from the very start of the reasoning is correct (linear in progress between)."""
    valid_gain: float = 0.25
    """Probability of correctness added as profiled feedback accumulates (saturating, scale 30 results):
    0.55 -> 0.80, as Kevin-32B's multi-turn correctness (56% -> 82%)."""
    base_speedup: float = 0.9
    """Median speedup of a first-iteration answer."""
    learn: float = 0.18
    """Log-speedup gained per unit of ln(1 + profiled feedback so far)."""
    early_penalty: float = 0.35
    """Log-speedup lost by a fork from the start of the reasoning (linear in progress)."""
    sigma: float = 0.25
    """Spread of log-speedup."""
    settle_lo: float = 0.6
    settle_hi: float = 0.9
    """The reasoning settles on its final answer somewhere in this fraction of its length."""
    drafts_mean: float = 1.0
    """Mean number of complete code drafts inside a reasoning trace (Poisson, at most 3)."""


_ids = itertools.count()


def sim_code(valid: bool, speedup: float) -> str:
    """A simulated candidate: its quality is written in it (SimEval reads it back), and its id makes it a
    distinct kernel for deduplication (which hashes the AST, so it cannot be a comment)."""
    return f"SIM_CANDIDATE = ({next(_ids)}, {int(valid)}, {speedup:.6f})\n\n\nclass ModelNew:\n    pass\n"


def sim_quality(code: str) -> tuple[bool, float]:
    head = code.split("\n", 1)[0]
    if not head.startswith("SIM_CANDIDATE = ("):
        return False, 0.0
    _, valid, speedup = head.split("(", 1)[1].rstrip(")").split(",")
    return valid.strip() == "1", float(speedup)


@dataclass(slots=True)
class _Plan:
    tokens: int
    settle: float
    final: str
    knowledge: int
    prompt_tokens: int
    replica: int


class _SimGeneration:
    def __init__(self, events: list[Delta], times: list[float], delay_s: float,
                 on_end: Callable[[], None] | None = None) -> None:  # fmt: skip
        self._events, self._times, self._delay = events, times, delay_s
        self._on_end = on_end
        self.reasoning = ""
        self.content = ""
        self.tokens = 0
        self.aborted = False
        self._closed = False
        self._finished = False
        self._next = 0
        self._start: float | None = None

    def __aiter__(self) -> _SimGeneration:
        return self

    async def __anext__(self) -> Delta:
        loop = asyncio.get_running_loop()
        if self._start is None:
            self._start = loop.time() + self._delay
        if self._closed or self._next >= len(self._events):
            self._finished = self._finished or not self._closed
            self._end()
            raise StopAsyncIteration
        ev, t = self._events[self._next], self._times[self._next]
        wait = self._start + t - loop.time()
        if wait > 0:
            await asyncio.sleep(wait)
        if self._closed:
            raise StopAsyncIteration
        self._next += 1
        if ev.kind == "reasoning":
            self.reasoning += ev.text
        else:
            self.content += ev.text
        self.tokens += ev.tokens
        if self._next == len(self._events):
            self._finished = True
            self._end()
        return ev

    def _end(self) -> None:
        """The request leaves its replica (finished or aborted): once."""
        if self._on_end is not None:
            self._on_end()
            self._on_end = None

    async def aclose(self) -> None:
        if not self._closed:
            self._closed = True
            self.aborted = not self._finished
        self._end()


class SimLLM:
    """A reasoning LLM served on H200s, simulated (see the module docstring)."""

    def __init__(self, rng: random.Random, kv: KVTier, config: SimConfig | None = None,
                 quality: QualityConfig | None = None) -> None:  # fmt: skip
        self.rng, self.kv = rng, kv
        self.cfg = config or SimConfig()
        self.q = quality or QualityConfig()
        self.plans: dict[str, _Plan] = {}
        self.prefill_s = 0.0
        self.tiers: list[KVTier] = [kv] + [kv.replica() for _ in range(self.cfg.replicas - 1)]
        self.load = [0] * self.cfg.replicas
        """Running streams per replica (what a load-balancing router sees)."""
        self.forks_off_replica = 0
        """Forks routed to a replica other than their reasoning stream's."""
        self.fork_start_s: list[float] = []
        """Each fork's delay before its first token: scheduling plus its prefix's prefill or fetch."""

    def _admit(self, replica: int) -> Callable[[], None]:
        self.load[replica] += 1

        def leave() -> None:
            self.load[replica] -= 1

        return leave

    def _route(self, home: int | None) -> int:
        """The least-loaded replica; ties go to `home` (the reasoning stream's replica), then the lowest."""
        low = min(self.load)
        if home is not None and self.load[home] == low:
            return home
        return self.load.index(low)

    def _quality(self, knowledge: int, progress: float) -> tuple[bool, float]:
        q = self.q
        p = q.p_valid_start + (q.p_valid_final - q.p_valid_start) * progress
        # feedback also makes kernels correct more often (Kevin-32B: multi-turn correctness 56% -> 82%)
        p = min(0.98, p + q.valid_gain * (1.0 - math.exp(-knowledge / 30.0)))
        mu = math.log(q.base_speedup) + q.learn * math.log1p(knowledge) - q.early_penalty * (1.0 - progress)
        return self.rng.random() < p, math.exp(self.rng.gauss(mu, q.sigma))

    def _prompt_tokens(self, prompt: Prompt) -> int:
        # real.render_messages shows the last 12 feedback items
        return self.cfg.prompt_tokens + self.cfg.feedback_tokens * min(12, len(prompt.feedback))

    async def reason(self, prompt: Prompt, stream_id: str) -> _SimGeneration:
        cfg = self.cfg
        knowledge = sum(1 for f in prompt.feedback if f.profiled)
        tokens = max(200, int(self.rng.lognormvariate(math.log(cfg.reasoning_tokens), cfg.reasoning_sigma)))
        n_drafts = min(3, _poisson(self.rng, self.q.drafts_mean))
        fracs = sorted(self.rng.uniform(0.25, 0.9) for _ in range(n_drafts))
        drafts = [sim_code(*self._quality(knowledge, f)) for f in fracs]
        final = sim_code(*self._quality(knowledge, 1.0))
        ptoks = self._prompt_tokens(prompt)
        replica = self._route(None)
        self.plans[stream_id] = _Plan(
            tokens, self.rng.uniform(self.q.settle_lo, self.q.settle_hi), final, knowledge, ptoks, replica
        )
        trace = synth_trace(
            self.rng.randrange(2**31),
            reasoning_tokens=tokens,
            decode_tps=cfg.decode_tps,
            drafts=drafts,
            final_code=final,
            ttft_s=0.0,
            tokens_per_event=cfg.chunk_tokens,
        )
        now = asyncio.get_running_loop().time()
        # Consecutive prompts share their beginning (instructions, problem, older feedback): one prefix id,
        # so a new iteration prefills only what its cached predecessor lacks.
        shared = f"{prompt.problem}/prompt"
        kv = self.tiers[replica]
        prefill = kv.lookup(shared, ptoks, now)
        kv.put(shared, ptoks, now)
        kv.put(stream_id, ptoks, now)
        self.prefill_s += prefill
        events = [Delta(e.kind, e.text, len(split_tokens(e.text))) for e in trace.events]
        times = [e.t for e in trace.events]
        return _SimGeneration(events, times, cfg.ttft_s + prefill, self._admit(replica))

    def record_progress(self, stream_id: str, reasoning_tokens: int) -> None:
        """The main stream's KV blocks grow as it decodes (the orchestrator reports progress)."""
        plan = self.plans.get(stream_id)
        if plan is not None:
            now = asyncio.get_running_loop().time()
            self.tiers[plan.replica].put(stream_id, plan.prompt_tokens + reasoning_tokens, now)

    async def fork(
        self, prompt: Prompt, stream_id: str, reasoning_prefix: str, prefix_tokens: int
    ) -> _SimGeneration:
        plan = self.plans[stream_id]
        cfg = self.cfg
        progress = min(1.0, prefix_tokens / max(1, plan.tokens))
        code = plan.final if progress >= plan.settle else sim_code(*self._quality(plan.knowledge, progress))
        now = asyncio.get_running_loop().time()
        replica = plan.replica if cfg.fork_routing == "prefix" else self._route(plan.replica)
        self.forks_off_replica += replica != plan.replica
        prefill = self.tiers[replica].lookup(stream_id, plan.prompt_tokens + prefix_tokens, now)
        self.prefill_s += prefill
        self.fork_start_s.append(cfg.ttft_s + prefill)
        text = code + "```\n"
        n = max(1, math.ceil(cfg.fork_tokens / cfg.chunk_tokens))
        per = len(text) // n + 1
        pieces = [text[i : i + per] for i in range(0, len(text), per)]
        toks = [cfg.fork_tokens // len(pieces)] * len(pieces)
        toks[-1] += cfg.fork_tokens - sum(toks)
        dt = cfg.fork_tokens / cfg.decode_tps / len(pieces)
        events = [Delta("content", p, k) for p, k in zip(pieces, toks, strict=True)]
        times = [dt * (i + 1) for i in range(len(pieces))]
        return _SimGeneration(events, times, cfg.ttft_s + prefill, self._admit(replica))


def _poisson(rng: random.Random, lam: float) -> int:
    k, p, limit = 0, 1.0, math.exp(-lam)
    while True:
        p *= rng.random()
        if p <= limit:
            return k
        k += 1


@dataclass(slots=True)
class _Worker:
    role: str
    running: str | None = None
    active: int = 0
    busy_s: float = 0.0
    since: float = 0.0


@dataclass(order=True, slots=True)
class _Job:
    key: tuple[int, int]
    kind: str = field(compare=False)
    candidate: Candidate = field(compare=False)
    future: asyncio.Future[EvalOutcome] = field(compare=False)


class SimEval:
    """Evaluation GPUs with validation/profiling roles, simulated (see the module docstring)."""

    def __init__(self, num_workers: int, rng: random.Random, config: SimConfig | None = None,
                 roles: list[str] | None = None, use_priority: bool = True) -> None:  # fmt: skip
        self.num_workers = num_workers
        self.rng, self.cfg, self.use_priority = rng, config or SimConfig(), use_priority
        default = ["validate"] * max(1, num_workers // 2) + ["profile"] * (
            num_workers - max(1, num_workers // 2)
        )
        self.workers = [_Worker(r) for r in (roles or default)]
        self._queue: list[_Job] = []
        self._seq = itertools.count()
        self.completed = {"validate": 0, "profile": 0}
        self._tasks: set[asyncio.Task[None]] = set()

    def capacity(self, kind: str) -> int:
        """Jobs of `kind` one worker runs at once (the allocator divides service times by it)."""
        return self._capacity(kind)

    def _capacity(self, kind: str) -> int:
        return self.cfg.validate_slots if kind == "validate" else 1

    def submit(self, candidate: Candidate, kind: str, priority: int) -> asyncio.Future[EvalOutcome]:
        fut: asyncio.Future[EvalOutcome] = asyncio.get_running_loop().create_future()
        prio = priority if self.use_priority else 0
        heapq.heappush(self._queue, _Job((-prio, next(self._seq)), kind, candidate, fut))
        self._dispatch()
        return fut

    def set_roles(self, roles: list[str]) -> None:
        for w, r in zip(self.workers, roles, strict=True):
            w.role = r
        self._dispatch()

    def busy_seconds(self) -> float:
        now = asyncio.get_running_loop().time()
        return sum(w.busy_s + (now - w.since if w.active else 0.0) for w in self.workers)

    def roles(self) -> list[str]:
        return [w.role for w in self.workers]

    def _fits(self, w: _Worker, kind: str) -> bool:
        if w.role not in (kind, "any"):
            return False
        return w.active == 0 or (w.running == kind and w.active < self._capacity(kind))

    def _dispatch(self) -> None:
        loop = asyncio.get_running_loop()
        kept: list[_Job] = []
        while self._queue:
            job = heapq.heappop(self._queue)
            if job.future.cancelled():
                continue
            worker = next((w for w in self.workers if self._fits(w, job.kind)), None)
            if worker is None:
                kept.append(job)
                continue
            if worker.active == 0:
                worker.since = loop.time()
            worker.active += 1
            worker.running = job.kind
            task = loop.create_task(self._serve(worker, job))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)
        for job in kept:
            heapq.heappush(self._queue, job)

    async def _serve(self, worker: _Worker, job: _Job) -> None:
        cfg = self.cfg
        median, sigma = (
            (cfg.validate_s, cfg.validate_sigma)
            if job.kind == "validate"
            else (cfg.profile_s, cfg.profile_sigma)
        )
        service = self.rng.lognormvariate(math.log(median), sigma)
        await asyncio.sleep(service)
        valid, speedup = sim_quality(job.candidate.code)
        if job.kind == "validate":
            out = EvalOutcome("correct" if valid else "incorrect", None, "", service)
        else:
            measured = speedup * math.exp(self.rng.gauss(0.0, cfg.timing_noise))
            out = EvalOutcome("correct" if valid else "incorrect", measured if valid else None, "", service)
        loop = asyncio.get_running_loop()
        worker.active -= 1
        if worker.active == 0:
            worker.busy_s += loop.time() - worker.since
            worker.running = None
        self.completed[job.kind] += 1
        if not job.future.done():
            job.future.set_result(out)
        self._dispatch()
