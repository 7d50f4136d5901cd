"""Executor fidelity on the sleep harness: every anchor and the tuned schedule, measured on real ranks.

For one model and (P, M): tune (simulated), then run the best-partition version of every anchor and
the tuned schedule with our executor and with torch's runtime, on P spawned gloo ranks whose
layers sleep the preset's per-layer times. Reports measured vs simulated step time (simulator
calibrated for P2P latency and per-action overhead on the same ranks), our step time vs torch's,
and the tuned schedule's measured vs simulated speedup over the best anchor.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from steptune.pipeline.bench import BenchConfig, bench_model_costs
from steptune.pipeline.runner import rank_main
from steptune.pipeline.tune import TuneConfig, tune

__all__ = ["executor_fidelity"]


def executor_fidelity(
    model: str = "gemma-2b",
    num_devices: int = 4,
    num_microbatches: int = 8,
    *,
    repeats: int = 3,
    time_budget: float = 10.0,
    progress: Callable[[str], None] | None = None,
) -> dict[str, Any]:
    from steptune.testing import SpawnPool

    cfg = BenchConfig(
        model=model, heterogeneous=True, num_devices=num_devices, num_microbatches=num_microbatches
    )
    layers, cap, link = bench_model_costs(cfg)
    res = tune(
        layers,
        TuneConfig(
            num_devices=num_devices,
            num_microbatches=num_microbatches,
            memory_cap=cap,
            link=link,
            time_budget=time_budget,
        ),
    )
    # The faster partition of each anchor that fits the cap, and the tuned schedule.
    best_of: dict[str, Any] = {}
    for key, cand in res.anchors.items():
        name = key.split("/")[0]
        if cand.memory_ok and (name not in best_of or cand.makespan < best_of[name].makespan):
            best_of[name] = cand
    runs = [(f"anchor {k}", c) for k, c in sorted(best_of.items())] + [("tuned", res.best)]
    rows = []
    with SpawnPool(num_devices, default_group=True, timeout=900, group_timeout=300) as pool:
        for label, cand in runs:
            rep = pool.run(
                rank_main, cand.schedule.to_json(), f"sleep:{model}", repeats, True, False, timeout=900
            )[0]
            row = {**rep, "label": label, "recipe": cand.recipe, "simulated_tuner_s": cand.makespan}
            row["sim_error"] = rep["measured_step_s"] / rep["simulated_step_s"] - 1
            row["ours_over_torch"] = rep["measured_step_s"] / rep["torch_runtime_step_s"]
            rows.append(row)
            if progress:
                progress(
                    f"{label}: measured {rep['measured_step_s']:.3f} s, "
                    f"simulated {rep['simulated_step_s']:.3f} s "
                    f"({100 * row['sim_error']:+.1f}%), torch {rep['torch_runtime_step_s']:.3f} s"
                )
    anchors = [r for r in rows if r["label"].startswith("anchor")]
    tuned = rows[-1]
    best_measured = min(anchors, key=lambda r: r["measured_step_s"])
    best_sim = min(anchors, key=lambda r: r["simulated_step_s"])
    return {
        "model": model,
        "num_devices": num_devices,
        "num_microbatches": num_microbatches,
        "rows": rows,
        "tuned_speedup_measured": best_measured["measured_step_s"] / tuned["measured_step_s"],
        "tuned_speedup_simulated": best_sim["simulated_step_s"] / tuned["simulated_step_s"],
        "max_abs_sim_error": max(abs(r["sim_error"]) for r in rows),
        "max_ours_over_torch": max(r["ours_over_torch"] for r in rows),
    }
