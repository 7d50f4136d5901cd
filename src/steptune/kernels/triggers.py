"""Trigger points in a streaming reasoning trace: where SpecGen forks a non-reasoning generation.

Contract: `TriggerDetector.feed` takes the whole reasoning text so far (it only grows within a stream;
`reset()` starts a new one) and returns the triggers that became decidable since the last call, in order of
position. It scans each character a bounded number of times (the new part, plus the first characters of a
paragraph while they could still begin a reflection cue), so a stream costs O(its length) whatever the
chunking. A trigger's `chars` is where to cut: the fork prefix is `reasoning[:chars]`. Four kinds:

- `draft`: a complete fenced block defining `ModelNew` (a free candidate: no fork). Deduplicated by
  `normalized_hash`; exempt from the spacing and the cap; cut after the closing fence.
- `plan`: the paragraph holding an end-of-plan phrase ended (cut before its closing "\\n\\n").
- `reflection`: a paragraph opens with a reflection cue ("Wait", "Hmm", ...): cut before the "\\n\\n" that
  precedes it, so the fork answers before the model second-guesses.
- `periodic`: `periodic_tokens` tokens passed without any reported trigger (cut at the end of the last
  complete line).

Positions come from the text alone, so drafts, plans and reflections do not depend on the chunking.
Tokens do: a trigger carries `tokens_so_far` of the call that reported it, and the spacing rule
(`min_gap_tokens`, measured from the last fork trigger that was not suppressed; the stream start counts as
one) and the periodic clock (restarted by every reported trigger) use that count. Fork triggers are not
reported while the reasoning is inside an open code fence (the draft being written is a better candidate).
A fork trigger is reported with `suppressed=True` when `outstanding` plus the forks fired earlier in the
same call reaches `max_outstanding`. Fences count only at the start of a line (after optional indentation);
a paragraph break is exactly "\\n\\n". Cues and phrases match case-insensitively; a cue must end at a word
boundary ("Waiting" is not "Wait").
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Literal

from steptune.kernels.extract import code_blocks, normalized_hash

__all__ = ["Trigger", "TriggerConfig", "TriggerDetector", "TriggerKind"]

TriggerKind = Literal["draft", "plan", "reflection", "periodic"]
_KINDS: tuple[TriggerKind, ...] = ("draft", "plan", "reflection", "periodic")
_OUTCOMES = ("fired", "suppressed", "too_close", "duplicate")

_EVENT = re.compile(r"```|\n\n")


@dataclass(frozen=True, slots=True, kw_only=True)
class TriggerConfig:
    """Which points of a reasoning trace trigger a fork, and how densely."""

    code_drafts: bool = True
    """Report complete fenced code blocks defining ModelNew inside the reasoning (free candidates)."""
    plan_phrases: tuple[str, ...] = (
        "So the plan is",
        "Here's the plan",
        "Here is the plan",
        "Let me write the kernel",
        "Let me write the code",
        "Now I'll write",
        "Now let me write",
        "Putting it together",
        "Putting it all together",
    )
    """End-of-plan phrases: fork when the paragraph holding one ends."""
    reflection_cues: tuple[str, ...] = (
        "Wait",
        "But wait",
        "Hmm",
        "Alternatively",
        "Let me verify",
        "Let me double-check",
        "Actually",
        "Hold on",
    )
    """Cues that open a paragraph when the model second-guesses: fork at the paragraph break before one."""
    periodic_tokens: int = 1500
    """Fallback: fork after this many tokens without another trigger; 0 disables."""
    min_gap_tokens: int = 300
    """Minimum spacing in tokens between fork triggers (drafts are exempt)."""
    max_outstanding: int = 4
    """Forks in flight at most; a trigger beyond this is reported as suppressed (0: observe only)."""

    def __post_init__(self) -> None:
        if self.min_gap_tokens < 0:
            raise ValueError(f"min_gap_tokens is {self.min_gap_tokens}: use 0 (no spacing) or more")
        if self.periodic_tokens < 0:
            raise ValueError(
                f"periodic_tokens is {self.periodic_tokens}: use 0 (disabled) or a positive count"
            )
        if 0 < self.periodic_tokens < self.min_gap_tokens:
            raise ValueError(
                f"periodic_tokens ({self.periodic_tokens}) is below min_gap_tokens ({self.min_gap_tokens}): "
                "raise periodic_tokens, lower min_gap_tokens, or set periodic_tokens=0 to disable it"
            )
        if self.max_outstanding < 0:
            raise ValueError(f"max_outstanding is {self.max_outstanding}: use 0 (observe only) or more")
        for name, texts in (("plan_phrases", self.plan_phrases), ("reflection_cues", self.reflection_cues)):
            if not isinstance(texts, tuple):
                raise ValueError(f"{name} must be a tuple of strings, not {type(texts).__name__}")
            for text in texts:
                if not text.strip() or "\n" in text:
                    raise ValueError(f"{name} holds {text!r}: each must be non-empty text on one line")


@dataclass(frozen=True, slots=True)
class Trigger:
    """A point to fork from (or, for a draft, a candidate found in the reasoning itself)."""

    kind: TriggerKind
    chars: int
    """The fork prefix is `reasoning[:chars]`."""
    tokens: int
    """The caller's token count when the trigger was reported."""
    now: float
    code: str | None = None
    """The draft's code (drafts only)."""
    suppressed: bool = False
    """The outstanding-fork cap was reached: report only, do not fork."""


