"""Split raw completion text into reasoning and content at `<think>` / `</think>` tags, incrementally.

Contract: `feed(text)` returns `(kind, text)` pieces with the tags removed; a chunk ending in what could be
the start of a tag (`"</th"`) is held back until the next chunk decides, and `final=True` releases it. Text
between the tags is returned exactly (the newline R1 writes before `</think>` stays in the reasoning).
"""

from __future__ import annotations

__all__ = ["ThinkSplitter"]

_OPEN, _CLOSE = "<think>", "</think>"


def _partial_tag(text: str, tag: str) -> int:
    """Length of the longest proper prefix of `tag` that `text` ends with."""
    for k in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:k]):
            return k
    return 0


class ThinkSplitter:
    def __init__(self, *, in_reasoning: bool = False) -> None:
        self.in_reasoning = in_reasoning
        self._held = ""

    def feed(self, text: str, *, final: bool = False) -> list[tuple[str, str]]:
        buf, self._held = self._held + text, ""
        out: list[tuple[str, str]] = []
        while buf:
            kind, tag = ("reasoning", _CLOSE) if self.in_reasoning else ("content", _OPEN)
            i = buf.find(tag)
            if i < 0:
                keep = 0 if final else _partial_tag(buf, tag)
                if len(buf) > keep:
                    out.append((kind, buf[: len(buf) - keep]))
                self._held = buf[len(buf) - keep :]
                break
            if i:
                out.append((kind, buf[:i]))
            buf = buf[i + len(tag) :]
            self.in_reasoning = not self.in_reasoning
        return out
