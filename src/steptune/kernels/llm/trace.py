"""Reasoning-trace format (JSONL), load/save, and a synthetic trace generator.

A file holds one or more traces. Each starts with a header line
`{"kind": "header", "model", "problem_id", "prompt_tokens", "decode_tps", ...}` (other keys are kept in
`Trace.meta`), followed by its lines in any order:

- events `{"t": seconds_from_request, "kind": "reasoning" | "content", "text": ..., "token_ids": [...]?}`,
  kept in file order (which must be time order);
- fork replies `{"kind": "fork", "at_chars": N, "text": ...}`: what a non-reasoning generation forked from
  the first N characters of the reasoning returns (the code after the opening fence, closing fence included).

The recorder in `client.py` writes this format, so a recorded stream replays through `replay.py`.
`synth_trace` is synthetic by construction (labelled `"synthetic": true` in `meta`): its text is made of
stock phrases, its timing is exact (an event arrives with its last token; token k, counted in toy-tokenizer
tokens, arrives at `ttft_s + (k - 1) / decode_tps`), and the same arguments always give the same trace.
"""

from __future__ import annotations

import json
import random
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from ._tokens import THINK_CLOSE, split_tokens

__all__ = ["ForkReply", "Trace", "TraceEvent", "load_traces", "save_traces", "synth_trace"]

Kind = Literal["reasoning", "content"]


@dataclass(frozen=True, slots=True)
class TraceEvent:
    """One streamed delta."""

    t: float
    """Seconds from the request to this delta's arrival."""
    kind: Kind
    text: str
    token_ids: tuple[int, ...] | None = None
    """Ids as the recording server sent them; only meaningful to that server's tokenizer."""


@dataclass(frozen=True, slots=True)
class ForkReply:
    """What a fork from the first `at_chars` reasoning characters generates."""

    at_chars: int
    text: str


@dataclass(frozen=True, slots=True)
class Trace:
    """One recorded or synthetic generation."""

    model: str
    problem_id: str
    prompt_tokens: int
    decode_tps: float
    events: tuple[TraceEvent, ...]
    forks: tuple[ForkReply, ...] = ()
    meta: Mapping[str, Any] = field(default_factory=dict, compare=False)
    """Other header keys (recording details, synthesis parameters)."""

    @property
    def reasoning(self) -> str:
        return "".join(e.text for e in self.events if e.kind == "reasoning")

    @property
    def content(self) -> str:
        return "".join(e.text for e in self.events if e.kind == "content")

    @property
    def duration_s(self) -> float:
        return self.events[-1].t if self.events else 0.0

    def fork_reply(self, prefix_chars: int) -> ForkReply | None:
        """The fork reply with the largest `at_chars <= prefix_chars`, or None."""
        best = None
        for fork in self.forks:
            if fork.at_chars <= prefix_chars and (best is None or fork.at_chars >= best.at_chars):
                best = fork
        return best

    def to_lines(self) -> list[str]:
        header = {
            "kind": "header",
            "model": self.model,
            "problem_id": self.problem_id,
            "prompt_tokens": self.prompt_tokens,
            "decode_tps": self.decode_tps,
            **{k: v for k, v in self.meta.items() if k not in _HEADER_KEYS},
        }
        lines = [json.dumps(header)]
        for e in self.events:
            row: dict[str, Any] = {"t": round(e.t, 6), "kind": e.kind, "text": e.text}
            if e.token_ids is not None:
                row["token_ids"] = list(e.token_ids)
            lines.append(json.dumps(row))
        lines += [json.dumps({"kind": "fork", "at_chars": f.at_chars, "text": f.text}) for f in self.forks]
        return lines


_HEADER_KEYS = frozenset({"kind", "model", "problem_id", "prompt_tokens", "decode_tps"})


def _parse(lines: Iterable[str], source: str) -> list[Trace]:
    traces: list[Trace] = []
    header: dict[str, Any] | None = None
    events: list[TraceEvent] = []
    forks: list[ForkReply] = []

    def close() -> None:
        if header is not None:
            meta = {k: v for k, v in header.items() if k not in _HEADER_KEYS}
            traces.append(
                Trace(
                    model=str(header.get("model", "")),
                    problem_id=str(header.get("problem_id", "")),
                    prompt_tokens=int(header.get("prompt_tokens", 0)),
                    decode_tps=float(header.get("decode_tps", 0.0)),
                    events=tuple(events),
                    forks=tuple(forks),
                    meta=meta,
                )
            )

    for num, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
            kind = row["kind"]
            if kind == "header":
                close()
                header, events, forks = row, [], []
                continue
            if header is None:
                raise ValueError("a trace must start with a header line")
            if kind == "fork":
                forks.append(ForkReply(int(row["at_chars"]), str(row["text"])))
            elif kind in ("reasoning", "content"):
                ids = row.get("token_ids")
                events.append(
                    TraceEvent(float(row["t"]), kind, str(row["text"]), tuple(ids) if ids else None)
                )
            else:
                raise ValueError(f"unknown kind {kind!r}")
        except (ValueError, KeyError, TypeError) as err:
            raise ValueError(f"{source}:{num}: bad trace line ({err}): {line[:120]!r}") from None
    close()
    return traces


def load_traces(path: str | Path) -> list[Trace]:
    """Every trace in a JSONL file, in file order."""
    path = Path(path)
    with path.open(encoding="utf-8") as f:
        return _parse(f, str(path))


