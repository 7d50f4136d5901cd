"""The replay server's Starlette app: request parsing, trace and fork choice, timed SSE playback, accounting.

Contract: a `ReplayApp` lives on the server thread's event loop; only `snapshot()` is called from other
threads, under `_lock`. Replies are planned in full by `_plan.py`; playback only waits and sends, batching
every step already due into one write, and `_plan.SSEResponse` reports whether the client left early.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import itertools
import json
import threading
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any, Literal

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route

from ._plan import SSEResponse, Step, Wire, fork_steps, limit_steps, sse, trace_steps
from ._tokens import PrefixCache, SeqBlocks, Vocabulary, render_chat
from .replay import ReplayConfig, RequestRecord
from .trace import Trace

_ANCHOR_CHARS = 32
"""A completion is a fork when its prompt holds this many leading characters of a trace's reasoning."""


class _HTTPError(Exception):
    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


def _common_prefix(text: str, start: int, ref: str) -> int:
    n, k = min(len(text) - start, len(ref)), 0
    while k + 256 <= n and text[start + k : start + k + 256] == ref[k : k + 256]:
        k += 256
    while k < n and text[start + k] == ref[k]:
        k += 1
    return k


@dataclass(slots=True)
class _Live:
    rec: RequestRecord
    seq: SeqBlocks = field(default_factory=SeqBlocks)
    generated: int = 0


