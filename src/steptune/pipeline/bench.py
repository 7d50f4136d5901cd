"""``steptune pipeline bench``: the tuner against every anchor, side by side, on the same costs.

All makespans are SIMULATED (analytic per-layer FLOPs on an H100 at 50% efficiency, alpha-beta
P2P over the scale-out network; see docs/pipeline.md for every assumption). The anchors are
GPipe, 1F1B, interleaved 1F1B, ZB-H1, ZB-V and DualPipeV, each with a layer-uniform and a min-max
balanced partition; "best_anchor" is the fastest of them that fits the memory cap.
"""

from __future__ import annotations

import json
import math
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from steptune.core.specs import cluster_preset, model_preset
from steptune.pipeline.costs import LayerCosts, layer_costs
from steptune.pipeline.tune import TuneConfig, tune

__all__ = ["BenchConfig", "bench_model_costs", "run_bench", "suite"]

CLUSTER = "dgx-h100"
DATA_PARALLEL = 8
"""ZeRO-1 group size assumed for optimizer-state sharding (static bytes/param = 2 + 4 + 12/DP)."""
EXPERT_PARALLEL = 8


@dataclass(frozen=True, kw_only=True, slots=True)
class BenchConfig:
    model: str
    heterogeneous: bool
    num_devices: int
    num_microbatches: int
    overrides: tuple[tuple[str, Any], ...] = ()

    @property
    def label(self) -> str:
        extra = "".join(f",{k}={v}" for k, v in self.overrides)
        return f"{self.model}{extra} P={self.num_devices} M={self.num_microbatches}"


_MODELS: tuple[tuple[str, bool, tuple[tuple[str, Any], ...]], ...] = (
    ("gemma-2b", True, ()),
    ("gemma-7b", True, ()),
    ("nemotron-h-8b", True, ()),
    ("qwen2-vl-7b-like", True, ()),
    # 61 layers of DeepSeek-V3 do not fit 4-16 x 80 GB even with EP=8: 16 layers (3 dense + 13 MoE).
    ("deepseek-v3-like", True, (("num_hidden_layers", 16),)),
    ("llama2-7b", False, ()),
)


def suite(name: str) -> list[BenchConfig]:
    if name == "quick":
        return [
            BenchConfig(model=m, heterogeneous=h, num_devices=4, num_microbatches=8, overrides=o)
            for m, h, o in _MODELS
            if m in ("gemma-2b", "nemotron-h-8b", "llama2-7b")
        ]
    if name == "full":
        return [
            BenchConfig(model=m, heterogeneous=h, num_devices=p, num_microbatches=k * p, overrides=o)
            for m, h, o in _MODELS
            for p in (4, 8, 16)
            for k in (2, 4)
        ]
    raise ValueError(f"unknown suite {name!r}; use quick or full")


def bench_model_costs(cfg: BenchConfig) -> tuple[LayerCosts, float, Any]:
    """(per-layer costs, memory cap in bytes, P2P link) of a bench config."""
    cluster = cluster_preset(CLUSTER)
    model = model_preset(cfg.model, overrides=dict(cfg.overrides) or None)
    layers = layer_costs(
        model,
        cluster.device,
        static_bytes_per_param=2 + 4 + 12 / DATA_PARALLEL,
        expert_parallel=EXPERT_PARALLEL,
        a2a_link=cluster.intra,
    )
    return layers, cluster.device.memory_bytes, cluster.inter


