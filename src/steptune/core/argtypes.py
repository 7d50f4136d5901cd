"""argparse ``type=`` converters shared by the areas' CLIs: a bad number fails at parse time with a
message that says what the flag needs."""

from __future__ import annotations

import argparse
import math
from collections.abc import Callable

__all__ = ["non_negative_float", "positive_float", "positive_int"]


def _number(
    text: str, parse: Callable[[str], float], ok: Callable[[float], bool], kind: str, rule: str
) -> float:
    try:
        value = parse(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected {kind} {rule}, got {text!r}") from None
    if not (math.isfinite(value) and ok(value)):
        raise argparse.ArgumentTypeError(f"must be {rule}, got {text}")
    return value


def positive_int(text: str) -> int:
    """A whole number >= 1 (counts: steps, ranks, GPUs)."""
    return int(_number(text, int, lambda v: v >= 1, "a whole number", ">= 1"))


def positive_float(text: str) -> float:
    """A finite number > 0 (seconds, scales)."""
    return _number(text, float, lambda v: v > 0, "a number", "> 0 and finite")


def non_negative_float(text: str) -> float:
    """A finite number >= 0 (a budget where 0 means "only the fixed part")."""
    return _number(text, float, lambda v: v >= 0, "a number", ">= 0 and finite")
