"""Chrome Trace Event JSON (opens in ui.perfetto.dev and chrome://tracing).

Convention: rank = ``pid``, stream (compute, comm, ...) = ``tid``; times are given in seconds and
written in microseconds, as the format expects. Names of ranks and streams are written as
``"ph": "M"`` metadata events so the viewer labels the rows.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

__all__ = ["Span", "Trace", "load_trace"]


@dataclass(frozen=True, kw_only=True, slots=True)
class Span:
    name: str
    start: float
    """Seconds."""
    duration: float
    """Seconds."""
    rank: int = 0
    stream: str = "compute"
    category: str = ""
    args: dict[str, Any] = field(default_factory=dict)

    @property
    def end(self) -> float:
        return self.start + self.duration


class Trace:
    """Collects spans; ``write`` produces one Chrome-trace JSON file."""

    def __init__(self) -> None:
        self.spans: list[Span] = []
        self._rank_names: dict[int, str] = {}

    def add(
        self,
        name: str,
        start: float,
        duration: float,
        *,
        rank: int = 0,
        stream: str = "compute",
        category: str = "",
        **args: Any,
    ) -> Span:
        if not (math.isfinite(start) and math.isfinite(duration)):
            # JSON has no NaN or infinity: the viewer would refuse the whole file
            raise ValueError(f"span {name!r}: start {start} and duration {duration} must be finite seconds")
        if duration < 0:
            raise ValueError(f"span {name!r} has negative duration {duration}")
        span = Span(
            name=name, start=start, duration=duration, rank=rank, stream=stream, category=category, args=args
        )
        self.spans.append(span)
        return span

    def name_rank(self, rank: int, name: str) -> None:
        self._rank_names[rank] = name

    def to_json(self) -> dict[str, Any]:
        streams: dict[tuple[int, str], int] = {}
        events: list[dict[str, Any]] = []
        for span in sorted(self.spans, key=lambda s: (s.rank, s.start)):
            tid = streams.setdefault((span.rank, span.stream), len(streams))
            events.append(
                {
                    "name": span.name,
                    "cat": span.category or span.stream,
                    "ph": "X",
                    "pid": span.rank,
                    "tid": tid,
                    "ts": span.start * 1e6,
                    "dur": span.duration * 1e6,
                    "args": span.args,
                }
            )
        meta: list[dict[str, Any]] = []
        for rank in sorted({s.rank for s in self.spans}):
            meta.append(
                {
                    "name": "process_name",
                    "ph": "M",
                    "pid": rank,
                    "args": {"name": self._rank_names.get(rank, f"rank {rank}")},
                }
            )
        for (rank, stream), tid in streams.items():
            meta.append({"name": "thread_name", "ph": "M", "pid": rank, "tid": tid, "args": {"name": stream}})
        return {"traceEvents": meta + events, "displayTimeUnit": "ms"}

    def write(self, path: str | Path) -> Path:
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        # numpy scalars, paths and the like in span args are written as their text rather than failing here
        path.write_text(json.dumps(_finite(self.to_json()), default=_as_text, allow_nan=False))
        return path


def _finite(obj: Any) -> Any:
    """JSON has no NaN or infinity: a non-finite float in span args is written as null."""
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if isinstance(obj, dict):
        return {k: _finite(v) for k, v in obj.items()}
    if isinstance(obj, list | tuple):
        return [_finite(v) for v in obj]
    return obj


def _as_text(value: Any) -> Any:
    item = getattr(value, "item", None)  # numpy and torch scalars
    if callable(item):
        try:
            out = item()
        except Exception:  # a tensor of several elements, say
            return str(value)
        return _finite(out)
    return str(value)


def load_trace(path: str | Path) -> Trace:
    """Read back a trace written by ``Trace.write`` (complete events only)."""
    data = json.loads(Path(path).read_text())
    if "traceEvents" not in data:
        raise ValueError(f"{path}: not a Chrome trace (no 'traceEvents' key)")
    names: dict[tuple[int, int], str] = {}
    trace = Trace()
    for ev in data["traceEvents"]:
        if ev.get("ph") == "M" and ev.get("name") == "thread_name":
            names[(ev["pid"], ev["tid"])] = ev["args"]["name"]
        elif ev.get("ph") == "M" and ev.get("name") == "process_name":
            trace._rank_names[ev["pid"]] = ev["args"]["name"]
    for ev in data["traceEvents"]:
        if ev.get("ph") == "X":
            # built directly, not through add(): args may hold keys named like add's own (PyTorch profiler
            # kernel events carry "stream")
            trace.spans.append(
                Span(
                    name=ev["name"],
                    start=ev["ts"] / 1e6,
                    duration=ev.get("dur", 0.0) / 1e6,
                    rank=ev["pid"],
                    stream=names.get((ev["pid"], ev["tid"]), str(ev["tid"])),
                    category=ev.get("cat", ""),
                    args=dict(ev.get("args", {})),
                )
            )
    return trace
