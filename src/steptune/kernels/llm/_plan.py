"""Reply plans for the replay server: a trace or fork reply cut into timed token steps, and OpenAI bodies.

Contract: a reply is planned in full before its first byte is sent (it is a replay, so the whole output is
known) as `Step`s of whole toy tokens, each with the trace time at which it is due. `limit_steps` applies
`max_tokens` and `stop` to a plan. In chat, the `\\n</think>\\n\\n` tokens between reasoning and content are a
"hidden" step: generated (cached, counted in usage) but not sent, as with a server-side reasoning parser.
`Wire` builds the chunk and response bodies the official `openai` client parses. `SSEResponse` streams a
body and detects disconnects with a task waiting on ASGI `receive()` for `http.disconnect` next to the
sender, because uvicorn silently drops writes to a closed connection.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import time
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from ._tokens import THINK_CLOSE, Vocabulary, split_tokens
from .trace import Trace

__all__ = ["SSEResponse", "Step", "Wire", "fork_steps", "limit_steps", "sse", "trace_steps"]

_DEFAULT_TPS = 50.0
"""Decode rate for fork replies of traces recorded without one."""


@dataclass(slots=True)
class Step:
    t: float
    kind: str
    """"reasoning", "content" or "hidden" (generated, never sent)."""
    pieces: list[str]
    ids: list[int]

    @property
    def text(self) -> str:
        return "".join(self.pieces)


def trace_steps(trace: Trace, vocab: Vocabulary, *, raw: bool) -> list[Step]:
    """Re-cut a trace's events on token boundaries: a token goes to the event where it ends."""
    steps: list[Step] = []
    prev = None
    for kind, group in itertools.groupby(trace.events, key=lambda e: e.kind):
        events = list(group)
        if kind == "content" and prev == "reasoning":
            pieces = split_tokens(THINK_CLOSE)
            steps.append(
                Step(events[0].t, "content" if raw else "hidden", pieces, vocab.encode_pieces(pieces))
            )
        pieces = split_tokens("".join(e.text for e in events))
        j = pos = end = 0
        for event in events:
            end += len(event.text)
            take = []
            while j < len(pieces) and pos + len(pieces[j]) <= end:
                pos += len(pieces[j])
                take.append(pieces[j])
                j += 1
            if take:
                steps.append(Step(event.t, "content" if raw else kind, take, vocab.encode_pieces(take)))
        prev = kind
    return steps


def fork_steps(text: str, decode_tps: float, vocab: Vocabulary) -> list[Step]:
    """One token per step at the decode rate."""
    tps = decode_tps if decode_tps > 0 else _DEFAULT_TPS
    pieces = split_tokens(text)
    return [
        Step((i + 1) / tps, "content", [p], [d])
        for i, (p, d) in enumerate(zip(pieces, vocab.encode_pieces(pieces), strict=True))
    ]


def limit_steps(steps: list[Step], *, max_tokens: int | None, stop: Sequence[str]) -> tuple[list[Step], str]:
    """Cut the plan at `max_tokens` tokens, then before the first stop string; returns the finish reason."""
    out: list[Step] = []
    finish, n = "stop", 0
    for step in steps:
        if max_tokens is not None and n + len(step.ids) > max_tokens:
            k = max_tokens - n
            if k > 0:
                out.append(Step(step.t, step.kind, step.pieces[:k], step.ids[:k]))
            finish = "length"
            break
        out.append(step)
        n += len(step.ids)
    text = "".join(s.text for s in out if s.kind != "hidden")
    cuts = [i for i in (text.find(s) for s in stop if s) if i >= 0]
    if not cuts:
        return out, finish
    cut, pos, kept = min(cuts), 0, []
    for step in out:
        if step.kind == "hidden":
            continue
        if pos >= cut:
            break
        pieces, ids = [], []
        for piece, idx in zip(step.pieces, step.ids, strict=True):
            if pos >= cut:
                break
            pieces.append(piece[: cut - pos])  # the token holding the stop string's start still counts
            ids.append(idx)
            pos += len(piece)
        kept.append(Step(step.t, step.kind, pieces, ids))
    return kept, "stop"


def sse(obj: Any) -> bytes:
    return b"data: " + json.dumps(obj, separators=(",", ":")).encode() + b"\n\n"


