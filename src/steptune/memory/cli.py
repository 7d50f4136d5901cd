"""`steptune memory` verbs: compare (replay-only TapeSAC vs torch checkpointing, measured)."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

__all__ = ["register"]


def _compare(args: argparse.Namespace) -> int:
    from rich.console import Console

    from steptune.memory.compare import compare, compare_table, overhead_table, write_json
    from steptune.memory.models import MODEL_PRESETS

    if args.model not in MODEL_PRESETS:
        raise ValueError(f"unknown --model {args.model!r}; choose one of {sorted(MODEL_PRESETS)}")
    console = Console(stderr=True)
    with console.status("measuring ...") as status:
        result = compare(args.model, repeats=args.repeats, timed=not args.no_time, progress=status.update)
    compare_table(result).print()
    extra = overhead_table(result)
    if extra is not None:
        extra.print()
    if args.json:
        print(f"wrote: {write_json(result, args.json)}")
    return 0


def register(sub: Any) -> None:
    from steptune.memory.models import MODEL_PRESETS

    p = sub.add_parser(
        "memory",
        help="TapeSAC: dispatcher-tape activation checkpointing (replay only what backward reads)",
        description=(
            "TapeSAC records each block's forward at the dispatcher and, in backward, replays only the "
            "producers of the values autograd reads. The memory-aware planner (plan, pareto, bench) is "
            "issue #4 and not built yet."
        ),
    )
    verbs = p.add_subparsers(dest="verb", metavar="VERB", required=True)
    c = verbs.add_parser(
        "compare",
        help="measure replay-only TapeSAC against no checkpointing and torch's full checkpointing",
        description=(
            "One HF model from a preset (random weights): gradients vs no checkpointing, recomputation "
            "added to backward (ops, FLOPs, bytes), MemTracker peak, and median step time of interleaved "
            "steps, for no_ac, full_ac (early stop), full_ac_no_early_stop (torchtitan) and tapesac_replay."
        ),
    )
    c.add_argument(
        "--model", default="qwen3-small", help=f"one of {', '.join(MODEL_PRESETS)} (default qwen3-small)"
    )
    c.add_argument("--repeats", type=int, default=7, help="timed steps per policy, interleaved (default 7)")
    c.add_argument("--no-time", action="store_true", help="skip timing (work, peaks and gradients only)")
    c.add_argument("--json", type=Path, help="write the measurements to this JSON file")
    c.set_defaults(func=_compare)
