"""`steptune resilience` verbs: detect (simulated scoring), trace (the real straggler trace)."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

__all__ = ["register"]

_PENDING = "planner, baseline policies and the 256-GPU simulator are not built yet (issue #7)"


def _detect(args: argparse.Namespace) -> int:
    from steptune.core.report import Table
    from steptune.resilience.evaluate import JobSpec, detector_scores

    job = JobSpec(model=args.model, pp=args.pp, dp=args.dp, lengths=args.lengths)
    scores = detector_scores(job, runs=args.runs, steps=args.steps, factor=args.factor)
    table = Table(
        title=f"detectors on simulated {args.model} PP={args.pp} DP={args.dp} ({args.runs} runs, "
        f"one fail-slow x{args.factor} or fail-stop each)",
        columns=["detector", "detection rate", "false alarms / run", "mean latency (steps)"],
    )
    for name, s in scores.items():
        table.add(name, s["detection_rate"], s["false_alarms_per_run"], s["mean_latency_steps"])
    table.notes.append("SIMULATED device time; fail-stop runs are scored for the heartbeat monitor only")
    table.print()
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({"detector": scores}, indent=1))
        print(f"wrote: {args.json}")
    return 0


def _trace(args: argparse.Namespace) -> int:
    from steptune.core.report import Table
    from steptune.resilience.detect import ChangePointDetector, FixedThresholdDetector, ResiHPDetector
    from steptune.resilience.trace import load_trace, replay, trace_stats, trace_steps

    cols = load_trace(args.path)
    steps = trace_steps(cols)
    alarms = replay([ResiHPDetector(), FixedThresholdDetector(0.10), ChangePointDetector()], steps)
    stats = trace_stats(cols)
    table = Table(
        title=f"fail-slow alarms on the healthy straggler trace ({len(steps)} steps)",
        columns=["detector", "alarms", "ranks alarmed"],
    )
    for name, found in alarms.items():
        table.add(name, len(found), len({a.unit for a in found}))
    table.notes.append(f"trace statistics: {stats}")
    table.print()
    return 0


def _pending(args: argparse.Namespace) -> int:
    print(f"steptune resilience {args.verb}: {_PENDING}; nothing was run.", file=sys.stderr)
    return 2


def register(sub: Any) -> None:
    p = sub.add_parser(
        "resilience",
        help="ResiHP: workload-aware failure detection (planner not yet built)",
        description="ResiHP: workload-aware failure prediction and detection. Built: the "
        f"predictor and detectors (detect, trace). Not built: {_PENDING}.",
    )
    verbs = p.add_subparsers(dest="verb", metavar="VERB", required=True)
    d = verbs.add_parser("detect", help="score detectors on simulated runs with injected failures")
    d.add_argument("--model", default="llama2-7b")
    d.add_argument("--pp", type=int, default=4)
    d.add_argument("--dp", type=int, default=4)
    d.add_argument("--lengths", default="code", help="length distribution preset (code, chat, uniform)")
    d.add_argument("--runs", type=int, default=20)
    d.add_argument("--steps", type=int, default=80)
    d.add_argument("--factor", type=float, default=1.25, help="injected fail-slow factor")
    d.add_argument("--json", type=Path, default=None)
    d.set_defaults(func=_detect)
    t = verbs.add_parser("trace", help="replay the real 128-GPU straggler trace through every detector")
    t.add_argument("--path", type=Path, default=None, help="trace parquet (default: the shared copy)")
    t.set_defaults(func=_trace)
    for verb in ("simulate", "bench"):
        v = verbs.add_parser(verb, help=f"not built yet: {_PENDING}")
        v.set_defaults(func=_pending)
