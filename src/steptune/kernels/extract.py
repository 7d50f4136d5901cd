"""Candidate code in LLM text: fenced Python blocks that define `ModelNew`, deduplicated by AST.

Reasoning traces often contain complete drafts (a free candidate, no fork needed); answers and fork replies
end with one. A fork reply starts after the opening fence (the fork prompt ends with "```python\\n"), so
`fork_code` takes the text up to the closing fence.
"""

from __future__ import annotations

import ast
import hashlib
import re

__all__ = ["code_blocks", "fork_code", "normalized_hash"]

_FENCE = re.compile(r"```(?:python|py)?[ \t]*\n(.*?)```", re.S)


def normalized_hash(code: str) -> str:
    """A hash that ignores formatting and comments (AST dump); raw text hash if it does not parse."""
    try:
        text = ast.dump(ast.parse(code))
    except SyntaxError:
        text = code.strip()
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def code_blocks(text: str) -> list[str]:
    """Complete fenced blocks in `text` that define ModelNew, in order of appearance."""
    return [m.group(1) for m in _FENCE.finditer(text) if "class ModelNew" in m.group(1)]


def fork_code(reply: str) -> str | None:
    """The candidate in a fork reply (text after an opening fence), or None without ModelNew."""
    code = reply.split("```", 1)[0]
    return code if "class ModelNew" in code else None
