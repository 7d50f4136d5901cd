"""Memory demo: replay-only TapeSAC against torch's full checkpointing on a small Qwen3 model, and
the planner's memory-vs-time frontier against every anchor on a tiny one."""

from __future__ import annotations

from pathlib import Path

from steptune.core.demo import DemoResult
from steptune.core.plot import bars
from steptune.memory.compare import compare, compare_table, overhead_table, write_json

__all__ = ["run_memory_demo"]


def run_memory_demo(
    out_dir: Path,
    *,
    model: str = "qwen3-small",
    repeats: int = 3,
    bench_model: str = "qwen3-tiny",
    quick: bool = False,
) -> DemoResult:
    if quick:
        model, repeats = bench_model, 1
    from steptune.memory.bench import bench_table, dominance, pareto_plot, run_bench

    out_dir.mkdir(parents=True, exist_ok=True)
    result = compare(model, repeats=repeats, overhead_repeats=1 if quick else 3)
    tables = [compare_table(result)]
    extra = overhead_table(result)
    if extra is not None:
        tables.append(extra)
    rows = result["rows"]
    artifacts = [
        write_json(result, out_dir / "compare.json"),
        bars(
            [r["policy"] for r in rows],
            [r["recompute_flops"] / 1e9 for r in rows],
            out_dir / "recompute_gflop.png",
            ylabel="GFLOP recomputed in backward",
            title=f"{model}: recomputation added to backward (measured)",
        ),
        bars(
            [r["policy"] for r in rows],
            [r["step_time_s"] for r in rows],
            out_dir / "step_time.png",
            ylabel="median step time on this CPU (s)",
            title=f"{model}: forward+backward, {repeats} interleaved steps (measured)",
        ),
    ]
    bench = run_bench(bench_model, repeats=repeats)
    bench["dominance"] = dominance(bench)
    tables.append(bench_table(bench))
    artifacts.append(pareto_plot(bench, out_dir / "pareto.png"))
    return DemoResult(
        title="memory: TapeSAC vs torch checkpointing and the hand-tuned anchors (MEASURED on this CPU)",
        tables=tables,
        artifacts=artifacts,
    )