def save_traces(traces: Iterable[Trace], path: str | Path, *, append: bool = False) -> Path:
    """Write traces as JSONL (appending when asked); returns the path."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("a" if append else "w", encoding="utf-8") as f:
        for trace in traces:
            f.write("\n".join(trace.to_lines()) + "\n")
    return path


# --- synthesis ---------------------------------------------------------------------------------------

_OPENERS = (
    "Okay, so I need to write a faster version of this model.",
    "Alright, let me look at what the reference computes.",
    "Let me start by reading the reference implementation carefully.",
)
_FILLER = (
    " The reference launches one kernel per op, so every intermediate goes through memory.",
    " The input is contiguous and the last dim is the reduction dim, so rows are independent.",
    " Each row fits in cache, which means one pass over the data should be enough.",
    " The tolerance is 1e-4 in fp32, so the reduction order matters a little but not much.",
    " I should keep the numerics stable by subtracting the row max before the exponential.",
    " Memory bandwidth is the bottleneck here, not arithmetic.",
    " A fused loop reads the input once and writes the output once.",
    " The shapes come from get_inputs, so I can specialize on them but should not hard-code them.",
    " Vectorizing the inner loop helps if the compiler can prove there is no aliasing.",
    " The backward pass is not needed, only the forward.",
)
_PLANS = (
    "So the plan is: fuse everything into a single pass over each row.",
    "So the plan is to write one kernel that does the whole computation in registers.",
    "Let me outline the kernel before writing it.",
)
_REFLECTIONS = (
    "Wait, is the input always contiguous? I should check the strides before assuming it.",
    "Hmm, that might overflow for large inputs, so the max has to be subtracted first.",
    "Alternatively, I could split each row across threads and combine partial results.",
    "But wait, the reduction needs a second pass for the normalization.",
    "Let me verify that the output shape matches the reference.",
    "Wait, does this handle the case where the row length is not a multiple of the vector width?",
)
_DRAFT_LEADS = ("Let me write the kernel:", "Here is a first draft:", "Let me write this out:")
_DEFAULT_CODE = (
    "import torch\n\n\nclass ModelNew(torch.nn.Module):\n"
    "    def forward(self, x):\n        return torch.relu(x)\n"
)


def synth_trace(
    seed: int,
    *,
    reasoning_tokens: int = 2000,
    decode_tps: float = 40.0,
    drafts: Sequence[str] = (),
    final_code: str | None = None,
    model: str = "synth-reasoner",
    problem_id: str = "synthetic",
    prompt_tokens: int = 600,
    ttft_s: float = 0.5,
    tokens_per_event: int = 4,
) -> Trace:
    """A synthetic kernel-writing reasoning trace; see the module docstring.

    Reasoning is plan paragraphs, filler and reflection cues after blank lines (`\\n\\nWait,`), with each
    code draft placed, fenced as ```python, at an increasing fraction of the reasoning. The content is a short
    answer with `final_code` (default: the last draft) in a code block. A fork reply is recorded at the
    start of each draft's lead-in paragraph (returning that draft) and at the end of the reasoning
    (returning `final_code`).
    """
    if reasoning_tokens < 1 or decode_tps <= 0 or tokens_per_event < 1:
        raise ValueError("need reasoning_tokens >= 1, decode_tps > 0 and tokens_per_event >= 1")
    rng = random.Random(seed)
    final = final_code if final_code is not None else (drafts[-1] if drafts else _DEFAULT_CODE)
    draft_at = sorted(rng.uniform(0.25, 0.9) for _ in drafts)
    parts: list[str] = [rng.choice(_OPENERS)]
    used = len(split_tokens(parts[0]))
    forks: list[ForkReply] = []
    next_draft = 0
    after_draft = False
    while used < reasoning_tokens:
        if next_draft < len(drafts) and used >= draft_at[next_draft] * reasoning_tokens:
            code = drafts[next_draft].rstrip("\n") + "\n"
            forks.append(ForkReply(len("".join(parts)), code + "```\n"))
            para = f"\n\n{rng.choice(_PLANS)} {rng.choice(_DRAFT_LEADS)}\n\n```python\n{code}```"
            next_draft += 1
        elif after_draft or rng.random() < 0.25:
            para = "\n\n" + rng.choice(_REFLECTIONS)
        elif rng.random() < 0.2:
            para = "\n\n" + rng.choice(_PLANS)
        else:
            para = rng.choice(_FILLER)
        after_draft = para.endswith("```")
        parts.append(para)
        used += len(split_tokens(para))
    reasoning = "".join(parts)
    forks.append(ForkReply(len(reasoning), final.rstrip("\n") + "\n```\n"))
    content = f"Here is the optimized implementation:\n\n```python\n{final.rstrip(chr(10))}\n```\n"

    events: list[TraceEvent] = []
    done = 0
    for kind, text in (("reasoning", reasoning), ("content", content)):
        if kind == "content":
            done += len(split_tokens(THINK_CLOSE))  # generated, never streamed in chat
        pieces = split_tokens(text)
        for i in range(0, len(pieces), tokens_per_event):
            chunk = pieces[i : i + tokens_per_event]
            done += len(chunk)
            t = round(ttft_s + (done - 1) / decode_tps, 6)
            events.append(TraceEvent(t, kind, "".join(chunk)))  # type: ignore[arg-type]
    meta = {"synthetic": True, "seed": seed, "reasoning_tokens": len(split_tokens(reasoning))}
    return Trace(model, problem_id, prompt_tokens, decode_tps, tuple(events), tuple(forks), meta)
