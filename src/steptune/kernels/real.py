"""The real services behind the search loop: an OpenAI-compatible server and the sandboxed pool.

Contract: `RealLLM` implements `agent.LLMService` over `llm.LLMClient` (a vLLM/SGLang server, or the
trace-replay server); `RealEval` implements `agent.EvalService` over `pool.EvalPool`. Prompts are rendered
here: the problem's source, the instructions (KernelBench's "ModelNew" convention, C via
`steptune.kernels.cext` on CPU), and from the second iteration on the feedback so far (verdicts, reasons,
speedups, best). Forks are raw completions on the client-rendered chat prefix + the reasoning so far + a
closing think tag and an opening code fence (the Dynasor-style fork; see specgen.md section 3).
`RealEval.busy_seconds` counts finished requests' worker time (a request in flight counts when it ends).
"""

from __future__ import annotations

import asyncio
import contextlib
import warnings
from typing import Any

from steptune.kernels.agent import Candidate, Delta, EvalOutcome, Prompt
from steptune.kernels.pool import EvalPool
from steptune.kernels.problems import Problem

__all__ = ["RealEval", "RealLLM", "render_messages"]

_INSTRUCTIONS = (
    "You write faster kernels. Below is a PyTorch reference `Model` in the KernelBench format. Write "
    "`class ModelNew(nn.Module)` with the same constructor and forward signature that computes the same "
    "outputs faster. On CPU, C kernels compiled with `from steptune.kernels.cext import load_c, ptr` are "
    "welcome. Do not call the reference op, do not use try/except fallbacks, threads or processes. Answer "
    "with one ```python code block and no test code."
)


def render_messages(problem: Problem, prompt: Prompt) -> list[dict[str, str]]:
    """The chat for one iteration: the problem, then what earlier candidates got."""
    text = f"{_INSTRUCTIONS}\n\n```python\n{problem.source.strip()}\n```\n"
    if prompt.feedback:
        lines = []
        for fb in prompt.feedback[-12:]:
            what = f"{fb.verdict}"
            if fb.speedup is not None:
                what += f", {fb.speedup:.2f}x the reference"
            if fb.reason:
                what += f" ({fb.reason.splitlines()[0][:160]})"
            lines.append(
                f"- candidate from {fb.candidate.origin} (iteration {fb.candidate.iteration}): {what}"
            )
        best = f"{prompt.best_speedup:.2f}x" if prompt.best_speedup else "none correct yet"
        text += "\nResults so far (best: " + best + "):\n" + "\n".join(lines) + "\nImprove on the best.\n"
    return [{"role": "user", "content": text}]


