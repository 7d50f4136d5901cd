"""Tables and a plot of a resilience bench result (``bench.run_bench``'s dict)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from steptune.core.plot import _pyplot, _save
from steptune.core.report import Table

__all__ = ["bench_tables", "plot_bench", "print_bench"]


def bench_tables(res: dict[str, Any]) -> list[Table]:
    rows = res["rows"]
    policies = list(rows[0]["tokens_per_s"]) if rows else []
    kinds = list(dict.fromkeys(r["kind"] for r in rows))
    full = Table(
        title="median tokens/s as a fraction of the oracle's, per scenario kind (SIMULATED, 256 x A100)",
        columns=["policy", *kinds],
    )
    for p in policies:
        full.add(
            p,
            *(
                float(
                    np.median(
                        [r["tokens_per_s"][p] / r["tokens_per_s"]["oracle"] for r in rows if r["kind"] == k]
                    )
                )
                for k in kinds
            ),
        )
    full.notes.append("per-row tokens/s: the JSON's rows (and docs/resilience.md)")
    ratios = Table(
        title="ResiHP / baseline tokens/s over each baseline's home scenarios",
        columns=["baseline", "home kinds", "rows", "min", "median", "max", "baseline trained nothing"],
    )
    from steptune.resilience.bench import HOME

    for base, s in res["ratios"].items():
        home = (
            "all"
            if len(HOME[base]) >= 5
            else "fail-slow-*"
            if len(HOME[base]) == 3
            else ", ".join(HOME[base])
        )
        ratios.add(base, home, s["rows"], s["min"], s["median"], s["max"], s["baseline_stalled_rows"])
    ratios.notes.append("max None: some baseline made no progress in a row (ratio infinite)")
    tables = [full, ratios]
    if res.get("steptune_ratios"):
        ours = Table(
            title="steptune (ResiHP + uneven TP shares) / baseline tokens/s, same home scenarios",
            columns=["baseline", "rows", "min", "median", "max"],
        )
        for base, s in res["steptune_ratios"].items():
            ours.add(base, s["rows"], s["min"], s["median"], s["max"])
        ours.notes.append("resihp row: over every scenario kind")
        tables.append(ours)
    det = Table(
        title="detectors on the calibrated simulated workload (1.25x fail-slow or fail-stop per run)",
        columns=["detector", "false alarms / run", "detection rate", "mean latency (steps)"],
    )
    for name, d in res["detector"].items():
        det.add(name, d["false_alarms_per_run"], d["detection_rate"], d["mean_latency_steps"])
    return [*tables, det]


def print_bench(res: dict[str, Any]) -> None:
    for t in bench_tables(res):
        t.print()
    if res["resihp_below_baseline"]:
        n = len(res["resihp_below_baseline"])
        print(f"ResiHP below a baseline in {n} case{'s' if n != 1 else ''}:")
        for x in res["resihp_below_baseline"]:
            print(f"  {x['model']} {x['scenario']}: {x['baseline']} (ratio {x['ratio']:.3f})")
    else:
        print("ResiHP >= every baseline in every row.")
    if "steptune_below_baseline" in res:
        below = res["steptune_below_baseline"]
        print(
            f"steptune below a baseline in {len(below)} case{'s' if len(below) != 1 else ''}"
            + (":" if below else ".")
        )
        for x in below:
            print(f"  {x['model']} {x['scenario']}: {x['baseline']} (ratio {x['ratio']:.3f})")
    if res["above_oracle"]:
        print(f"WARNING: {len(res['above_oracle'])} results above the oracle: {res['above_oracle']}")
    print(f"bench wall time {res['wall_s']:.0f} s (SIMULATED throughput)")


def plot_bench(res: dict[str, Any], path: str | Path) -> Path:
    """Per scenario kind, each policy's median tokens/s as a fraction of the oracle's."""
    rows = res["rows"]
    kinds = list(dict.fromkeys(r["kind"] for r in rows))
    policies = [p for p in rows[0]["tokens_per_s"] if p != "oracle"]
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(max(8.0, 1.6 * len(kinds) + 3), 4.5))
    width = 0.8 / len(policies)
    for i, p in enumerate(policies):
        vals = [
            float(
                np.median(
                    [r["tokens_per_s"][p] / r["tokens_per_s"]["oracle"] for r in rows if r["kind"] == k]
                )
            )
            for k in kinds
        ]
        ax.bar(np.arange(len(kinds)) + i * width, vals, width, label=p)
    ax.set_xticks(np.arange(len(kinds)) + 0.4 - width / 2, kinds)
    ax.axhline(1.0, color="gray", linestyle="--", linewidth=0.8)
    ax.set_ylabel("median tokens/s / oracle")
    ax.set_title("Recovery policies on simulated 256-GPU failure scenarios (SIMULATED)")
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0))  # outside: no bar hidden
    return _save(fig, path)