class ReplayApp:
    def __init__(self, traces: list[Trace], config: ReplayConfig) -> None:
        if not traces:
            raise ValueError("serve_replay needs at least one trace")
        self.traces, self.config = traces, config
        self.vocab = Vocabulary()
        self.cache = PrefixCache(block_size=config.block_size, capacity_tokens=config.cache_capacity_tokens)
        self._reasoning = [t.reasoning for t in traces]
        self._rr: dict[tuple[Any, ...], itertools.count[int]] = {}
        self._lock = threading.Lock()
        self._live: list[_Live] = []
        self._stop = asyncio.Event()
        self._loop: asyncio.AbstractEventLoop | None = None

    def request_stop(self) -> None:
        """From any thread: end every stream now (server shutdown) instead of waiting for it to finish."""
        if self._loop is not None:
            with contextlib.suppress(RuntimeError):  # the loop already closed: nothing left to stop
                self._loop.call_soon_threadsafe(self._stop.set)

    def asgi(self) -> Starlette:
        g = self._guarded
        return Starlette(
            routes=[
                Route("/health", self.health, methods=["GET"]),
                Route("/v1/models", self.models, methods=["GET"]),
                Route("/v1/chat/completions", g(self.chat), methods=["POST"]),
                Route("/v1/completions", g(self.completions), methods=["POST"]),
                Route("/tokenize", g(self.tokenize), methods=["POST"]),
                Route("/detokenize", g(self.detokenize), methods=["POST"]),
            ]
        )

    def snapshot(self) -> list[RequestRecord]:
        with self._lock:
            return [
                dataclasses.replace(live.rec, generated_tokens=live.generated)
                if live.rec.status == "running"
                else live.rec
                for live in self._live
            ]

    # --- endpoints ---
    async def health(self, request: Request) -> JSONResponse:
        return JSONResponse({})

    async def models(self, request: Request) -> JSONResponse:
        names = sorted({t.model for t in self.traces})
        data = [{"id": m, "object": "model", "created": 0, "owned_by": "steptune-replay"} for m in names]
        return JSONResponse({"object": "list", "data": data})

    async def chat(self, body: dict[str, Any]) -> Any:
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages:
            raise _HTTPError(400, "'messages' must be a non-empty list")
        trace = self._select(body)
        steps = trace_steps(trace, self.vocab, raw=False)
        steps, finish = limit_steps(steps, max_tokens=_max_tokens(body), stop=())
        prompt_ids = self.vocab.encode(render_chat(messages))
        return await self._reply(body, "chat", trace, prompt_ids, steps, finish, fork=False)

    async def completions(self, body: dict[str, Any]) -> Any:
        prompt = body.get("prompt")
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
            prompt = prompt[0]  # a batch of one
        if isinstance(prompt, str):
            text, prompt_ids = prompt, self.vocab.encode(prompt)
        elif isinstance(prompt, list) and all(isinstance(i, int) for i in prompt):
            prompt_ids, text = prompt, self.vocab.decode(prompt)
        else:
            raise _HTTPError(
                400, "'prompt' must be a string or a list of token ids (batches are not supported)"
            )
        match = self._match_fork(text, body.get("model"))
        if match is not None:
            trace, chars = match
            reply = trace.fork_reply(chars)
            steps = fork_steps(
                reply.text if reply else self.config.fork_default, trace.decode_tps, self.vocab
            )
        else:
            trace = self._select(body)
            steps = trace_steps(trace, self.vocab, raw=True)
        stop = body.get("stop") or ()
        steps, finish = limit_steps(
            steps, max_tokens=_max_tokens(body), stop=[stop] if isinstance(stop, str) else stop
        )
        return await self._reply(body, "completion", trace, prompt_ids, steps, finish, fork=match is not None)

    async def tokenize(self, body: dict[str, Any]) -> JSONResponse:
        if body.get("messages") is not None:
            text = render_chat(
                body["messages"], add_generation_prompt=bool(body.get("add_generation_prompt", True))
            )
        else:
            text = str(body.get("prompt", ""))
        ids = self.vocab.encode(text)
        out: dict[str, Any] = {"count": len(ids), "max_model_len": 1 << 20, "tokens": ids}
        if body.get("return_token_strs"):
            out["token_strs"] = self.vocab.pieces(ids)
        return JSONResponse(out)

    async def detokenize(self, body: dict[str, Any]) -> JSONResponse:
        return JSONResponse({"prompt": self.vocab.decode(body.get("tokens") or [])})

    # --- choice ---
    def _select(self, body: dict[str, Any]) -> Trace:
        model = body.get("model")
        meta = body.get("metadata")
        pid = meta.get("problem_id") if isinstance(meta, dict) else None
        matched = [t for t in self.traces if t.model == model]
        cands = matched or self.traces
        if pid is not None:
            cands = [t for t in cands if t.problem_id == str(pid)]
            if not cands:
                have = sorted({t.problem_id for t in self.traces})
                raise _HTTPError(
                    404, f"no trace with problem_id {pid!r} (model {model!r}); traces have {have}"
                )
        counter = self._rr.setdefault((model if matched else None, pid), itertools.count())
        return cands[next(counter) % len(cands)]

    def _match_fork(self, text: str, model: Any) -> tuple[Trace, int] | None:
        best: tuple[int, bool, int] | None = None
        for idx, ref in enumerate(self._reasoning):
            start = text.find(ref[:_ANCHOR_CHARS]) if ref else -1
            if start >= 0:
                key = (_common_prefix(text, start, ref), self.traces[idx].model == model, -idx)
                best = key if best is None or key > best else best
        return None if best is None else (self.traces[-best[2]], best[0])

    # --- reply ---
    async def _reply(
        self,
        body: dict[str, Any],
        endpoint: str,
        trace: Trace,
        prompt_ids: list[int],
        steps: list[Step],
        finish: str,
        *,
        fork: bool,
    ) -> Any:
        cached = self.cache.lookup(prompt_ids)
        with self._lock:
            rec = RequestRecord(
                id=len(self._live) + 1,
                endpoint=endpoint,  # type: ignore[arg-type]
                stream=bool(body.get("stream")),
                model=str(body.get("model", "")),
                problem_id=trace.problem_id,
                fork=fork,
                prompt_tokens=len(prompt_ids),
                cached_tokens=cached,
                generated_tokens=0,
                status="running",
                start_s=time.monotonic(),
                end_s=None,
            )
            live = _Live(rec)
            self._live.append(live)
        self.cache.extend(live.seq, prompt_ids)
        prefill = (len(prompt_ids) - cached) / self.config.prefill_tps if self.config.prefill_tps else 0.0
        start = time.monotonic() + prefill / self.config.speed
        wire = Wire(endpoint, live.rec.id, str(body.get("model") or trace.model), self.config.reasoning_field)
        if not body.get("stream"):
            delay = start + (steps[-1].t if steps else 0.0) / self.config.speed - time.monotonic()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._stop.wait(), max(0.0, delay))
                self._end(live, aborted=True)
                raise _HTTPError(503, "the replay server is shutting down")
            for step in steps:
                self._advance(live, step)
            self._end(live, aborted=False)
            return JSONResponse(wire.full(steps, finish, self._usage(live)))
        opts = body.get("stream_options") or {}
        play = self._play(
            live,
            wire,
            steps,
            finish,
            start,
            bool(opts.get("include_usage")),
            bool(body.get("return_token_ids")),
            prompt_ids,
        )
        return SSEResponse(play, lambda aborted: self._end(live, aborted=aborted), self._stop)

    async def _play(
        self,
        live: _Live,
        wire: Wire,
        steps: list[Step],
        finish: str,
        start: float,
        usage: bool,
        with_ids: bool,
        prompt_ids: list[int],
    ) -> AsyncIterator[bytes]:
        speed, keepalive = self.config.speed, self.config.keepalive_s
        yield sse(wire.first(prompt_ids if with_ids else None))
        last_sent, i = time.monotonic(), 0
        while i < len(steps):
            now = time.monotonic()
            due = start + steps[i].t / speed
            if due > now:
                wait = min(due - now, last_sent + keepalive - now)
                if wait > 0:
                    await asyncio.sleep(wait)
                else:
                    yield b": keep-alive\n\n"
                    last_sent = now
                continue
            batch = []  # every step already due goes out in one write
            while i < len(steps) and start + steps[i].t / speed <= now:
                self._advance(live, steps[i])
                if steps[i].kind != "hidden":
                    batch.append(sse(wire.delta(steps[i], with_ids)))
                i += 1
            if batch:
                yield b"".join(batch)
                last_sent = time.monotonic()
        yield sse(wire.finish(finish))
        if usage:
            yield sse(wire.usage_chunk(self._usage(live)))
        yield b"data: [DONE]\n\n"

    def _advance(self, live: _Live, step: Step) -> None:
        self.cache.extend(live.seq, step.ids)
        live.generated += len(step.ids)

    def _usage(self, live: _Live) -> dict[str, Any]:
        p, g = live.rec.prompt_tokens, live.generated
        return {
            "prompt_tokens": p,
            "completion_tokens": g,
            "total_tokens": p + g,
            "prompt_tokens_details": {"cached_tokens": live.rec.cached_tokens},
        }

    def _end(self, live: _Live, *, aborted: bool) -> None:
        with self._lock:
            if live.rec.status == "running":
                status: Literal["aborted", "completed"] = "aborted" if aborted else "completed"
                live.rec = dataclasses.replace(
                    live.rec, status=status, end_s=time.monotonic(), generated_tokens=live.generated
                )

    def _guarded(self, handler: Callable[[dict[str, Any]], Any]) -> Callable[[Request], Any]:
        async def endpoint(request: Request) -> Any:
            self._loop = asyncio.get_running_loop()
            try:
                body = json.loads(await request.body() or b"{}")
                if not isinstance(body, dict):
                    raise _HTTPError(400, "the request body must be a JSON object")
                if body.get("n", 1) != 1:
                    raise _HTTPError(400, "the replay server supports only n=1")
                return await handler(body)
            except _HTTPError as err:
                return _error(err.status, str(err))
            except ValueError as err:  # malformed JSON, unknown token ids
                return _error(400, str(err))

        return endpoint


def _max_tokens(body: dict[str, Any]) -> int | None:
    value = body.get("max_tokens", body.get("max_completion_tokens"))
    return None if value is None else int(value)


def _error(status: int, message: str) -> JSONResponse:
    kind = {400: "BadRequestError", 404: "NotFoundError"}.get(status, "InternalServerError")
    return JSONResponse({"error": {"message": message, "type": kind, "code": status}}, status_code=status)
