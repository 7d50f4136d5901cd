"""`steptune memory bench`: every anchor and TapeSAC's planned points on one model, one run.

Order: profile (per-op replay costs), reference gradients (one thread), each fixed policy's peak,
calibration of the peak model on the measured replay-only peak, one MILP plan per limit (a sweep
between the replay-only and no-checkpointing peaks, plus each anchor's own measured peak, so the
frontier has a point where every anchor sits), each plan's peak and gradients, then interleaved
timing of every row on one thread. Anchors are torch's and other systems' own mechanisms (see
``anchors.py``) and PyTorch's private auto-SAC decision model on the same measured op costs at
three memory budgets (``autosac.py``; it needs one signature, the first).
"""

from __future__ import annotations

import functools
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from steptune.core.report import Table
from steptune.memory.anchors import ANCHORS
from steptune.memory.autosac import auto_sac_context, auto_sac_decisions
from steptune.memory.measure import (
    grads,
    max_abs_diff,
    measure_last_free,
    measure_peak,
    measure_work,
    single_thread,
    time_policies,
)
from steptune.memory.models import MODEL_PRESETS, build_model, make_batch
from steptune.memory.plan import calibrate, plan_within
from steptune.memory.profile import profile_model

__all__ = ["FIXED", "bench_table", "dominance", "pareto_plot", "run_bench"]

FIXED = ("no_ac", "full_ac", "full_ac_no_early_stop", *ANCHORS, "tapesac_replay")


def run_bench(
    model_name: str,
    *,
    fractions: tuple[float, ...] = (0.25, 0.5, 0.75),
    auto_sac_budgets: tuple[float, ...] = (0.1, 0.25, 0.5),
    repeats: int = 7,
    progress: Callable[[str], None] | None = None,
) -> dict[str, Any]:
    say = progress or (lambda msg: None)
    model = build_model(model_name)
    batch = make_batch(model_name)
    say("profiling")
    t0 = time.perf_counter()
    profiles = single_thread(profile_model, model, batch)
    profile_s = time.perf_counter() - t0
    reference = single_thread(grads, model, batch, "no_ac")
    base_work = measure_work(model, batch, "no_ac")
    rows: dict[str, dict[str, Any]] = {}

    def measure(policy: str, plans: dict[str, Any] | None = None) -> dict[str, Any]:
        say(f"peak and gradients: {policy}")
        head: list[int] = []
        peak, _ = measure_peak(model, batch, policy, plans=plans, head=head)
        work = measure_work(model, batch, policy, plans=plans)
        diff = max_abs_diff(reference, single_thread(grads, model, batch, policy, None, plans))
        return {
            "policy": policy,
            "peak_bytes": peak,
            "head_peak_bytes": head[0] if head else None,
            "grad_max_abs_diff": diff,
            "replayed_flops": work.backward_flops - base_work.backward_flops,
            "replayed_ops": work.backward_ops - base_work.backward_ops,
        }

    plans: dict[str, Any] = {}
    for policy in FIXED:
        rows[policy] = measure(policy)
    # PyTorch's auto-SAC decision model on the same measured op costs, at fractions of op memory.
    block = next(iter(profiles.values()))
    for budget in auto_sac_budgets:
        name = f"torch_auto_sac@{budget:.2f}"
        plans[name] = auto_sac_context(auto_sac_decisions(block, budget))
        rows[name] = measure(name, plans)
    last_free, head_lf, phases_lf = measure_last_free(model, batch, profiles)
    replay = rows["tapesac_replay"]
    peak_model = calibrate(
        profiles,
        replay["peak_bytes"],
        last_free,
        replay["head_peak_bytes"],
        head_lf[0] if head_lf else None,
        phases_lf,
    )
    floor, top = rows["tapesac_replay"]["peak_bytes"], rows["no_ac"]["peak_bytes"]
    limits = {int(floor + f * (top - floor)) for f in fractions}
    limits.add(int((rows["full_ac"]["peak_bytes"] + top) / 2))  # the "halfway" limit
    limits |= {r["peak_bytes"] for name, r in rows.items() if name not in ("no_ac", "tapesac_replay")}
    unplanned: list[dict[str, Any]] = []
    for limit in sorted(limits):
        if limit < floor:
            continue
        name = f"tapesac_plan@{limit / 2**20:.3f}MiB"

        def measured(plan: Any, name: str = name) -> int:
            plans[name] = plan.save_plan(profiles)
            return measure_peak(model, batch, name, plans=plans)[0]

        try:
            plan, _, tightened = plan_within(profiles, peak_model, limit, measured)
        except ValueError as err:  # no measured plan within this limit: said in the result, not a crash
            plans.pop(name, None)
            unplanned.append({"limit_bytes": limit, "error": str(err)})
            continue
        row = measure(name, plans)
        row.update(
            limit_bytes=limit,
            predicted_peak_bytes=plan.predicted_peak,
            predicted_replay_s=plan.predicted_replay_s,
            solve_s=plan.solve_s,
            kept_values=sum(len(b.keep) for b in plan.blocks.values()),
            tightened=tightened,
        )
        rows[name] = row
    say("timing")
    order = tuple(rows)
    times = single_thread(
        functools.partial(time_policies, warmup=1, plans=plans),
        model,
        batch,
        order,
        repeats,
        lambda d, t: say(f"timing {d}/{t}"),
    )
    for name, ts in times.items():
        rows[name]["step_time_s"] = statistics.median(ts)
        rows[name]["step_times_s"] = ts
    preset = MODEL_PRESETS[model_name]
    return {
        "model": model_name,
        "family": preset.family,
        "config": preset.config,
        "batch": preset.batch,
        "seq": preset.seq,
        "repeats": repeats,
        "profile_s": profile_s,
        "machine": f"torch {torch.__version__}, timing on 1 thread",
        "date": time.strftime("%Y-%m-%d"),
        "rows": list(rows.values()),
        "unplanned_limits": unplanned,
    }