class _Gen:
    def __init__(self, stream: Any, *, main: bool = False) -> None:
        self._s = stream
        self.reasoning = ""
        self.content = ""
        self.tokens = 0
        self._main = main

    @property
    def aborted(self) -> bool:
        return bool(self._s.aborted)

    def __aiter__(self) -> _Gen:
        self._it = self._s.__aiter__()
        return self

    async def __anext__(self) -> Delta:
        try:
            chunk = await self._it.__anext__()
        except StopAsyncIteration:
            if self._main and not self.tokens and self._s.finished:
                from steptune.kernels.llm._stream import LLMStreamError

                # the next iteration would get the same nothing at once: the loop would spin on the server
                raise LLMStreamError(
                    "the server ended a chat completion without any text (finish_reason "
                    f"{self._s.finish_reason!r}): check the model name and the server's log"
                ) from None
            raise
        n = len(chunk.token_ids) or max(1, len(chunk.text) // 4)
        if chunk.kind == "reasoning":
            self.reasoning += chunk.text
        else:
            self.content += chunk.text
        self.tokens += n
        return Delta(chunk.kind, chunk.text, n)

    async def aclose(self) -> None:
        await self._s.aclose()


class RealLLM:
    """`agent.LLMService` over an OpenAI-compatible server (use inside `async with client`)."""

    def __init__(
        self, client: Any, problem: Problem, *, fork_max_tokens: int = 4096, forks: bool = True
    ) -> None:
        """`forks=False` for policies that never fork or probe (sequential, parallel): then the prompt is not
        tokenized, and any OpenAI-compatible server will do."""
        self.client, self.problem, self.fork_max_tokens = client, problem, fork_max_tokens
        self.forks = forks
        self.fork_unavailable: str | None = None
        """Why this server cannot be forked (set on the first `reason`); the search then makes no forks."""
        self._rendered: dict[str, str] = {}

    @property
    def errors(self) -> tuple[type[BaseException], ...]:
        """The server's failures: the search stops on one and reports what it found (`Search.run`)."""
        import httpx

        from steptune.kernels.llm._stream import LLMHTTPError, LLMStreamError
        from steptune.kernels.llm.sse import SSEDecodeError

        return (LLMHTTPError, LLMStreamError, SSEDecodeError, httpx.HTTPError)

    async def reason(self, prompt: Prompt, stream_id: str) -> _Gen:
        messages = render_messages(self.problem, prompt)
        if self.forks and self.fork_unavailable is None:
            await self._render(messages, stream_id)
        params: dict[str, Any] = {"metadata": {"problem_id": self.problem.name}}
        return _Gen(await self.client.stream_chat(messages, **params), main=True)

    async def _render(self, messages: list[dict[str, str]], stream_id: str) -> None:
        """The prompt as the server's chat template renders it (vLLM's `/tokenize` with token strings): a
        fork continues it with the reasoning so far. Without it, forks are off for the run, said once."""
        from steptune.kernels.llm._stream import LLMHTTPError

        try:
            toks = await self.client.tokenize(messages=messages, return_token_strs=True)
        except LLMHTTPError as exc:
            if exc.status_code not in (404, 405, 501):
                raise
            why = f"the server has no vLLM-style /tokenize endpoint (HTTP {exc.status_code})"
        else:
            if toks.token_strs:
                self._rendered[stream_id] = "".join(toks.token_strs)
                return
            why = "the server's /tokenize returned no token_strs"
        self.fork_unavailable = (
            f"{why}: forks and probes continue the prompt as the server's chat template renders it, so this "
            "run makes none (drafts in the reasoning and final answers are still evaluated). Serve the model "
            "with vLLM for forks, or use --policy sequential / parallel"
        )
        warnings.warn(self.fork_unavailable, RuntimeWarning, stacklevel=2)

    async def fork(self, prompt: Prompt, stream_id: str, reasoning_prefix: str, prefix_tokens: int) -> _Gen:
        if self.fork_unavailable is not None or stream_id not in self._rendered:
            raise RuntimeError(
                self.fork_unavailable or f"no rendered prompt for {stream_id}: no fork from it"
            )
        prefix = self._rendered[stream_id] + reasoning_prefix
        return _Gen(await self.client.fork(prefix, max_tokens=self.fork_max_tokens))


class RealEval:
    """`agent.EvalService` over the sandboxed pool."""

    def __init__(self, pool: EvalPool, problem: Problem) -> None:
        self.pool, self.problem = pool, problem
        self.num_workers = pool.config.num_workers
        self._busy = 0.0
        self.results: list[tuple[Candidate, str, Any]] = []

    def submit(self, candidate: Candidate, kind: str, priority: int) -> asyncio.Future[EvalOutcome]:
        loop = asyncio.get_running_loop()
        out: asyncio.Future[EvalOutcome] = loop.create_future()
        fut = self.pool.submit(self.problem, candidate.code, kind=kind, priority=priority)  # type: ignore[arg-type]

        def done(_: Any) -> None:
            if out.done():
                return
            try:
                res = fut.result()
            except BaseException as exc:  # a pool failure becomes a crashed verdict, never a hang
                out.set_result(EvalOutcome("crashed", None, f"the pool failed: {exc!r}", 0.0))
                return
            self._busy += float(res.wall_s or 0.0)
            self.results.append((candidate, kind, res))
            # a speedup the evaluator flagged as implausible (> 10x) is not credited until a human looks
            speedup = None if res.extra.get("suspicious") else res.speedup
            outcome = EvalOutcome(res.verdict, speedup, res.reason, float(res.wall_s or 0.0))
            if not out.done():
                out.set_result(outcome)

        def relay(f: Any) -> None:
            # A result that lands after the search's event loop closed (the wall clock ran out while
            # it was still being evaluated) has nobody waiting for it: drop it instead of raising in
            # the pool's thread.
            if loop.is_closed():
                return
            with contextlib.suppress(RuntimeError):  # closed between the check and the call
                loop.call_soon_threadsafe(done, f)

        fut.add_done_callback(relay)
        out.add_done_callback(lambda o: fut.cancel() if o.cancelled() else None)  # drop it if still queued
        return out

    def set_roles(self, roles: list[str]) -> None:
        self.pool.set_roles(roles)

    def busy_seconds(self) -> float:
        return self._busy
