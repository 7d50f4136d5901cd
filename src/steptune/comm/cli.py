"""`steptune comm` verbs: bench (stock FSDP2 vs TIDE on gloo, side by side)."""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

__all__ = ["register"]


def _bench(args: argparse.Namespace) -> int:
    from rich.console import Console

    from steptune.comm.bench import run_bench
    from steptune.comm.report import bench_tables, staging_plot

    console = Console(stderr=True)
    with console.status("comm bench ...") as status:
        report = run_bench(quick=args.quick, progress=status.update)
    out = Path(args.json)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2) + "\n")  # first: nothing measured is lost if printing fails
    for table in bench_tables(report):
        table.print()
    plot = staging_plot(report, out.with_suffix(".staging.png"))
    print(f"wrote: {out}\nwrote: {plot}")
    return 0


def register(sub: Any) -> None:
    p = sub.add_parser(
        "comm",
        help="TIDE: zero-copy FSDP2 all-gather and bf16->fp32 reduce-scatter (bench on gloo)",
        description="TIDE: zero-copy, layout-aware FSDP2 collectives. Use enable_tide(model) from Python "
        "after fully_shard; `bench` measures stock FSDP2 and TIDE side by side on gloo (issue #9). "
        "Not built yet: the 16-64 GPU cost model and `simulate` (issue #10).",
    )
    verbs = p.add_subparsers(dest="verb", metavar="VERB", required=True)
    b = verbs.add_parser(
        "bench",
        help="stock FSDP2 vs TIDE on gloo: parameter equality, layout bytes, wire bytes, staging, time",
        description="Spawns W = 2, 3, 4 gloo ranks on loopback and trains an MLP and small HF Qwen3/Llama "
        "models with stock FSDP2 and with TIDE, interleaved; then sweeps the reduce-scatter alone over "
        "W = 2..8 thread ranks. Writes JSON and a staging plot next to it.",
    )
    b.add_argument("--json", required=True, help="where to write the results (JSON)")
    b.add_argument("--quick", action="store_true", help="W = 2, 4 and two models only (about a minute)")
    b.set_defaults(func=_bench)