def paired_ratio(a: dict[str, Any], b: dict[str, Any]) -> float:
    """Median over interleaved rounds of a's step time / b's in the same round."""
    return statistics.median(x / y for x, y in zip(a["step_times_s"], b["step_times_s"], strict=True))


def dominance(result: dict[str, Any], noise: float = 0.02) -> dict[str, str | None]:
    """For each anchor (no_ac aside): the fastest TapeSAC row whose peak is no higher and whose
    per-round time ratio to the anchor is at most ``1 + noise``, or None."""
    rows = result["rows"]
    tape = [r for r in rows if r["policy"].startswith("tapesac")]
    out: dict[str, str | None] = {}
    for r in rows:
        if r["policy"].startswith("tapesac") or r["policy"] == "no_ac":
            continue
        hits = [(paired_ratio(t, r), t["policy"]) for t in tape if t["peak_bytes"] <= r["peak_bytes"]]
        hits = [h for h in hits if h[0] <= 1 + noise]
        out[r["policy"]] = min(hits)[1] if hits else None
    return out


def bench_table(result: dict[str, Any]) -> Table:
    table = Table(
        title=f"{result['model']}: every anchor and TapeSAC's planned points (MEASURED on this CPU)",
        columns=[
            "policy",
            "peak MiB",
            "predicted MiB",
            "step s",
            "replayed GFLOP",
            "max |dgrad|",
            "dominated by",
        ],
    )
    dom = dominance(result)
    for r in result["rows"]:
        pred = r.get("predicted_peak_bytes")
        table.add(
            r["policy"],
            round(r["peak_bytes"] / 2**20, 1),
            None if pred is None else round(pred / 2**20, 1),
            round(r["step_time_s"], 4),
            round(r["replayed_flops"] / 1e9, 3),
            r["grad_max_abs_diff"],
            dom.get(r["policy"], ""),
        )
    table.notes.append(
        f"{result['date']}, {result['machine']}; step time = median of {result['repeats']} interleaved "
        "rounds; peak = MemTracker with gradients allocated; 'dominated by': peak no higher and per-round "
        "time ratio <= 1.02"
    )
    return table


def pareto_plot(result: dict[str, Any], path: Path) -> Path:
    from steptune.core.plot import _pyplot, _save

    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(7.5, 4.8))
    tape = sorted(
        (r for r in result["rows"] if r["policy"].startswith("tapesac")), key=lambda r: r["peak_bytes"]
    )
    ax.plot(
        [r["peak_bytes"] / 2**20 for r in tape],
        [r["step_time_s"] for r in tape],
        "o-",
        color="tab:blue",
        label="TapeSAC (replay-only and planned)",
    )
    colors = iter(
        ["tab:gray", "tab:orange", "tab:green", "tab:red", "tab:purple", "tab:brown", "tab:pink", "tab:olive"]
    )
    markers = iter("sD^v<>Px")
    for r in result["rows"]:
        if r["policy"].startswith("tapesac"):
            continue
        ax.plot(
            r["peak_bytes"] / 2**20,
            r["step_time_s"],
            next(markers, "s"),
            color=next(colors, "k"),
            label=r["policy"],
        )
    ax.set_xlabel("measured peak memory (MiB)")
    ax.set_ylabel("median step time on this CPU (s)")
    ax.set_title(f"{result['model']}: memory vs time, measured ({result['date']})")
    ax.legend(fontsize=7, loc="center left", bbox_to_anchor=(1.0, 0.5))
    return _save(fig, path)