@dataclass(slots=True)
class _State:
    cursor: int = 0  # everything before it is processed, except an undecided paragraph break at it
    tokens: int = 0
    para_start: int = 0
    fence_open: int | None = None  # position of the opening fence while inside a code block
    line_end: int = 0  # end of the last complete line processed, trailing newlines excluded
    last_chars: int = 0  # position of the last reported trigger
    last_fork_tokens: int = 0  # tokens at the last fired fork; the stream start counts as one
    periodic_anchor: int = 0  # tokens at the last reported trigger of any kind
    seen: set[str] = field(default_factory=set)


class TriggerDetector:
    """Incremental trigger detection over one reasoning stream at a time (see the module docstring)."""

    def __init__(self, config: TriggerConfig | None = None) -> None:
        self.config = config if config is not None else TriggerConfig()
        self._plans = tuple(p.lower() for p in self.config.plan_phrases)
        self._cues = tuple(c.lower() for c in self.config.reflection_cues)
        self._cue_initials = frozenset(c[0] for c in self._cues)
        self._counts = {kind: dict.fromkeys(_OUTCOMES, 0) for kind in _KINDS}
        self._s = _State()

    def reset(self) -> None:
        """Forget the stream (the counters are kept: they cover every stream since construction)."""
        self._s = _State()

    def stats(self) -> dict[str, dict[str, int]]:
        """Per kind: fired, suppressed, too_close (dropped by the spacing rule), duplicate (drafts)."""
        return {kind: dict(outcomes) for kind, outcomes in self._counts.items()}

    def feed(self, reasoning_so_far: str, tokens_so_far: int, now: float, outstanding: int) -> list[Trigger]:
        """Triggers decidable in the text so far and not reported before, in order of position."""
        s = self._s
        if len(reasoning_so_far) < s.cursor:
            raise ValueError(
                f"the reasoning shrank from at least {s.cursor} to {len(reasoning_so_far)} characters: "
                "pass the whole text so far, and call reset() before a new stream"
            )
        if tokens_so_far < s.tokens:
            raise ValueError(
                f"tokens_so_far went back from {s.tokens} to {tokens_so_far}: pass the running total"
            )
        s.tokens = tokens_so_far
        out: list[Trigger] = []
        self._scan(reasoning_so_far, now, outstanding, out)
        self._periodic(now, outstanding, out)
        return out

    # Scanning: fences and paragraph breaks in order of position.

    def _scan(self, text: str, now: float, outstanding: int, out: list[Trigger]) -> None:
        s, n = self._s, len(text)
        start = s.cursor
        while True:
            m = _EVENT.search(text, s.cursor)
            if m is None:
                s.cursor = max(s.cursor, n - 2)  # a fence or break may straddle the end of this chunk
                break
            p = m.start()
            if m.group() == "```":
                if self._at_line_start(text, p):
                    self._fence(text, p, now, out)
                s.cursor = p + 3
            else:
                if not self._break(text, p, now, outstanding, out):
                    s.cursor = p  # decide this break when enough of the next paragraph has arrived
                    break
                s.cursor = p + 1  # "\n\n\n" holds a second break at p + 1
        # The end of the last complete line, before its run of newlines; a run that reaches back into the
        # previous call's region began where that call left `line_end`, so each character is visited once.
        i = text.rfind("\n", start, s.cursor)
        if i >= 0:
            while i > start and text[i - 1] == "\n":
                i -= 1
            if not (i == start and start > 0 and text[start - 1] == "\n"):
                s.line_end = i

    @staticmethod
    def _at_line_start(text: str, p: int) -> bool:
        i = p
        while i > 0 and text[i - 1] in " \t":
            i -= 1
        return i == 0 or text[i - 1] == "\n"

    def _fence(self, text: str, p: int, now: float, out: list[Trigger]) -> None:
        s = self._s
        if s.fence_open is None:
            s.fence_open = p
            return
        segment, s.fence_open = text[s.fence_open : p + 3], None
        if not self.config.code_drafts:
            return
        for code in code_blocks(segment):
            digest = normalized_hash(code)
            if digest in s.seen:
                self._counts["draft"]["duplicate"] += 1
                continue
            s.seen.add(digest)
            self._counts["draft"]["fired"] += 1
            self._report(Trigger("draft", p + 3, s.tokens, now, code=code), out)

    def _break(self, text: str, b: int, now: float, outstanding: int, out: list[Trigger]) -> bool:
        """Handle the paragraph break at `b`; False (and no change) if a cue after it is not yet decidable."""
        s = self._s
        if s.fence_open is not None:  # a blank line in a code block: no fork in the middle of a draft
            s.para_start = b + 2
            return True
        cue = self._cue_at(text, b + 2)
        if cue is None:
            return False
        paragraph, s.para_start = text[s.para_start : b], b + 2
        if paragraph and any(phrase in paragraph.lower() for phrase in self._plans):
            self._fork("plan", b, now, outstanding, out)
        elif cue:
            self._fork("reflection", b, now, outstanding, out)
        return True

    def _cue_at(self, text: str, q: int) -> bool | None:
        """Whether a cue starts at `q` and ends at a word boundary; None while the text so far cannot tell."""
        if q >= len(text):
            return None if self._cues else False
        if text[q].lower() not in self._cue_initials:  # the common case, settled by one character
            return False
        undecided = False
        for cue in self._cues:
            head = text[q : q + len(cue) + 1].lower()
            if len(head) > len(cue):
                if head.startswith(cue) and not head[-1].isalnum():
                    return True
            elif cue.startswith(head):  # could still become this cue
                undecided = True
        return None if undecided else False

    def _periodic(self, now: float, outstanding: int, out: list[Trigger]) -> None:
        s, every = self._s, self.config.periodic_tokens
        if every == 0 or s.fence_open is not None or s.tokens - s.periodic_anchor < every:
            return
        if s.line_end > s.last_chars:
            self._fork("periodic", s.line_end, now, outstanding, out)

    # Reporting: spacing, cap and counters.

    def _fork(self, kind: TriggerKind, chars: int, now: float, outstanding: int, out: list[Trigger]) -> None:
        s, config = self._s, self.config
        if s.tokens - s.last_fork_tokens < config.min_gap_tokens:
            self._counts[kind]["too_close"] += 1
            return
        fired_here = sum(1 for t in out if t.kind != "draft" and not t.suppressed)
        suppressed = outstanding + fired_here >= config.max_outstanding
        self._counts[kind]["suppressed" if suppressed else "fired"] += 1
        if not suppressed:
            s.last_fork_tokens = s.tokens
        self._report(Trigger(kind, chars, s.tokens, now, suppressed=suppressed), out)

    def _report(self, trigger: Trigger, out: list[Trigger]) -> None:
        assert trigger.chars >= self._s.last_chars, "triggers are reported in order of position"
        self._s.last_chars = trigger.chars
        self._s.periodic_anchor = trigger.tokens
        out.append(trigger)
