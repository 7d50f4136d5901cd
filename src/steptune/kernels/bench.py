"""The kernels benchmark (CPU part of issue #11): can profiling tell a fast kernel from a slow one?

For every built-in problem that ships a `c_fast.py` and a `c_slow.py` example, both are profiled `repeats`
times through the real pool (sandboxed workers, one pinned core each, reference and candidate interleaved,
median of per-round paired ratios). A problem "separates" when every one of the fast candidate's speedups is
above 1 and every one of the slow candidate's is below 1.
"""

from __future__ import annotations

import json
import os
import platform
import statistics
import time
from collections.abc import Callable
from concurrent.futures import Future
from pathlib import Path
from typing import Any

from steptune.kernels.pool import EvalPool, PoolConfig, Result
from steptune.kernels.problems import builtin_problems

__all__ = ["EXAMPLES_DIR", "bench_table", "example_pairs", "run_bench"]

EXAMPLES_DIR = Path(__file__).with_name("examples")


def example_pairs() -> list[str]:
    """Built-in problems with both a fast and a slow C example."""
    return [
        p
        for p in builtin_problems()
        if (EXAMPLES_DIR / p / "c_fast.py").is_file() and (EXAMPLES_DIR / p / "c_slow.py").is_file()
    ]


def run_bench(
    *,
    repeats: int = 10,
    problems: list[str] | None = None,
    config: PoolConfig | None = None,
    progress: Callable[[str], None] | None = None,
) -> dict[str, Any]:
    """Profile every fast/slow example `repeats` times; returns the JSON-able report."""
    pairs = example_pairs()
    names = problems or pairs
    if not names:
        raise ValueError("no built-in problem has both examples/<problem>/c_fast.py and c_slow.py")
    missing = [n for n in names if n not in pairs]
    if missing:
        raise ValueError(
            f"--problems {' '.join(missing)}: no fast and slow C examples to compare; choose from "
            f"{', '.join(pairs)}"
        )
    cfg = config or PoolConfig(num_workers=2, timeout_s=120)
    t0 = time.perf_counter()
    rows = []
    with EvalPool(cfg) as pool:
        for i, name in enumerate(names):
            if progress:
                progress(f"[{i + 1}/{len(names)}] {name}")
            futs: dict[str, list[Future[Result]]] = {}
            for variant in ("c_fast", "c_slow"):
                src = (EXAMPLES_DIR / name / f"{variant}.py").read_text()
                if pool.submit(name, src).result().verdict != "correct":  # validate once
                    raise RuntimeError(
                        f"example {name}/{variant}.py is not correct: fix it before benchmarking"
                    )
                futs[variant] = [pool.submit(name, src, kind="profile") for _ in range(repeats)]
            row: dict[str, Any] = {"problem": name}
            for variant, fs in futs.items():
                results = [f.result() for f in fs]
                bad = [r for r in results if r.verdict != "correct"]
                if bad:
                    raise RuntimeError(f"{name}/{variant}: profiling gave {bad[0].verdict}: {bad[0].reason}")
                speedups = [float(r.speedup or 0.0) for r in results]
                row[variant] = {
                    "speedups": [round(s, 4) for s in speedups],
                    "median": statistics.median(speedups),
                    "min": min(speedups),
                    "max": max(speedups),
                    "ref_time_s": statistics.median(float(r.ref_time_s or 0) for r in results),
                    "candidate_time_s": statistics.median(float(r.candidate_time_s or 0) for r in results),
                }
            row["separated"] = row["c_fast"]["min"] > 1.0 and row["c_slow"]["max"] < 1.0
            rows.append(row)
    return {
        "repeats": repeats,
        "machine": f"{platform.machine()} {len(os.sched_getaffinity(0))} cores",
        "config": {"rounds": cfg.rounds, "round_s": cfg.round_s, "workers": cfg.num_workers, "threads": 1},
        "wall_s": time.perf_counter() - t0,
        "rows": rows,
        "problems_fast": sum(r["c_fast"]["min"] > 1.0 for r in rows),
        "problems_separated": sum(r["separated"] for r in rows),
    }


def bench_table(report: dict[str, Any]) -> Any:
    from steptune.core.report import Table

    t = Table(
        title=f"C candidates vs torch reference, speedup over {report['repeats']} profiles each "
        "(median, then min to max; 1 thread, pinned)",
        columns=["problem", "reference", "fast: speedup", "slow: speedup", "separated"],
    )
    for r in report["rows"]:
        f, s = r["c_fast"], r["c_slow"]
        t.add(
            r["problem"],
            f"{f['ref_time_s'] * 1e3:.3f} ms",
            f"{f['median']:.2f}x [{f['min']:.2f}, {f['max']:.2f}]",
            f"{s['median']:.2f}x [{s['min']:.2f}, {s['max']:.2f}]",
            "yes" if r["separated"] else "NO",
        )
    return t


def write_json(report: dict[str, Any], path: str | Path) -> Path:
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2) + "\n")
    return out
