"""Render the JSON of ``benchmarks/gpu/memory.py`` as the Markdown tables of benchmarks/RESULTS.md.

    python benchmarks/memory_gpu_table.py benchmarks/results/memory_plan_gpu_h200_head.json

Per model: each row's measured and predicted peak, its median step time, and for each anchor the planned
row that dominates it (peak no higher, the lowest median per-round time ratio); then, under the halfway
limit, the planned row's per-round time ratio over each anchor that fits. Ratios are medians of per-round
ratios (the rounds are interleaved), so machine drift between rounds cancels.
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path
from typing import Any

MIB = 1 << 20


def _ratio(a: dict[str, Any], b: dict[str, Any]) -> float:
    """Median over rounds of a's time / b's time."""
    return statistics.median(x / y for x, y in zip(a["step_times_s"], b["step_times_s"], strict=True))


def model_table(name: str, m: dict[str, Any]) -> str:
    rows = m["policies"]
    plans = {k: v for k, v in rows.items() if k.startswith("tapesac_plan@")}
    anchors = {k: v for k, v in rows.items() if k not in plans and k not in ("no_ac", "tapesac_replay")}
    half = m["halfway_limit_bytes"]
    out = [
        f"**{name}** (halfway limit {half / MIB:.1f} MiB):",
        "",
        "| row | peak MiB | predicted MiB | step ms | dominated by (per-round time ratio) |",
        "|---|---|---|---|---|",
    ]
    for key, r in rows.items():
        pred = f"{r['predicted_peak_bytes'] / MIB:.1f}" if "predicted_peak_bytes" in r else ""
        dom = ""
        if key in anchors:
            fits = [(p, _ratio(v, r)) for p, v in plans.items() if v["peak_bytes"] <= r["peak_bytes"]]
            if fits:
                p, q = min(fits, key=lambda t: t[1])
                dom = f"{p} ({q:.3f})"
        out.append(f"| {key} | {r['peak_bytes'] / MIB:.1f} | {pred} | {1e3 * r['step_time_s']:.1f} | {dom} |")
    at_half = [k for k, v in plans.items() if v.get("limit_bytes") == half]
    if at_half:
        k = at_half[0]
        p = plans[k]
        over = ", ".join(f"{a} {_ratio(p, v):.3f}" for a, v in anchors.items() if v["peak_bytes"] <= half)
        out += ["", f"Under the halfway limit, {k} (peak {p['peak_bytes'] / MIB:.1f} MiB) over each anchor "
                f"that fits: {over}."]  # fmt: skip
    errs = [
        (v["predicted_peak_bytes"] - v["peak_bytes"]) / v["peak_bytes"]
        for v in plans.values()
        if "predicted_peak_bytes" in v
    ]
    over_limit = [k for k, v in plans.items() if v["peak_bytes"] > v.get("limit_bytes", float("inf"))]
    out += [
        "",
        f"Predicted minus measured peak: {100 * min(errs):+.1f}% to {100 * max(errs):+.1f}%; "
        f"planned rows over their limit: {', '.join(over_limit) or 'none'}.",
    ]
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("json", type=Path, help="the file benchmarks/gpu/memory.py wrote")
    args = p.parse_args(argv)
    d = json.loads(args.json.read_text())
    print("\n\n".join(model_table(name, m) for name, m in d["models"].items()))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
