"""A streaming response: SSE bytes in, `Chunk`s out, token accounting, recording.

Contract: a `Stream` is iterated once (`async for`) and owns its HTTP response; it closes the response when
the server ends the stream, when iteration raises, and on `aclose()`. Breaking out of `async for` does not
close it: call `aclose()` (or use `async with`), which marks the stream `aborted` if the server had not
ended it. The token ids of a delta go to the first chunk made from it (or, when a `<think>` tag is still
undecided, to the next one). Token-count fallbacks without a usage chunk are approximations (see
`client.py`). A stream with a recorder is appended to the trace file exactly once, when it ends.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from ._think import ThinkSplitter
from .sse import SSEParser
from .trace import Trace, TraceEvent, save_traces

if TYPE_CHECKING:
    import httpx

__all__ = ["Chunk", "LLMHTTPError", "LLMStreamError", "Stream"]


class LLMHTTPError(RuntimeError):
    """The server answered with an HTTP error status."""

    def __init__(self, status_code: int, message: str, url: str) -> None:
        super().__init__(f"HTTP {status_code} from {url}: {message}")
        self.status_code = status_code
        self.message = message


class LLMStreamError(RuntimeError):
    """The server reported an error inside an event stream, or sent something that is not an OpenAI-style
    event stream (a plain JSON answer, no events at all, chunks of the wrong shape)."""


_MAX_QUOTE = 200
_TEXT_FIELDS = ("content", "reasoning_content", "reasoning")


def _shape_error(data: Any, what: str) -> LLMStreamError:
    text = json.dumps(data)
    text = text if len(text) <= _MAX_QUOTE else text[:_MAX_QUOTE] + "..."
    return LLMStreamError(f"stream chunk {text!r} is not an OpenAI-style chunk: {what}")


@dataclass(frozen=True, slots=True)
class Chunk:
    """A piece of streamed text, reasoning or answer content."""

    kind: Literal["reasoning", "content"]
    text: str
    token_ids: tuple[int, ...] = ()
    t: float = 0.0
    """Seconds from sending the request to receiving this chunk."""


def error_message(body: bytes) -> str:
    try:
        data = json.loads(body)
    except ValueError:
        return body.decode("utf-8", "replace")[:500] or "(empty body)"
    if isinstance(data, dict):
        err = data.get("error", data)
        if isinstance(err, dict):
            return str(err.get("message") or err.get("detail") or data)
        return str(err)
    return str(data)


@dataclass(slots=True)
class StreamRequest:
    endpoint: Literal["chat", "completion"]
    body: dict[str, Any]
    recorder: Recorder | None
    fork: bool = False


class Stream:
    """One streaming generation; iterate once, then read the counters."""

    def __init__(
        self, response: httpx.Response, request: StreamRequest, started: float, think: ThinkSplitter | None
    ) -> None:
        self._response, self._request, self._started, self._think = response, request, started, think
        self._parser = SSEParser()
        self._iterating = False
        self._ended = False
        self.finished = False
        """The server ended the stream (`[DONE]` or end of body)."""
        self.aborted = False
        """Closed by the client before the server's end."""
        self.chunks: list[Chunk] = []
        self.token_ids: list[int] = []
        self.prompt_token_ids: list[int] | None = None
        self.usage: dict[str, Any] | None = None
        self.finish_reason: str | None = None
        self._pending_ids: tuple[int, ...] = ()
        self._events = 0
        self._head = b""
        """The body's first bytes, quoted when it holds no event."""

    # --- results ---
    @property
    def reasoning(self) -> str:
        return "".join(c.text for c in self.chunks if c.kind == "reasoning")

    @property
    def content(self) -> str:
        return "".join(c.text for c in self.chunks if c.kind == "content")

    @property
    def num_keepalives(self) -> int:
        return self._parser.num_comments

    @property
    def prompt_tokens(self) -> int:
        if self.usage and self.usage.get("prompt_tokens") is not None:
            return int(self.usage["prompt_tokens"])
        return len(self.prompt_token_ids or ())

    @property
    def completion_tokens(self) -> int:
        if self.usage and self.usage.get("completion_tokens") is not None:
            return int(self.usage["completion_tokens"])
        return len(self.token_ids) or len(self.chunks)

    @property
    def cached_tokens(self) -> int:
        details = (self.usage or {}).get("prompt_tokens_details") or {}
        return int(details.get("cached_tokens") or 0)

    # --- iteration ---
    def __aiter__(self) -> AsyncIterator[Chunk]:
        if self._iterating:
            raise RuntimeError("a Stream can be iterated only once")
        self._iterating = True
        return self._iterate()

    async def __aenter__(self) -> Stream:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    async def collect(self) -> Stream:
        """Read the stream to its end; returns self."""
        async for _ in self:
            pass
        return self

    async def aclose(self) -> None:
        """Close the HTTP response; the server sees a disconnect and should abort the generation."""
        if not self._ended:
            self.aborted = not self.finished
            await self._response.aclose()
            self._end()

    async def _iterate(self) -> AsyncIterator[Chunk]:
        import httpx

        try:
            async for raw in self._response.aiter_bytes():
                if len(self._head) < _MAX_QUOTE:
                    self._head += raw[: _MAX_QUOTE - len(self._head)]
                for event in self._parser.feed(raw):
                    self._events += 1
                    if event.done:
                        self.finished = True
                        break
                    for chunk in self._on_data(event.json()):
                        yield chunk
                if self.finished:
                    break
            else:
                # a body that ends without [DONE] still ends the stream
                self._events += len(self._parser.flush())
                if not self._events:
                    head = self._head.decode("utf-8", "replace")
                    raise LLMStreamError(
                        f"the server's answer to a streaming request held no server-sent events (body "
                        f"{head!r}): it is not an OpenAI-style event stream. Point --llm-url at a server "
                        "that streams (vLLM, SGLang)"
                    )
                self.finished = True
            for chunk in self._emit(self._content("", final=True), ()):
                yield chunk
        except (httpx.StreamClosed, httpx.ReadError):
            if not self._ended:  # not closed by aclose() from another task
                raise
        finally:
            await self.aclose()

    def _on_data(self, data: Any) -> list[Chunk]:
        if not isinstance(data, dict):
            raise LLMStreamError(f"stream chunk is not a JSON object: {str(data)[:200]!r}")
        if data.get("error"):
            raise LLMStreamError(f"server error mid-stream: {error_message(json.dumps(data).encode())}")
        if data.get("usage") and not isinstance(data["usage"], dict):
            raise _shape_error(data, "its 'usage' is not an object")
        if data.get("usage"):
            self.usage = data["usage"]
        if data.get("prompt_token_ids") is not None:
            self.prompt_token_ids = list(data["prompt_token_ids"])
        out: list[Chunk] = []
        choices = data.get("choices") or []
        if not isinstance(choices, list) or not all(isinstance(c, dict) for c in choices):
            raise _shape_error(data, "its 'choices' is not a list of objects")
        for choice in choices:
            if not isinstance(choice.get("delta") or {}, dict):
                raise _shape_error(data, "a choice's 'delta' is not an object")
            texts = [choice.get("text"), *((choice.get("delta") or {}).get(k) for k in _TEXT_FIELDS)]
            if not all(t is None or isinstance(t, str) for t in texts):
                raise _shape_error(data, "a text field is not a string")
            if choice.get("prompt_token_ids") is not None:
                self.prompt_token_ids = list(choice["prompt_token_ids"])
            if choice.get("finish_reason"):
                self.finish_reason = choice["finish_reason"]
            ids = tuple(choice.get("token_ids") or ())
            self.token_ids.extend(ids)
            if "delta" in choice:
                delta = choice["delta"] or {}
                thought = delta.get("reasoning_content") or delta.get("reasoning")
                pieces = [("reasoning", thought)] if thought else []
                pieces += self._content(delta.get("content") or "")
            else:
                pieces = self._content(choice.get("text") or "")
            out += self._emit(pieces, ids)
        return out

    def _content(self, text: str, *, final: bool = False) -> list[tuple[str, str]]:
        if self._think is not None:
            return self._think.feed(text, final=final)
        return [("content", text)] if text else []

    def _emit(self, pieces: list[tuple[str, str]], ids: tuple[int, ...]) -> list[Chunk]:
        """Chunks for the pieces of one delta; its token ids go to the first (or wait for the next)."""
        ids = self._pending_ids + ids
        if not pieces:
            self._pending_ids = ids
            return []
        self._pending_ids = ()
        t = time.monotonic() - self._started
        out = [Chunk(k, text, ids if i == 0 else (), t) for i, (k, text) in enumerate(pieces)]  # type: ignore[arg-type]
        self.chunks.extend(out)
        return out

    def _end(self) -> None:
        self._ended = True
        if self._request.recorder is not None:
            self._request.recorder.record(self)


@dataclass(slots=True)
class Recorder:
    path: Path
    model: str
    lock: threading.Lock = field(default_factory=threading.Lock)

    def record(self, stream: Stream) -> None:
        req = stream._request
        chunks = stream.chunks
        span = chunks[-1].t - chunks[0].t if len(chunks) > 1 else 0.0
        meta = {
            "endpoint": req.endpoint,
            "fork": req.fork,
            "completion_tokens": stream.completion_tokens,
            "cached_tokens": stream.cached_tokens,
            "aborted": stream.aborted,
            "finish_reason": stream.finish_reason,
        }
        events = tuple(TraceEvent(c.t, c.kind, c.text, c.token_ids or None) for c in chunks)
        problem_id = str((req.body.get("metadata") or {}).get("problem_id", ""))
        tps = round(stream.completion_tokens / span, 3) if span > 0 else 0.0
        trace = Trace(
            str(req.body.get("model", self.model)), problem_id, stream.prompt_tokens, tps, events, (), meta
        )
        with self.lock:
            save_traces([trace], self.path, append=True)
