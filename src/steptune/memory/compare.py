"""`steptune memory compare`: replay-only TapeSAC against no checkpointing and torch's full
checkpointing (early stop on and off) on one HF model, same batch, measured in one run.

Per policy: max |grad - no_ac grad| (both on one thread, see ``single_thread``), recomputation
added to backward (ops, matmul/attention FLOPs, bytes of fresh outputs), peak bytes (MemTracker,
one step) and the median step time of interleaved repeated steps. Times on this CPU are CPU
times; they are not GPU speedups.
"""

from __future__ import annotations

import json
import platform
import statistics
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

from steptune.core.report import Table, plural
from steptune.memory.measure import (
    POLICIES,
    grads,
    max_abs_diff,
    measure_peak,
    measure_work,
    single_thread,
    time_policies,
)
from steptune.memory.models import MODEL_PRESETS, build_model, make_batch

__all__ = ["CompareRow", "compare", "compare_table"]


@dataclass(frozen=True, slots=True)
class CompareRow:
    policy: str
    grad_max_abs_diff: float
    recompute_ops: int
    recompute_flops: int
    recompute_bytes: int
    peak_bytes: int
    activation_peak_bytes: int
    """Peak minus parameters, buffers, gradients and the batch."""
    step_time_s: float | None
    step_times_s: list[float]
    tapesac_over_this: float | None
    """Median over rounds of TapeSAC's step time / this policy's in the same round."""


def compare(
    model_name: str,
    *,
    repeats: int = 7,
    timed: bool = True,
    policies: tuple[str, ...] = POLICIES,
    overhead_repeats: int = 9,
    progress: Callable[[str], None] | None = None,
) -> dict[str, Any]:
    """Measure every policy on ``model_name``; returns a JSON-ready dict with ``rows``."""
    say = progress or (lambda msg: None)
    model = build_model(model_name)
    batch = make_batch(model_name)
    say("gradients")
    reference = single_thread(grads, model, batch, "no_ac")
    base = measure_work(model, batch, "no_ac")
    layer_ms = _layer_forward_ms(model, batch)
    rows: dict[str, dict[str, Any]] = {}
    for policy in policies:
        say(f"work and peak: {policy}")
        diff = max_abs_diff(reference, single_thread(grads, model, batch, policy))
        work = measure_work(model, batch, policy)
        peak, static = measure_peak(model, batch, policy)
        rows[policy] = {
            "policy": policy,
            "grad_max_abs_diff": diff,
            "recompute_ops": work.backward_ops - base.backward_ops,
            "recompute_flops": work.backward_flops - base.backward_flops,
            "recompute_bytes": work.backward_bytes - base.backward_bytes,
            "peak_bytes": peak,
            "activation_peak_bytes": peak - static,
            "step_time_s": None,
            "step_times_s": [],
            "tapesac_over_this": None,
        }
    if timed:
        times = single_thread(
            time_policies, model, batch, policies, repeats, lambda d, t: say(f"timing {d}/{t}")
        )
        tape_times = times.get("tapesac_replay")
        for policy, ts in times.items():
            rows[policy]["step_times_s"] = ts
            rows[policy]["step_time_s"] = statistics.median(ts)
            if tape_times is not None:
                # Per-round ratio, then the median: neighbours in time share the machine's state.
                rows[policy]["tapesac_over_this"] = statistics.median(
                    a / b for a, b in zip(tape_times, ts, strict=True)
                )
    overhead = single_thread(recording_overhead, model, batch, overhead_repeats) if timed else None
    preset = MODEL_PRESETS[model_name]
    return {
        "recording_overhead": overhead,
        "model": model_name,
        "family": preset.family,
        "config": preset.config,
        "batch": preset.batch,
        "seq": preset.seq,
        "layer_forward_ms": layer_ms,
        "repeats": repeats if timed else 0,
        "machine": f"{platform.machine()} {plural(torch.get_num_threads(), 'thread')}, "
        f"torch {torch.__version__}",
        "date": time.strftime("%Y-%m-%d"),
        "rows": [asdict(CompareRow(**r)) for r in rows.values()],
    }


def _layer_forward_ms(model: torch.nn.Module, batch: dict[str, torch.Tensor]) -> float:
    """Median forward time of the first decoder layer over 3 plain steps (hooks, no checkpointing)."""
    layer = model.model.layers[0]  # type: ignore[index,union-attr]
    stamps: list[float] = []
    pre = layer.register_forward_pre_hook(lambda *a: stamps.append(time.perf_counter()))
    post = layer.register_forward_hook(lambda *a: stamps.append(time.perf_counter()))
    spans = []
    try:
        for _ in range(3):
            stamps.clear()
            with torch.no_grad():
                model(**batch)
            spans.append((stamps[1] - stamps[0]) * 1e3)
    finally:
        pre.remove()
        post.remove()
    return statistics.median(spans)


