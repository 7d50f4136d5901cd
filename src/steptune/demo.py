"""``steptune demo``: run the demo of every area that exists and write one report."""

from __future__ import annotations

import argparse
import time
from pathlib import Path
from typing import Any

__all__ = ["AREAS", "register", "run_demo"]

AREAS = ("core", "memory", "comm", "pipeline", "kernels", "resilience")
"""The areas with a demo, in the order the report shows them."""


def run_demo(out_dir: Path, *, quick: bool = False, only: tuple[str, ...] | None = None) -> Path:
    """Run every area's demo (or the areas in ``only``) and write ``out_dir/report.md``; ``quick`` shrinks
    sizes and repeats (a smoke run for the tests)."""
    unknown = sorted(set(only or ()) - set(AREAS))
    if unknown:
        raise ValueError(f"no demo for {', '.join(unknown)}; the areas are: {', '.join(AREAS)}")
    from rich.console import Console

    from steptune.comm.demo import run_comm_demo
    from steptune.core.demo import run_core_demo
    from steptune.kernels.demo import run_kernels_demo
    from steptune.memory.demo import run_memory_demo
    from steptune.pipeline.demo import run_pipeline_demo
    from steptune.resilience.demo import run_resilience_demo

    console = Console()
    # Areas add theirs as they start to work.
    demos = [
        ("core", run_core_demo),
        ("memory", run_memory_demo),
        ("comm", run_comm_demo),
        ("pipeline", run_pipeline_demo),
        ("kernels", run_kernels_demo),
        ("resilience", run_resilience_demo),
    ]
    assert [name for name, _ in demos] == list(AREAS)
    demos = [(name, fn) for name, fn in demos if only is None or name in only]
    sections = ["# steptune demo", "", f"Written {time.strftime('%Y-%m-%d %H:%M:%S')}.", ""]
    for name, fn in demos:
        t0 = time.perf_counter()
        with console.status(f"demo: {name} ..."):
            result = fn(out_dir / name, quick=quick)
        console.rule(f"{result.title} ({time.perf_counter() - t0:.1f} s)")
        sections.append(f"## {result.title}\n")
        for table in result.tables:
            table.print()
            sections.append(table.to_markdown())
        sections.append("Artifacts:\n" + "\n".join(f"- `{p.relative_to(out_dir)}`" for p in result.artifacts))
        sections.append("")
    report = out_dir / "report.md"
    report.write_text("\n".join(sections))
    console.print(f"\nReport: {report}\nArtifacts under: {out_dir}/")
    return report


def _areas(text: str) -> tuple[str, ...]:
    names = tuple(n.strip() for n in text.split(",") if n.strip())
    unknown = sorted(set(names) - set(AREAS))
    if not names or unknown:
        raise argparse.ArgumentTypeError(
            f"{', '.join(unknown) or 'nothing'}: not an area with a demo; choose from {', '.join(AREAS)}"
        )
    return names


def register(sub: Any) -> None:
    p = sub.add_parser(
        "demo",
        help="run every area's demo and write a report under runs/demo/",
        description="Run the demo of every area that works and write a Markdown report.",
    )
    p.add_argument("--out", type=Path, default=Path("runs/demo"), help="output folder (default: runs/demo)")
    p.add_argument(
        "--quick",
        action="store_true",
        help="smaller models, fewer repeats and seeds: checks that every demo runs, figures are rougher",
    )

    p.add_argument(
        "--only",
        type=_areas,
        default=None,
        metavar="AREA[,AREA...]",
        help=f"run only these areas' demos ({', '.join(AREAS)})",
    )

    def run(args: argparse.Namespace) -> int:
        run_demo(args.out, quick=args.quick, only=args.only)
        return 0

    p.set_defaults(func=run)
