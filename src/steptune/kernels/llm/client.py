"""Async streaming client for OpenAI-compatible servers (vLLM, SGLang, the replay server), with forks.

Contract: every `stream_*` call and `fork` sends the request, raises `LLMHTTPError` (status code and the
server's message) on an HTTP error, and returns a `Stream` to iterate once with `async for`, yielding
`Chunk(kind, text, token_ids, t)` where `t` is seconds since the request was sent. Reasoning arrives in
`delta.reasoning_content` or `delta.reasoning` (servers use either name); raw completions may carry it inline
between `<think>`/`</think>`, split only with `think_tags=True`. `Stream.aclose()` closes the HTTP response,
which aborts generation on vLLM and SGLang (they abort on disconnect); a stream closed before the server's
end is marked `aborted`.

Token counts come from the server's final usage chunk (requested by default with
`stream_options={"include_usage": true}`); without one, `completion_tokens` falls back to the number of
received token ids, else of received chunks (vLLM sends about one token per chunk), `prompt_tokens` to the
received prompt ids, and `cached_tokens` to 0. These fallbacks are approximations.

With `record_to=path`, each stream is appended, when it ends, to that JSONL file in the `trace.py` format
(one header plus its chunks, written in one call so concurrent streams never interleave).
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ._stream import Chunk, LLMHTTPError, LLMStreamError, Recorder, Stream, StreamRequest, error_message
from ._think import ThinkSplitter

if TYPE_CHECKING:
    import httpx

__all__ = ["FORK_SUFFIX", "Chunk", "LLMClient", "LLMHTTPError", "LLMStreamError", "Stream", "TokenizeResult"]

FORK_SUFFIX = "\n</think>\n\n```python\n"
"""Closes the partial thought and opens a code block, so a fork writes code straight away."""


_NOT_STREAMS = ("application/json", "text/html")
"""Content types of answers that are not event streams (a whole completion, an error or proxy page)."""


@dataclass(frozen=True, slots=True)
class TokenizeResult:
    """`POST /tokenize`'s answer: ids, and their text pieces when asked for."""

    tokens: tuple[int, ...]
    token_strs: tuple[str, ...] | None = None


class LLMClient:
    """Async client for one model on one OpenAI-compatible server; `base_url` ends in `/v1`."""

    def __init__(
        self,
        base_url: str,
        model: str,
        *,
        api_key: str | None = None,
        timeout_s: float = 600.0,
        record_to: str | Path | None = None,
        transport: httpx.AsyncBaseTransport | None = None,
    ) -> None:
        import httpx

        self.base_url = base_url.rstrip("/")
        self.model = model
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        timeout = httpx.Timeout(timeout_s, connect=min(timeout_s, 30.0))
        self._http = httpx.AsyncClient(headers=headers, timeout=timeout, transport=transport)
        self._recorder = Recorder(Path(record_to), model) if record_to is not None else None
        self._suffix_ids: dict[str, tuple[int, ...]] = {}

    async def __aenter__(self) -> LLMClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        await self._http.aclose()

    async def stream_chat(self, messages: Sequence[Mapping[str, Any]], **params: Any) -> Stream:
        """Stream a chat completion; `params` go into the request body (`max_tokens`, `metadata`, ...)."""
        body = {"model": self.model, "messages": list(messages), **params}
        return await self._stream("/chat/completions", StreamRequest("chat", body, self._recorder), None)

    async def stream_completion(
        self, prompt: str | Sequence[int], *, think_tags: bool = False, **params: Any
    ) -> Stream:
        """Stream a raw completion. With `think_tags`, text between `<think>`/`</think>` becomes reasoning;
        the output starts inside the thought when a text prompt ends with an open `<think>`."""
        return await self._complete(prompt, params, think_tags=think_tags, fork=False)

    async def fork(
        self,
        prefix: str | Sequence[int],
        *,
        suffix: str = FORK_SUFFIX,
        suffix_ids: Sequence[int] | None = None,
        max_tokens: int = 4096,
        stop: Sequence[str] = ("```",),
        temperature: float = 0.0,
        **params: Any,
    ) -> Stream:
        """A non-reasoning completion from a partial reasoning prefix (Dynasor-style raw completion).

        `prefix` is the rendered prompt plus the reasoning so far: text, or token ids (exact prefix-cache
        hits; then `suffix` is tokenized by the server once, unless `suffix_ids` is given).
        """
        prompt: str | list[int]
        if isinstance(prefix, str):
            prompt = prefix + suffix
        else:
            if suffix_ids is None:
                if suffix not in self._suffix_ids:
                    self._suffix_ids[suffix] = (await self.tokenize(suffix)).tokens
                suffix_ids = self._suffix_ids[suffix]
            prompt = [*prefix, *suffix_ids]
        params |= {"max_tokens": max_tokens, "stop": list(stop), "temperature": temperature}
        return await self._complete(prompt, params, think_tags=False, fork=True)

    async def tokenize(
        self,
        prompt: str | None = None,
        *,
        messages: Sequence[Mapping[str, Any]] | None = None,
        add_generation_prompt: bool = True,
        return_token_strs: bool = False,
    ) -> TokenizeResult:
        """vLLM's `POST /tokenize` (served at the root, not under `/v1`): text, or chat messages rendered
        with the server's template."""
        body: dict[str, Any] = {"model": self.model, "return_token_strs": return_token_strs}
        if messages is not None:
            body |= {"messages": list(messages), "add_generation_prompt": add_generation_prompt}
        else:
            body["prompt"] = prompt or ""
        root = self.base_url.removesuffix("/v1")
        response = await self._http.post(root + "/tokenize", json=body)
        if response.status_code >= 400:
            raise LLMHTTPError(response.status_code, error_message(response.content), str(response.url))
        data = response.json()
        strs = data.get("token_strs")
        return TokenizeResult(tuple(data["tokens"]), tuple(strs) if strs is not None else None)

    async def _complete(
        self, prompt: str | Sequence[int], params: dict[str, Any], *, think_tags: bool, fork: bool
    ) -> Stream:
        body = {"model": self.model, "prompt": prompt if isinstance(prompt, str) else list(prompt), **params}
        think = None
        if think_tags:
            opened = isinstance(prompt, str) and prompt.rstrip().endswith("<think>")
            think = ThinkSplitter(in_reasoning=opened)
        request = StreamRequest("completion", body, self._recorder, fork=fork)
        return await self._stream("/completions", request, think)

    async def _stream(self, path: str, request: StreamRequest, think: ThinkSplitter | None) -> Stream:
        request.body["stream"] = True
        request.body.setdefault("stream_options", {"include_usage": True})
        started = time.monotonic()
        req = self._http.build_request("POST", self.base_url + path, json=request.body)
        response = await self._http.send(req, stream=True)
        if response.status_code >= 400:
            body = await response.aread()
            await response.aclose()
            raise LLMHTTPError(response.status_code, error_message(body), str(req.url))
        media = response.headers.get("content-type", "").split(";")[0].strip().lower()
        if media in _NOT_STREAMS:  # a server or proxy that ignored "stream": true (other types: see Stream)
            body = await response.aread()
            await response.aclose()
            raise LLMStreamError(
                f"POST {req.url} answered {media}, not an event stream (text/event-stream): the server "
                f'ignored "stream": true (body {body[:200].decode("utf-8", "replace")!r}). Point --llm-url '
                "at a server that streams chat completions (vLLM, SGLang)"
            )
        return Stream(response, request, started, think)