def compare_table(result: dict[str, Any]) -> Table:
    rows = {r["policy"]: r for r in result["rows"]}
    table = Table(
        title=(
            f"{result['model']} ({result['family']}, batch {result['batch']} x {result['seq']} tokens, "
            f"layer forward {result['layer_forward_ms']:.0f} ms): TapeSAC replay-only vs torch checkpointing"
        ),
        columns=[
            "policy",
            "max |dgrad|",
            "recomputed ops",
            "recomputed GFLOP",
            "recomputed MiB written",
            "peak MiB",
            "act. peak MiB",
            "step s (median)",
            "TapeSAC / this (paired median)",
        ],
    )
    for name, r in rows.items():
        t = r["step_time_s"]
        ratio = r["tapesac_over_this"]
        table.add(
            name,
            r["grad_max_abs_diff"],
            r["recompute_ops"],
            round(r["recompute_flops"] / 1e9, 3),
            round(r["recompute_bytes"] / 2**20, 2),
            round(r["peak_bytes"] / 2**20, 2),
            round(r["activation_peak_bytes"] / 2**20, 2),
            None if t is None else round(t, 4),
            None if ratio is None else round(ratio, 3),
        )
    if result["repeats"]:
        table.notes.append(
            f"MEASURED on {result['machine']}, {result['date']}; times are medians of {result['repeats']} "
            "interleaved steps on one thread of this CPU (two threads made the rounds bimodal), not GPU "
            "figures"
        )
    else:
        table.notes.append(
            f"MEASURED on {result['machine']}, {result['date']}; step times not measured (--no-time)"
        )
    table.notes.append(
        "recomputation = backward work under the policy minus no_ac's (ops, torch FLOP formulas, bytes of "
        "fresh outputs); peak = torch MemTracker, all live storages, gradients allocated before the step; "
        "act. peak = peak minus parameters, buffers, gradients and batch"
    )
    return table


def overhead_table(result: dict[str, Any]) -> Table | None:
    o = result.get("recording_overhead")
    if not o:
        return None
    table = Table(
        title=f"{result['model']}: what recording costs (forward only, grad mode, one thread)",
        columns=["forward", "median s", "over plain"],
    )
    for name, t in o["forward_s"].items():
        table.add(name, round(t, 4), round(t / o["forward_s"]["plain"] - 1.0, 3))
    table.notes.append(
        f"recorder's own Python time per recorded forward: {o['recorder_python_s'] * 1e3:.1f} ms; "
        f"median of {o['repeats']} interleaved rounds (MEASURED, this CPU)"
    )
    return table


def write_json(result: dict[str, Any], path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result, indent=1))
    return path


def recording_overhead(
    model: torch.nn.Module, batch: dict[str, torch.Tensor], repeats: int = 9
) -> dict[str, Any]:
    """Forward time (grad mode, no backward) with no TapeSAC, with TapeSAC recording every call,
    and with TapeSAC reusing its tape; interleaved rounds, medians."""
    from steptune.memory.apply import TapeSACConfig, apply_tapesac_

    variants = {"plain": None, "record_every_call": False, "reuse_tape": True}
    times: dict[str, list[float]] = {v: [] for v in variants}
    record_s: list[float] = []
    for r in range(repeats + 1):
        for name, reuse in variants.items():
            handle = None if reuse is None else apply_tapesac_(model, TapeSACConfig(reuse_tapes=reuse))
            start = time.perf_counter()
            loss = model(**batch).loss
            elapsed = time.perf_counter() - start
            if handle is not None and reuse:
                loss = model(**batch).loss  # the first call recorded; time the reusing one
                start = time.perf_counter()
                loss = model(**batch).loss
                elapsed = time.perf_counter() - start
            if handle is not None and not reuse:
                record_s.append(handle.stats.record_s)
            del loss
            if handle is not None:
                handle.remove()
            if r > 0:
                times[name].append(elapsed)
    med = {k: statistics.median(v) for k, v in times.items()}
    return {
        "forward_s": med,
        "record_overhead": med["record_every_call"] / med["plain"] - 1.0,
        "reuse_overhead": med["reuse_tape"] / med["plain"] - 1.0,
        "recorder_python_s": statistics.median(record_s),
        "repeats": repeats,
    }
