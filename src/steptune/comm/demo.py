"""Comm demo: stock FSDP2 and TIDE side by side on gloo (quick bench: W = 2 and 4, MLP and Qwen3; the
reduce-scatter staging sweep over W = 2, 4, 8), measured in this run; then the cost model's Llama-3.1 70B
step on 64 H100s (SIMULATED, labelled)."""

from __future__ import annotations

import json
from pathlib import Path

from steptune.comm.bench import run_bench
from steptune.comm.constants import CommConstants
from steptune.comm.report import bench_tables, staging_plot
from steptune.comm.simreport import simulate_table
from steptune.core.demo import DemoResult

__all__ = ["run_comm_demo"]


def run_comm_demo(out_dir: Path, *, quick: bool = False) -> DemoResult:
    out_dir.mkdir(parents=True, exist_ok=True)
    report = run_bench(quick=True, smoke=quick)  # the demo runs the bench's quick sizes; --quick the least
    path = out_dir / "comm_bench.json"
    path.write_text(json.dumps(report, indent=2) + "\n")
    plot = staging_plot(report, out_dir / "rs_staging.png")
    model = simulate_table("llama3.1-70b", "dgx-h100", 64, CommConstants())
    return DemoResult(
        title="comm (TIDE): zero-copy FSDP2 collectives on gloo",
        tables=[*bench_tables(report), model],
        artifacts=[path, plot],
    )
