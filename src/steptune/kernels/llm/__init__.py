"""LLM access for SpecGen: a streaming OpenAI-compatible client with forks, traces, and a replay server.

- `LLMClient`: async streaming chat and raw completions, `fork` from a partial reasoning prefix, `tokenize`,
  optional recording to a trace file (`client.py`).
- `Trace`, `synth_trace`, `load_traces`, `save_traces`: the JSONL trace format (`trace.py`).
- `serve_replay`: a loopback HTTP server that replays traces in real time x speed, for tests and the
  CPU lane (`replay.py`).

Importing this package imports none of httpx, starlette, uvicorn or openai; they load on first use.
"""

from .client import FORK_SUFFIX, Chunk, LLMClient, LLMHTTPError, LLMStreamError, Stream, TokenizeResult
from .replay import ReplayConfig, ReplayServer, ReplayStats, RequestRecord, serve_replay
from .sse import SSEDecodeError
from .trace import ForkReply, Trace, TraceEvent, load_traces, save_traces, synth_trace

__all__ = [
    "FORK_SUFFIX",
    "Chunk",
    "ForkReply",
    "LLMClient",
    "LLMHTTPError",
    "LLMStreamError",
    "ReplayConfig",
    "ReplayServer",
    "ReplayStats",
    "RequestRecord",
    "SSEDecodeError",
    "Stream",
    "TokenizeResult",
    "Trace",
    "TraceEvent",
    "load_traces",
    "save_traces",
    "serve_replay",
    "synth_trace",
]
