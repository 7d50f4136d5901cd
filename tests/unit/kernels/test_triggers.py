"""Trigger detection on a streamed reasoning trace: the same triggers whatever the chunking, each once,
spaced and capped as configured, and linear in the length of the stream."""

import itertools
import random
import time

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from steptune.kernels.extract import normalized_hash
from steptune.kernels.triggers import Trigger, TriggerConfig, TriggerDetector

pytestmark = pytest.mark.timeout(60)

FENCE = "`" * 3
DRAFT_1 = """import torch
from torch import nn


class ModelNew(nn.Module):
    def __init__(self, scale):
        super().__init__()
        self.scale = scale

    def forward(self, a, b):
        return torch.relu(a @ b) * self.scale
"""
DRAFT_2 = """import torch
from torch import nn


class ModelNew(nn.Module):
    def __init__(self, scale):
        super().__init__()
        self.scale = scale

    def forward(self, a, b):
        out = a @ b
        return out.clamp_(min=0).mul_(self.scale)
"""
# DRAFT_1 again, with comments and different spacing: the same AST.
DRAFT_1_AGAIN = """import torch
from torch import nn
class ModelNew(nn.Module):
    # keep the scale as a Python float
    def __init__(self, scale):
        super().__init__()
        self.scale = scale
    def forward(self, a, b):
        return torch.relu(a @ b) * self.scale  # fused epilogue
"""

TEXT = f"""Okay, I need to write a faster version of this model. The reference computes a matmul, \
then a ReLU, then a scale, as three separate kernels.

The matrices are 1024 x 1024, so the elementwise ops are memory-bound. Fusing the ReLU and the scale into \
one pass saves two round trips to memory.

Hmm, but the matmul itself dominates. cuBLAS is hard to beat for the GEMM, so I should keep torch.matmul and \
fuse only the epilogue.

So the plan is: keep the matmul, then apply the ReLU and the scale in one fused pass, in place.

Let me write the kernel.

{FENCE}python
{DRAFT_1}{FENCE}

Wait, the scale is a Python float, so it should be passed as a scalar argument, not a tensor. That is what \
the code does. Good.

Actually, the relu then mul allocates two temporaries. In-place ops on the matmul output avoid both.

Alternatively, a custom kernel with vectorized float4 loads could fuse everything, but that is a lot of \
code for a small gain.

Putting it together, here is the in-place version:

{FENCE}python
{DRAFT_2}{FENCE}

Let me verify the in-place ops: the matmul output is a fresh tensor, so clamp_ and mul_ do not touch the \
inputs.

Hmm. For comparison, the first version once more, with comments:

{FENCE}python
{DRAFT_1_AGAIN}{FENCE}

Waiting on nothing else; the in-place version is final.
"""

EXACT = TriggerConfig(min_gap_tokens=0, periodic_tokens=0, max_outstanding=1000)


def before(marker: str) -> int:
    """Position of the paragraph break just before `marker`."""
    return TEXT.index("\n\n" + marker)


def after_fence_of(code: str) -> int:
    return TEXT.index(code) + len(code) + len(FENCE)


