"""`steptune memory` verbs: compare (replay-only TapeSAC vs torch checkpointing, measured)."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from steptune.core.argtypes import output_file, plot_file, positive_int

__all__ = ["register"]


def _compare(args: argparse.Namespace) -> int:
    from rich.console import Console

    from steptune.memory.compare import compare, compare_table, overhead_table, write_json
    from steptune.memory.models import MODEL_PRESETS

    if args.model not in MODEL_PRESETS:
        raise ValueError(f"unknown --model {args.model!r}; choose one of {sorted(MODEL_PRESETS)}")
    console = Console(stderr=True)
    with console.status("measuring ...") as status:
        result = compare(args.model, repeats=args.repeats, timed=not args.no_time, progress=status.update)
    compare_table(result).print()
    extra = overhead_table(result)
    if extra is not None:
        extra.print()
    if args.json:
        print(f"wrote: {write_json(result, args.json)}")
    return 0


_CPU_FLOPS = 2e10
"""A rough single-thread fp32 rate (20 GFLOP/s) for the run-time estimate below; only its order matters."""


def _warn_if_long(model: Any, batch: dict[str, Any]) -> None:
    """Say, before it starts, when a plan would take minutes: it profiles and measures about a dozen
    forward+backward passes, and a long --seq makes each quadratic in length."""
    b, s = batch["input_ids"].shape
    cfg = model.config
    params = sum(p.numel() for p in model.parameters())
    per_step = 6 * params * b * s + 6 * cfg.num_hidden_layers * cfg.hidden_size * b * s * s
    minutes = 12 * per_step / _CPU_FLOPS / 60
    if minutes > 2:
        print(
            f"steptune memory plan: note: {b} x {s} tokens is about {per_step / 1e12:.1f} TFLOP per step; "
            f"planning measures about a dozen steps, so expect roughly {minutes:.0f} minutes on one CPU "
            "thread",
            file=sys.stderr,
        )


def _parse_limit(text: str) -> float:
    """Bytes (with a unit, or a whole number >= 1024) or a fraction in (0, 1]; ValueError otherwise."""
    from steptune.memory.plan import parse_limit

    return parse_limit(text)


def _plan(args: argparse.Namespace) -> int:
    from steptune.core.report import Table
    from steptune.memory.measure import measure_last_free, measure_peak, single_thread
    from steptune.memory.models import MODEL_PRESETS, build_model, make_batch
    from steptune.memory.plan import calibrate, plan_within
    from steptune.memory.profile import profile_model

    if args.model not in MODEL_PRESETS:
        raise ValueError(f"unknown --model {args.model!r}; choose one of {sorted(MODEL_PRESETS)}")
    value = _parse_limit(args.limit)
    model = build_model(args.model)
    batch = make_batch(args.model, batch=args.batch, seq=args.seq)
    _warn_if_long(model, batch)
    profiles = single_thread(profile_model, model, batch)
    head: list[int] = []
    floor, _ = measure_peak(model, batch, "tapesac_replay", head=head)
    last_free, head_lf, phases_lf = measure_last_free(model, batch, profiles)
    peak_model = calibrate(
        profiles, floor, last_free, head[0] if head else None, head_lf[0] if head_lf else None, phases_lf
    )
    if value <= 1.0:
        top, _ = measure_peak(model, batch, "no_ac")
        limit = int(floor + value * (top - floor))
        how = (
            f"fraction {value} of the way from replay-only ({floor / 2**20:.1f} MiB) "
            f"to no checkpointing ({top / 2**20:.1f} MiB)"
        )
    else:
        limit, how = int(value), ""

    def measured(plan: Any) -> int:
        return measure_peak(model, batch, "tapesac_plan", plans={"tapesac_plan": plan.save_plan(profiles)})[0]

    plan, peak, tightened = plan_within(profiles, peak_model, limit, measured, solver=args.solver)
    table = Table(
        title=f"TapeSAC plan for {args.model} under {limit / 2**20:.1f} MiB" + (f" ({how})" if how else ""),
        columns=[
            "block signature (first block)",
            "blocks",
            "kept values",
            "kept MiB/block",
            "replayed ops",
            "replay ms/block",
        ],
    )
    rows = []
    for key, block_plan in plan.blocks.items():
        p = profiles[key]
        producers = sorted(
            {
                p.tape.nodes[p.tape.slots[sid].producer].name.removeprefix("aten.")
                for sid, _ in block_plan.keep
            }
        )
        rows.append(
            {
                "signature": p.name,
                "blocks": p.num_blocks,
                "kept_values": len(block_plan.keep),
                "kept_producers": producers,
                "kept_bytes_per_block": block_plan.kept_bytes,
                "replayed_ops": len(block_plan.replay_nodes),
                "replay_s_per_block": block_plan.replay_s,
            }
        )
        table.add(
            p.name,
            p.num_blocks,
            f"{len(block_plan.keep)}: " + ", ".join(producers) if producers else "0 (replay only)",
            round(block_plan.kept_bytes / 2**20, 2),
            len(block_plan.replay_nodes),
            round(block_plan.replay_s * 1e3, 2),
        )
    if plan.last_block is not None:  # its row above counts it with the others (a 2026-12-05 sweep)
        table.notes.append(
            f"the last block, {plan.last_block}, keeps every value backward reads and replays nothing: its "
            "backward runs first, so what it keeps is freed before any other block's replay"
        )
    table.notes.extend(tightened)
    table.notes.append(
        f"measured step peak {peak / 2**20:.2f} MiB (limit {limit / 2**20:.2f} MiB), "
        f"predicted {plan.predicted_peak / 2**20:.2f} MiB, "
        f"predicted replay {plan.predicted_replay_s * 1e3:.1f} ms/step; "
        f"solver {plan.solver} in {plan.solve_s:.2f} s; costs measured on this machine"
    )
    if args.json:  # first: nothing measured is lost if printing fails
        out = {
            "model": args.model,
            "batch": list(batch["input_ids"].shape),
            "limit_bytes": limit,
            "limit": args.limit,
            "measured_peak_bytes": peak,
            "predicted_peak_bytes": plan.predicted_peak,
            "predicted_replay_s_per_step": plan.predicted_replay_s,
            "solver": plan.solver,
            "solve_s": plan.solve_s,
            "last_block_kept_whole": plan.last_block,
            "signatures": rows,
            "notes": list(table.notes),
        }
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(out, indent=2, allow_nan=False) + "\n")
        print(f"wrote: {args.json}")
    table.print()
    return 0


def _bench(args: argparse.Namespace) -> int:
    import json

    from rich.console import Console

    from steptune.memory.bench import bench_table, dominance, pareto_plot, run_bench
    from steptune.memory.models import MODEL_PRESETS

    if args.model not in MODEL_PRESETS:
        raise ValueError(f"unknown --model {args.model!r}; choose one of {sorted(MODEL_PRESETS)}")
    with Console(stderr=True).status("bench ...") as status:
        result = run_bench(args.model, repeats=args.repeats, progress=status.update)
    result["dominance"] = dominance(result)
    bench_table(result).print()
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(result, indent=1))
        print(f"wrote: {args.json}")
    if getattr(args, "out", None):
        print(f"wrote: {pareto_plot(result, args.out)}")
    return 0


def register(sub: Any) -> None:
    from steptune.memory.models import MODEL_PRESETS

    p = sub.add_parser(
        "memory",
        help="TapeSAC: dispatcher-tape activation checkpointing (replay only what backward reads)",
        description=(
            "TapeSAC records each block's forward at the dispatcher and, in backward, replays only the "
            "producers of the values autograd reads. The memory-aware planner (plan) picks what to save "
            "under a step-peak limit; bench and pareto measure it against torch's checkpointing, "
            "torchtitan's op-level SAC, HF every_n_layers, Megatron and PyTorch's auto-SAC (docs/memory.md)."
        ),
    )
    verbs = p.add_subparsers(dest="verb", metavar="VERB", required=True)
    c = verbs.add_parser(
        "compare",
        help="measure replay-only TapeSAC against no checkpointing and torch's full checkpointing",
        description=(
            "One HF model from a preset (random weights): gradients vs no checkpointing, recomputation "
            "added to backward (ops, FLOPs, bytes), MemTracker peak, and median step time of interleaved "
            "steps, for no_ac, full_ac (early stop), full_ac_no_early_stop (torchtitan) and tapesac_replay."
        ),
    )
    c.add_argument(
        "--model", default="qwen3-small", help=f"one of {', '.join(MODEL_PRESETS)} (default qwen3-small)"
    )
    c.add_argument(
        "--repeats", type=positive_int, default=7, help="timed steps per policy, interleaved (default 7)"
    )
    c.add_argument("--no-time", action="store_true", help="skip timing (work, peaks and gradients only)")
    c.add_argument("--json", type=output_file, help="write the measurements to this JSON file")
    c.set_defaults(func=_compare)

    pl = verbs.add_parser(
        "plan",
        help="profile a model and print the fastest save plan under a step-peak limit",
        description=(
            "Profiles every block signature (measured per-op replay time), calibrates the step-peak model on "
            "one measured replay-only step, and solves the MILP (scipy HiGHS) for the limit. --limit takes "
            "bytes (300MiB, 2GiB, 123456789) or a fraction in (0, 1] of the way from the replay-only peak to "
            "the no-checkpointing peak. The step peak counts parameters, gradients, the batch and "
            "activations (one forward+backward); optimizer state (AdamW's two moments: twice the "
            "parameters) is not in it, so subtract it from the memory you have."
        ),
    )
    pl.add_argument("--model", default="qwen3-small", help=f"one of {', '.join(MODEL_PRESETS)}")
    pl.add_argument(
        "--limit",
        required=True,
        help="step-peak limit (parameters, gradients, batch and activations; not optimizer state): bytes "
        "(e.g. 300MiB) or a fraction in (0, 1]",
    )
    pl.add_argument("--batch", type=positive_int, help="batch size (default: the preset's)")
    pl.add_argument("--json", type=output_file, help="also write the plan and its figures to this JSON file")
    pl.add_argument("--seq", type=positive_int, help="sequence length (default: the preset's)")
    pl.add_argument(
        "--solver",
        default="milp",
        choices=["milp", "greedy"],
        help="milp: exact (scipy HiGHS, the default); greedy: by time saved per byte, for a quick look",
    )
    pl.set_defaults(func=_plan)
    for verb, text in (
        ("bench", "every anchor and TapeSAC's planned points, measured in one run (JSON)"),
        ("pareto", "the same run, written as a memory-vs-time plot (PNG) with every anchor's point"),
    ):
        b = verbs.add_parser(verb, help=text, description=text)
        b.add_argument("--model", default="qwen3-small", help=f"one of {', '.join(MODEL_PRESETS)}")
        b.add_argument(
            "--repeats", type=positive_int, default=7, help="timed rounds per row, interleaved (default 7)"
        )
        b.add_argument("--json", type=output_file, help="write the rows to this JSON file")
        if verb == "pareto":
            b.add_argument("--out", type=plot_file, default=Path("runs/memory_pareto.png"), help="PNG path")
        b.set_defaults(func=_bench)
