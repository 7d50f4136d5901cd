"""argparse ``type=`` converters shared by the areas' CLIs: a bad number fails at parse time with a
message that says what the flag needs."""

from __future__ import annotations

import argparse
import math

__all__ = ["non_negative_float", "positive_float", "positive_int"]


def positive_int(text: str) -> int:
    """A whole number >= 1 (counts: steps, ranks, GPUs)."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number >= 1, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def non_negative_float(text: str) -> float:
    """A finite number >= 0 (a budget where 0 means "only the fixed part")."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number >= 0, got {text!r}") from None
    if not (value >= 0 and math.isfinite(value)):
        raise argparse.ArgumentTypeError(f"must be >= 0 and finite, got {text}")
    return value


def positive_float(text: str) -> float:
    """A finite number > 0 (seconds, scales)."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number > 0, got {text!r}") from None
    if not (value > 0 and math.isfinite(value)):
        raise argparse.ArgumentTypeError(f"must be > 0 and finite, got {text}")
    return value
