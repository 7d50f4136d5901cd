"""Tables and the staging plot for the comm benchmark (``steptune comm bench`` and the demo)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from steptune.core.report import Table

__all__ = ["bench_tables", "staging_plot"]


def _kib(b: float) -> float:
    return round(b / 1024, 1)


def bench_tables(report: dict[str, Any]) -> list[Table]:
    gloo = report["gloo"]
    runs = Table(
        title="FSDP2 on gloo: stock vs TIDE, same model, seeds and batches (per rank, all steps; measured)",
        columns=[
            "model",
            "W",
            "on TIDE",
            "params",
            "copied KiB stock",
            "copied KiB TIDE",
            "RS wire KiB stock",
            "RS wire KiB TIDE",
            "ms stock",
            "ms TIDE",
        ],
        notes=[
            "copied = layout bytes written by copy-in, copy-out, chunk_cat and casts (dispatch-level "
            "counter); TIDE keeps only the bf16 cast of each local shard",
            "RS wire: stock sends fp32 (the (W-1)/W share of its input); TIDE bf16 rows, no padding",
            "params: stock and TIDE parameters after all steps (bitwise, or max relative difference)",
            "step time is a sanity check: per-parameter P2P on gloo is latency-bound (see docs/comm.md)",
        ],
    )
    for r in gloo["runs"]:
        wire = r["wire_bytes"]
        params = "bitwise" if r["bitwise_equal"] else f"{r['max_param_rel_diff']:.1e}"
        runs.add(
            r["model"],
            r["world_size"],
            f"{r['groups_on_tide']}/{r['groups']}",
            params,
            _kib(r["layout_bytes"]["stock"]),
            _kib(r["layout_bytes"]["tide"]),
            _kib(wire["stock"].get("reduce_scatter", {}).get("float32", 0)),
            _kib(wire["tide"].get("reduce_scatter", {}).get("bfloat16", 0)),
            round(1e3 * r["step_time_s"]["stock"], 1),
            round(1e3 * r["step_time_s"]["tide"], 1),
        )
    rs = gloo["rs_staging"]
    staging = Table(
        title=f"Reduce-scatter staging at a fixed per-rank output ({rs['rows_per_rank']}x{rs['cols']} per "
        "rank; thread ranks on gloo; measured)",
        columns=["W", "stock KiB", "TIDE KiB", "max rel diff", "stock ms", "TIDE ms"],
        notes=[
            "stock: FSDP2's full-group fp32 input buffer (chunk_cat, then reduce_scatter_tensor AVG)",
            f"TIDE: {rs['num_slots']} staging slots of {rs['chunk_numel']} bf16 elements",
        ],
    )
    for w, row in rs["by_world_size"].items():
        staging.add(
            int(w),
            _kib(row["stock_bytes"]),
            _kib(row["tide_bytes"]),
            row["max_rel_diff"],
            round(1e3 * row["stock_s"], 2),
            round(1e3 * row["tide_s"], 2),
        )
    return [runs, staging]


def staging_plot(report: dict[str, Any], path: Path) -> Path:
    from steptune.core.plot import lines

    rows = report["gloo"]["rs_staging"]["by_world_size"]
    ws = [int(w) for w in rows]
    return lines(
        ws,
        {
            "stock FSDP2 (fp32 full-group input)": [rows[str(w)]["stock_bytes"] / 2**20 for w in ws],
            "TIDE (K staging slots)": [rows[str(w)]["tide_bytes"] / 2**20 for w in ws],
        },
        path,
        xlabel="world size W (fixed per-rank output)",
        ylabel="reduce-scatter staging (MiB)",
        title="Reduce-scatter staging vs world size (measured, gloo)",
    )
