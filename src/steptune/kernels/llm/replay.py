"""A loopback OpenAI-compatible server that replays reasoning traces in real time (scripted LLM backend).

Contract: `serve_replay(traces, speed=10)` starts a real HTTP server (Starlette app under uvicorn, in a
daemon thread, on 127.0.0.1 with a kernel-chosen port, so parallel tests never race for ports) and returns a
`ReplayServer`; use it as a context manager or call `close()`. `base_url` ends in `/v1`, so the official
`openai` client and `LLMClient` work against it unchanged. Endpoints: `GET /v1/models`,
`POST /v1/chat/completions` and `POST /v1/completions` (streaming or not), `POST /tokenize`,
`POST /detokenize`, `GET /health`.

What it replays (details in `_replay_app.py` and `_plan.py`):

- Trace choice: traces whose `model` equals the request's `model` (all traces if none does), narrowed to
  `metadata.problem_id` when the request sends one (404 when no trace has it), then round-robin per
  (model, problem_id).
- Chat: the trace's reasoning in `delta.reasoning_content` (or `delta.reasoning`, `reasoning_field`), then
  its content, each delta at the trace's time x 1/speed. Raw completions: reasoning, `\\n</think>\\n\\n`,
  content, all as text, as a server without a reasoning parser sends it.
- Forks: a completion whose prompt contains at least the first 32 characters of some trace's reasoning is a
  fork from the longest matching prefix (N characters); it streams that trace's fork reply with the largest
  `at_chars <= N` (else `ReplayConfig.fork_default`) at the trace's decode rate.
- `stop` (completions) and `max_tokens` are honoured; a missing `max_tokens` means no limit. During gaps
  longer than `keepalive_s` it sends `: keep-alive` comments; it ends with a usage chunk when
  `stream_options.include_usage` and then `data: [DONE]`.
- Tokens are a toy tokenizer's (`_tokens.py`; ids mean something only to the server that issued them),
  shared by `/tokenize`, `token_ids` (`return_token_ids=true`) and a vLLM-like block prefix cache whose hits
  are reported as `usage.prompt_tokens_details.cached_tokens`. With `prefill_tps`, uncached prompt tokens
  delay the first token.
- A stream whose client disconnects before the end is counted `aborted`; the server sees the real TCP
  disconnect. `close()` cuts streams still running (also counted aborted) rather than waiting for them.
  `stats` is a consistent snapshot readable from any thread; `wait_idle()` waits for every started request
  to end.
"""

from __future__ import annotations

import dataclasses
import socket
import threading
import time
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any, Literal

from .trace import Trace

__all__ = ["ReplayConfig", "ReplayServer", "ReplayStats", "RequestRecord", "serve_replay"]


@dataclass(frozen=True, slots=True, kw_only=True)
class ReplayConfig:
    speed: float = 1.0
    """Replay rate: trace time is divided by it (10 plays ten times faster)."""
    keepalive_s: float = 15.0
    """Send a `: keep-alive` SSE comment when nothing was sent for this long (wall seconds)."""
    reasoning_field: Literal["reasoning_content", "reasoning"] = "reasoning_content"
    """Delta field carrying chat reasoning; vLLM renamed it to `reasoning` in 0.11."""
    block_size: int = 16
    """Prefix-cache block size in tokens."""
    cache_capacity_tokens: int = 1 << 20
    """Prefix-cache capacity in tokens; least recently used blocks go first."""
    prefill_tps: float | None = None
    """Prompt tokens per second not served from cache, delaying the first token; None for no delay."""
    fork_default: str = "pass\n```\n"
    """Fork reply when the prefix is shorter than every recorded fork point."""
    host: str = "127.0.0.1"

    def __post_init__(self) -> None:
        if self.speed <= 0 or self.keepalive_s <= 0:
            raise ValueError(f"speed and keepalive_s must be > 0, got {self.speed}, {self.keepalive_s}")


@dataclass(frozen=True, slots=True)
class RequestRecord:
    """One request as the server saw it."""

    id: int
    endpoint: Literal["chat", "completion"]
    stream: bool
    model: str
    problem_id: str
    """The replayed trace's problem id."""
    fork: bool
    prompt_tokens: int
    cached_tokens: int
    generated_tokens: int
    """Tokens generated before the end or the abort."""
    status: Literal["running", "completed", "aborted"]
    start_s: float
    """`time.monotonic()` at arrival."""
    end_s: float | None


@dataclass(frozen=True, slots=True)
class ReplayStats:
    requests: int
    completed: int
    aborted: int
    prompt_tokens: int
    cached_tokens: int
    generated_tokens: int
    records: tuple[RequestRecord, ...]

    @property
    def running(self) -> int:
        return self.requests - self.completed - self.aborted

    @staticmethod
    def of(records: Iterable[RequestRecord]) -> ReplayStats:
        rs = tuple(records)
        return ReplayStats(
            requests=len(rs),
            completed=sum(r.status == "completed" for r in rs),
            aborted=sum(r.status == "aborted" for r in rs),
            prompt_tokens=sum(r.prompt_tokens for r in rs),
            cached_tokens=sum(r.cached_tokens for r in rs),
            generated_tokens=sum(r.generated_tokens for r in rs),
            records=rs,
        )


class ReplayServer:
    """A running replay server; see the module docstring."""

    def __init__(self, traces: Iterable[Trace], config: ReplayConfig) -> None:
        import uvicorn

        from ._replay_app import ReplayApp

        self.config = config
        self._app = ReplayApp(list(traces), config)
        # Binding here (port 0) and handing uvicorn the socket leaves no window for another process.
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.bind((config.host, 0))
        self.port: int = sock.getsockname()[1]
        uv_config = uvicorn.Config(
            self._app.asgi(),
            log_config=None,  # leave the host program's logging alone
            log_level="warning",
            access_log=False,
            lifespan="off",
            http="h11",
            ws="none",
            loop="asyncio",
            timeout_graceful_shutdown=1,
        )
        self._server = uvicorn.Server(uv_config)
        self._thread = threading.Thread(
            target=self._server.run, kwargs={"sockets": [sock]}, name=f"replay-{self.port}", daemon=True
        )
        self._thread.start()
        deadline = time.monotonic() + 20.0
        while not self._server.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                self.close()
                raise RuntimeError(f"replay server on port {self.port} did not start")
            time.sleep(0.005)

    @property
    def base_url(self) -> str:
        return f"http://{self.config.host}:{self.port}/v1"

    @property
    def stats(self) -> ReplayStats:
        return ReplayStats.of(self._app.snapshot())

    def wait_idle(self, timeout_s: float = 10.0) -> ReplayStats:
        """Wait until every started request has completed or been seen aborted; returns the stats."""
        deadline = time.monotonic() + timeout_s
        while (stats := self.stats).running:
            if time.monotonic() > deadline:
                raise TimeoutError(f"{stats.running} replay request(s) still running after {timeout_s} s")
            time.sleep(0.01)
        return stats

    def close(self) -> None:
        """Stop: streams still running are cut (and counted aborted), then the thread is joined."""
        self._app.request_stop()
        self._server.should_exit = True
        if self._thread.is_alive() and threading.current_thread() is not self._thread:
            self._thread.join(timeout=10.0)

    def __enter__(self) -> ReplayServer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def serve_replay(
    traces: Iterable[Trace], config: ReplayConfig | None = None, **overrides: Any
) -> ReplayServer:
    """Start a replay server; keyword overrides replace `config` fields (`speed=10`, `keepalive_s=0.5`)."""
    config = dataclasses.replace(config or ReplayConfig(), **overrides)
    return ReplayServer(traces, config)