@dataclass(slots=True)
class Wire:
    """OpenAI chunk and response bodies for one request."""

    endpoint: str
    num: int
    model: str
    reasoning_field: str
    created: int = field(default_factory=lambda: int(time.time()))

    def _chunk(self, choice: dict[str, Any] | None, **extra: Any) -> dict[str, Any]:
        chat = self.endpoint == "chat"
        return {
            "id": f"{'chatcmpl' if chat else 'cmpl'}-replay-{self.num}",
            "object": "chat.completion.chunk" if chat else "text_completion",
            "created": self.created,
            "model": self.model,
            "choices": [] if choice is None else [choice],
            **extra,
        }

    def _choice(
        self, payload: Any, finish: str | None = None, ids: list[int] | None = None
    ) -> dict[str, Any]:
        key = "delta" if self.endpoint == "chat" else "text"
        choice = {"index": 0, key: payload, "logprobs": None, "finish_reason": finish}
        return choice if ids is None else {**choice, "token_ids": ids}

    def first(self, prompt_ids: list[int] | None) -> dict[str, Any]:
        if self.endpoint == "chat":
            extra = {} if prompt_ids is None else {"prompt_token_ids": prompt_ids}
            return self._chunk(self._choice({"role": "assistant", "content": ""}), **extra)
        choice = self._choice("")
        return self._chunk(choice if prompt_ids is None else {**choice, "prompt_token_ids": prompt_ids})

    def delta(self, step: Step, with_ids: bool) -> dict[str, Any]:
        if self.endpoint == "chat":
            payload: Any = {self.reasoning_field if step.kind == "reasoning" else "content": step.text}
        else:
            payload = step.text
        return self._chunk(self._choice(payload, ids=step.ids if with_ids else None))

    def finish(self, reason: str) -> dict[str, Any]:
        return self._chunk(self._choice({} if self.endpoint == "chat" else "", finish=reason))

    def usage_chunk(self, usage: dict[str, Any]) -> dict[str, Any]:
        return self._chunk(None, usage=usage)

    def full(self, steps: list[Step], finish: str, usage: dict[str, Any]) -> dict[str, Any]:
        sent = [s for s in steps if s.kind != "hidden"]
        content = "".join(s.text for s in sent if s.kind == "content")
        if self.endpoint == "chat":
            message = {
                "role": "assistant",
                "content": content,
                self.reasoning_field: "".join(s.text for s in sent if s.kind == "reasoning") or None,
            }
            choice = {"index": 0, "message": message, "logprobs": None, "finish_reason": finish}
            kind = "chat.completion"
        else:
            choice, kind = (
                {"index": 0, "text": content, "logprobs": None, "finish_reason": finish},
                "text_completion",
            )
        return {**self._chunk(choice), "object": kind, "usage": usage}


class SSEResponse:
    """Streams `body`; calls `on_end(aborted)` once, aborted meaning it ended before the body did: the client
    disconnected, or `stop` was set (server shutdown), which drops the connection mid-stream."""

    def __init__(
        self, body: AsyncIterator[bytes], on_end: Callable[[bool], None], stop: asyncio.Event
    ) -> None:
        self.body, self.on_end, self.stop = body, on_end, stop

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        headers = [(b"content-type", b"text/event-stream; charset=utf-8"), (b"cache-control", b"no-cache")]
        await send({"type": "http.response.start", "status": 200, "headers": headers})

        async def pump() -> None:
            async for piece in self.body:
                await send({"type": "http.response.body", "body": piece, "more_body": True})
            await send({"type": "http.response.body", "body": b"", "more_body": False})

        async def watch() -> None:
            while (await receive())["type"] != "http.disconnect":
                pass

        tasks = [
            asyncio.ensure_future(pump()),
            asyncio.ensure_future(watch()),
            asyncio.ensure_future(self.stop.wait()),
        ]
        sent, failed = tasks[0], None
        try:
            await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
        finally:
            # Decide before cancelling: a body sent in full is complete even if the client has left since.
            complete = sent.done() and not sent.cancelled() and (failed := sent.exception()) is None
            for task in tasks:
                task.cancel()  # no-op on a finished task
            self.on_end(not complete)
            await asyncio.gather(*tasks, return_exceptions=True)
        if failed is not None:
            raise failed