def run_bench(
    configs: list[BenchConfig],
    *,
    time_budget: float = 20.0,
    ablate_head_split: bool = True,
    progress: Callable[[str], None] | None = None,
) -> dict[str, Any]:
    rows = []
    for cfg in configs:
        layers, cap, link = bench_model_costs(cfg)
        tcfg = TuneConfig(
            num_devices=cfg.num_devices,
            num_microbatches=cfg.num_microbatches,
            memory_cap=cap,
            link=link,
            time_budget=time_budget,
        )
        t0 = time.perf_counter()
        res = tune(layers, tcfg)
        seconds = time.perf_counter() - t0
        best = res.best_anchor
        row: dict[str, Any] = {
            "config": cfg.label,
            "heterogeneous": cfg.heterogeneous,
            "num_devices": cfg.num_devices,
            "num_microbatches": cfg.num_microbatches,
            "anchors": {k: c.makespan for k, c in sorted(res.anchors.items())},
            "anchors_memory_ok": {k: c.memory_ok for k, c in sorted(res.anchors.items())},
            "best_anchor": best.recipe if best else None,
            "best_anchor_makespan": best.makespan if best else None,
            "tuned": res.best.makespan,
            "tuned_recipe": res.best.recipe,
            "lower_bound": res.lower_bound,
            "speedup_vs_best_anchor": best.makespan / res.best.makespan if best else None,
            "tuner_seconds": seconds,
            "memory_ok": res.best.memory_ok,
            "tuned_peak_memory": max(res.best.result.peak_memory),
            "memory_cap": cap,
        }
        if ablate_head_split and res.best.schedule.meta.get("head_split", 1) > 1:
            no_split = tune(
                layers,
                TuneConfig(
                    num_devices=cfg.num_devices,
                    num_microbatches=cfg.num_microbatches,
                    memory_cap=cap,
                    link=link,
                    time_budget=time_budget,
                    split_head=False,
                ),
            )
            row["tuned_without_head_split"] = no_split.best.makespan
            row["speedup_without_head_split"] = best.makespan / no_split.best.makespan if best else None
        elif ablate_head_split:  # the tuned schedule does not split the head: the ablation is itself
            row["tuned_without_head_split"] = res.best.makespan
            row["speedup_without_head_split"] = row["speedup_vs_best_anchor"]
        rows.append(row)
        if progress:
            sp = row["speedup_vs_best_anchor"]
            progress(
                f"{cfg.label}: tuned {row['tuned']:.4g} s vs {row['best_anchor']} "
                f"{row['best_anchor_makespan'] or float('nan'):.4g} s -> {sp or float('nan'):.3f}x "
                f"({seconds:.1f} s)"
            )
    het = [r["speedup_vs_best_anchor"] for r in rows if r["heterogeneous"] and r["speedup_vs_best_anchor"]]
    geo = math.exp(sum(math.log(x) for x in het) / len(het)) if het else None
    return {"simulated": True, "cluster": CLUSTER, "rows": rows, "geomean_speedup_heterogeneous": geo}


def write_bench(result: dict[str, Any], json_path: Path) -> list[Path]:
    """JSON, a Markdown table and a speedup bar chart beside it."""
    from steptune.core.plot import bars
    from steptune.core.report import Table

    json_path.parent.mkdir(parents=True, exist_ok=True)
    json_path.write_text(json.dumps(result, indent=1))
    table = Table(
        title="pipeline bench (SIMULATED makespans, seconds per step)",
        columns=[
            "config",
            "best anchor",
            "anchor s",
            "tuned",
            "tuned s",
            "lower bound",
            "speedup",
            "no head split",
            "tuner s",
            "mem ok",
        ],
    )
    for r in result["rows"]:
        table.add(
            r["config"],
            r["best_anchor"],
            r["best_anchor_makespan"],
            r["tuned_recipe"],
            r["tuned"],
            r["lower_bound"],
            r["speedup_vs_best_anchor"],
            r.get("speedup_without_head_split", "-"),
            r["tuner_seconds"],
            r["memory_ok"],
        )
    geo = result["geomean_speedup_heterogeneous"]
    table.notes.append(
        "geomean speedup over the best anchor, heterogeneous configs: "
        + ("- (no heterogeneous config had an anchor)" if geo is None else f"{geo:.3f}x")
    )
    # beside the JSON, never over it (``--json b.md`` wrote the table over the results; a 2026-12-05 sweep)
    md, png_path = (json_path.with_name(json_path.name + ext) if json_path.suffix == ext else
                    json_path.with_suffix(ext) for ext in (".md", ".png"))  # fmt: skip
    md.write_text(table.to_markdown())
    png = bars(
        [r["config"] for r in result["rows"]],
        [r["speedup_vs_best_anchor"] or 0.0 for r in result["rows"]],
        png_path,
        ylabel="speedup vs best anchor (simulated)",
        reference=1.0,
        title="OctoPipe tuner vs best anchor",
    )
    table.print()
    return [json_path, md, png]