def feed_chunks(
    text: str, cuts: list[int], config: TriggerConfig, outstanding: int = 0
) -> tuple[list[Trigger], TriggerDetector]:
    detector = TriggerDetector(config)
    out: list[Trigger] = []
    for i, cut in enumerate([*sorted(cuts), len(text)]):
        out += detector.feed(text[:cut], len(text[:cut]) // 4, now=float(i), outstanding=outstanding)
    return out, detector


def key(triggers: list[Trigger]) -> list[tuple[str, int, str | None, bool]]:
    return [(t.kind, t.chars, t.code, t.suppressed) for t in triggers]


WHOLE = key(feed_chunks(TEXT, [], EXACT)[0])


def test_whole_text_triggers() -> None:
    expected = [
        ("reflection", before("Hmm, but")),
        ("plan", before("Let me write the kernel")),  # the "So the plan is" paragraph ended
        ("plan", before(FENCE + "python\n" + DRAFT_1)),
        ("draft", after_fence_of(DRAFT_1)),
        ("reflection", before("Wait, the scale")),
        ("reflection", before("Actually")),
        ("reflection", before("Alternatively")),
        ("plan", before(FENCE + "python\n" + DRAFT_2)),
        ("draft", after_fence_of(DRAFT_2)),
        ("reflection", before("Let me verify")),
        ("reflection", before("Hmm. For")),
    ]  # the duplicate draft and "Waiting" trigger nothing
    assert [(kind, chars) for kind, chars, _, _ in WHOLE] == expected
    assert [code for kind, _, code, _ in WHOLE if kind == "draft"] == [DRAFT_1, DRAFT_2]
    assert all(code is None for kind, _, code, _ in WHOLE if kind != "draft")
    assert not any(suppressed for *_, suppressed in WHOLE)


def test_drafts_carry_code_and_duplicates_are_not_reported() -> None:
    assert normalized_hash(DRAFT_1) == normalized_hash(DRAFT_1_AGAIN) != normalized_hash(DRAFT_2)
    triggers, detector = feed_chunks(TEXT, list(range(0, len(TEXT), 7)), EXACT)
    drafts = [t for t in triggers if t.kind == "draft"]
    assert [t.code for t in drafts] == [DRAFT_1, DRAFT_2]
    assert all(TEXT[: t.chars].endswith(t.code + FENCE) for t in drafts if t.code)
    assert detector.stats()["draft"] == {"fired": 2, "suppressed": 0, "too_close": 0, "duplicate": 1}
    # Feeding the same text again reports nothing new.
    assert detector.feed(TEXT, len(TEXT) // 4, now=99.0, outstanding=0) == []


@pytest.mark.parametrize("seed", range(20))
def test_random_chunk_sizes_give_the_same_triggers(seed: int) -> None:
    rng = random.Random(seed)
    cuts, pos = [], 0
    while pos < len(TEXT):
        pos += rng.choice([1, 2, 3, rng.randint(1, 40), rng.randint(1, 400)])
        cuts.append(min(pos, len(TEXT)))
    assert key(feed_chunks(TEXT, cuts, EXACT)[0]) == WHOLE


def test_cues_and_fences_split_across_chunks() -> None:
    splits = []
    for marker in ("\n\nWait", "\n\nHmm, but", "\n\nLet me verify", FENCE + "python", FENCE + "\n\nWait"):
        at = TEXT.index(marker)
        splits += [at + k for k in range(1, len(marker))]
    assert key(feed_chunks(TEXT, splits, EXACT)[0]) == WHOLE
    assert key(feed_chunks(TEXT, list(range(len(TEXT))), EXACT)[0]) == WHOLE  # one character at a time


@settings(max_examples=50, deadline=None)
@given(st.lists(st.integers(min_value=0, max_value=len(TEXT)), max_size=80))
def test_any_chunking_gives_the_same_triggers(cuts: list[int]) -> None:
    assert key(feed_chunks(TEXT, cuts, EXACT)[0]) == WHOLE


def test_min_gap_is_respected_and_drafts_are_exempt() -> None:
    config = TriggerConfig(min_gap_tokens=150, periodic_tokens=0, max_outstanding=1000)
    text = TEXT.replace("final.\n", "final.\n\n") * 3
    triggers, detector = feed_chunks(text, list(range(0, len(text), 23)), config)
    forks = [t.tokens for t in triggers if t.kind != "draft"]
    assert forks and forks[0] >= 150
    assert all(b - a >= 150 for a, b in itertools.pairwise(forks))
    assert sum(outcomes["too_close"] for outcomes in detector.stats().values()) > 0
    assert [t.code for t in triggers if t.kind == "draft"] == [DRAFT_1, DRAFT_2]


def plain_lines(n: int, start: int = 0) -> str:
    return "".join(
        f"Line {i}: the tile loads are coalesced along the inner dimension.\n" for i in range(start, n)
    )


def test_periodic_fallback_fires_when_nothing_else_does() -> None:
    text = plain_lines(400)
    config = TriggerConfig(periodic_tokens=500, min_gap_tokens=300)
    triggers, detector = feed_chunks(text, list(range(0, len(text), 37)), config)
    assert triggers and {t.kind for t in triggers} == {"periodic"}
    assert all(text[t.chars] == "\n" for t in triggers)  # cut at the end of a complete line
    gaps = [
        b.tokens - a.tokens
        for a, b in zip([Trigger("periodic", 0, 0, 0.0), *triggers], triggers, strict=False)
    ]
    assert all(500 <= gap <= 510 for gap in gaps)
    assert len(triggers) == (len(text) // 4) // 500
    assert detector.stats()["periodic"]["fired"] == len(triggers)


def test_periodic_is_quiet_while_other_triggers_come_and_inside_a_fence() -> None:
    busy = "".join(plain_lines(8, i) + "\nWait, check the next tile.\n" for i in range(0, 400, 8))
    triggers, _ = feed_chunks(busy, list(range(0, len(busy), 29)), TriggerConfig(periodic_tokens=500))
    assert triggers and {t.kind for t in triggers} == {"reflection"}
    body = "".join(f"        x = x + {i}  # step {i}\n" for i in range(300))
    code = (
        f"import torch\nclass ModelNew(torch.nn.Module):\n    def forward(self, x):\n{body}        return x\n"
    )
    text = plain_lines(30) + f"{FENCE}python\n{code}{FENCE}\n" + plain_lines(60, 30)
    triggers, _ = feed_chunks(text, list(range(0, len(text), 31)), TriggerConfig(periodic_tokens=500))
    opened, closed = text.index(FENCE), text.rindex(FENCE)
    assert [t.kind for t in triggers].count("draft") == 1 and triggers[0].code == code
    assert not any(opened < t.chars <= closed for t in triggers if t.kind == "periodic")


def test_suppressed_when_outstanding_reaches_the_cap() -> None:
    config = TriggerConfig(min_gap_tokens=0, periodic_tokens=0, max_outstanding=2)
    triggers, detector = feed_chunks(TEXT, list(range(0, len(TEXT), 50)), config, outstanding=2)
    assert [(t.kind, t.chars) for t in triggers] == [(k, c) for k, c, _, _ in WHOLE]
    assert all(t.suppressed == (t.kind != "draft") for t in triggers)
    assert detector.stats()["reflection"] == {"fired": 0, "suppressed": 6, "too_close": 0, "duplicate": 0}
    # In one call, forks fired earlier in the call count against the cap.
    triggers, _ = feed_chunks(TEXT, [], config, outstanding=1)
    forks = [t for t in triggers if t.kind != "draft"]
    assert [t.suppressed for t in forks] == [False] + [True] * (len(forks) - 1)


def test_fences_cues_and_boundaries() -> None:
    text = f"Intro.\n\n{FENCE}python\nx = 1\n\nActually = 2\n{FENCE}\n\nWaiting is fine.\n\nWAIT: no.\n\nend"
    triggers, _ = feed_chunks(text, [], EXACT)
    # Inside a fence is not a paragraph; "Waiting" is not "Wait"; cues match case-insensitively.
    assert [(t.kind, t.chars) for t in triggers] == [("reflection", text.index("\n\nWAIT"))]
    # A paragraph start that could still become a cue waits for the next characters, and only that.
    detector = TriggerDetector(EXACT)
    assert detector.feed("a\n\nHm", 1, now=0.0, outstanding=0) == []
    assert detector.feed("a\n\nHmm", 1, now=0.0, outstanding=0) == []
    assert [t.chars for t in detector.feed("a\n\nHmm,", 1, now=0.0, outstanding=0)] == [1]
    inline = f"Use {FENCE}python fences.\n\nWait, yes."
    assert [t.kind for t in feed_chunks(inline, [], EXACT)[0]] == ["reflection"]


def test_reset_and_bad_input() -> None:
    detector = TriggerDetector(EXACT)
    first = detector.feed(TEXT, 10, now=0.0, outstanding=0)
    with pytest.raises(ValueError, match="reset"):
        detector.feed(TEXT[:100], 10, now=1.0, outstanding=0)
    with pytest.raises(ValueError, match="running total"):
        detector.feed(TEXT, 5, now=1.0, outstanding=0)
    detector.reset()
    assert key(detector.feed(TEXT, 10, now=0.0, outstanding=0)) == key(first)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"periodic_tokens": 100, "min_gap_tokens": 300}, "raise periodic_tokens"),
        ({"min_gap_tokens": -1}, "min_gap_tokens"),
        ({"periodic_tokens": -5}, "periodic_tokens"),
        ({"max_outstanding": -1}, "max_outstanding"),
        ({"reflection_cues": ("Wait", "")}, "reflection_cues"),
        ({"plan_phrases": ["So the plan is"]}, "tuple"),
    ],
)
def test_config_errors_say_what_to_change(kwargs: dict[str, object], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        TriggerConfig(**kwargs)


LONG = {
    "realistic": (TEXT + "\n\n") * (200_000 // len(TEXT) + 1),
    "newlines": "\n" * 200_000,
    "backticks": "`" * 200_000,
    "fence lines": (FENCE + "\n") * 50_000,
    "cue prefixes": "\n\nWai" * 40_000,
    "one paragraph": "x" * 200_000,
}


@pytest.mark.parametrize("name", LONG)
def test_linear_time_on_a_long_stream(name: str) -> None:
    text = LONG[name][:200_000]
    detector = TriggerDetector()
    t0 = time.perf_counter()
    so_far = ""  # grown in place, as a client accumulates a stream (slicing each prefix would be quadratic)
    for start in range(0, len(text), 10):
        so_far += text[start : start + 10]
        detector.feed(so_far, len(so_far) // 4, now=start / 1e4, outstanding=0)
    elapsed = time.perf_counter() - t0
    assert elapsed < 2.0, f"{elapsed:.2f} s for 20k chunks of {name!r}"
    if name == "realistic":
        assert sum(outcomes["fired"] for outcomes in detector.stats().values()) > 10
