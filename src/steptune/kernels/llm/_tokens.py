"""A deterministic toy tokenizer, a toy chat template and a vLLM-APC-like block prefix cache.

Contract: `split_tokens(text)` cuts text into GPT-2-style pieces (a word or a punctuation run with at most
one leading space, or a whitespace run) and `"".join(split_tokens(t)) == t` always. `Vocabulary` numbers
pieces in order of first sight, so ids are only meaningful to the vocabulary (one per replay server) that
issued them, and always decode back to the exact text. Newlines never merge into a word, so a prompt
rendered to end in `\\n` tokenizes as the concatenation of its parts; a space at a boundary can still drift,
like a real BPE.

`PrefixCache` mimics vLLM's automatic prefix caching: a full block of `block_size` token ids is keyed by its
ids plus its parent block's key (a chained hash), only full blocks are cached (the partial tail is always
recomputed), at least one prompt token is always recomputed, and blocks are evicted least-recently-used
once more than `capacity_tokens` tokens are held. A running sequence caches each block as soon as it fills
(vLLM V1), so a fork can hit the blocks of a stream that is still generating. Not thread-safe: the replay
server calls it from its single event loop.
"""

from __future__ import annotations

import re
from collections import OrderedDict
from collections.abc import Iterable, Mapping, Sequence

__all__ = ["PrefixCache", "SeqBlocks", "Vocabulary", "render_chat", "split_tokens"]

_TOKEN_RE = re.compile(r" ?\w+| ?[^\s\w]+|\s+(?!\S)|\s+")

THINK_OPEN = "<think>\n"
THINK_CLOSE = "\n</think>\n\n"


def split_tokens(text: str) -> list[str]:
    """Cut `text` into toy tokens; their concatenation is `text`."""
    return _TOKEN_RE.findall(text)


def render_chat(messages: Sequence[Mapping[str, object]], *, add_generation_prompt: bool = True) -> str:
    """The toy chat template: `<|role|>\\ncontent\\n` per message, then `<|assistant|>\\n<think>\\n`.

    The generation prompt opens the think block, as DeepSeek-R1's template does, so a raw completion
    continues inside the reasoning.
    """
    parts = []
    for message in messages:
        content = message.get("content", "")
        if isinstance(content, list):  # OpenAI content parts: keep the text ones.
            content = "".join(str(p.get("text", "")) for p in content if isinstance(p, Mapping))
        parts.append(f"<|{message.get('role', 'user')}|>\n{content}\n")
    if add_generation_prompt:
        parts.append("<|assistant|>\n" + THINK_OPEN)
    return "".join(parts)


class Vocabulary:
    """Token piece <-> id table, grown on first sight."""

    def __init__(self) -> None:
        self._ids: dict[str, int] = {}
        self._pieces: list[str] = []

    def __len__(self) -> int:
        return len(self._pieces)

    def encode(self, text: str) -> list[int]:
        return self.encode_pieces(split_tokens(text))

    def encode_pieces(self, pieces: Iterable[str]) -> list[int]:
        out = []
        for piece in pieces:
            idx = self._ids.get(piece)
            if idx is None:
                idx = self._ids[piece] = len(self._pieces)
                self._pieces.append(piece)
            out.append(idx)
        return out

    def pieces(self, ids: Iterable[int]) -> list[str]:
        """Text of each id; raises `ValueError` for an id this vocabulary never issued."""
        ids = list(ids)
        bad = [i for i in ids if not isinstance(i, int) or not 0 <= i < len(self._pieces)]
        if bad:
            raise ValueError(f"token ids {bad[:5]} were never issued by this server's tokenizer (/tokenize)")
        return [self._pieces[i] for i in ids]

    def decode(self, ids: Iterable[int]) -> str:
        return "".join(self.pieces(ids))


class SeqBlocks:
    """A sequence's progress through the cache: how many of its full blocks are cached, and the last key."""

    __slots__ = ("ids", "key", "num_blocks")

    def __init__(self) -> None:
        self.ids: list[int] = []
        self.key: int | None = None
        self.num_blocks = 0


class PrefixCache:
    """Chained-hash block cache with LRU eviction; see the module docstring."""

    def __init__(self, *, block_size: int = 16, capacity_tokens: int = 1 << 20) -> None:
        if block_size < 1 or capacity_tokens < block_size:
            raise ValueError(f"need 1 <= block_size <= capacity_tokens, got {block_size}, {capacity_tokens}")
        self.block_size = block_size
        self.capacity_blocks = capacity_tokens // block_size
        self._blocks: OrderedDict[int, None] = OrderedDict()

    def __len__(self) -> int:
        return len(self._blocks)

    def lookup(self, ids: Sequence[int]) -> int:
        """Tokens of `ids` served from cache: leading full blocks that hit, less the recomputed last token."""
        bs, key, hits = self.block_size, None, 0
        for start in range(0, len(ids) - bs + 1, bs):
            key = hash((key, tuple(ids[start : start + bs])))
            if key not in self._blocks:
                break
            self._blocks.move_to_end(key)
            hits += 1
        # vLLM always recomputes at least the last prompt token, so a full hit gives up its last block.
        return min(hits * bs, (len(ids) - 1) // bs * bs) if ids else 0

    def extend(self, seq: SeqBlocks, new_ids: Iterable[int]) -> None:
        """Append ids to a running sequence and cache every block that became full."""
        seq.ids.extend(new_ids)
        bs = self.block_size
        while (seq.num_blocks + 1) * bs <= len(seq.ids):
            start = seq.num_blocks * bs
            seq.key = hash((seq.key, tuple(seq.ids[start : start + bs])))
            self._blocks[seq.key] = None
            self._blocks.move_to_end(seq.key)
            seq.num_blocks += 1
        while len(self._blocks) > self.capacity_blocks:
            self._blocks.popitem(last=False)
