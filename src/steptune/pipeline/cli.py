"""`steptune pipeline` verbs: tune, simulate, bench."""

from __future__ import annotations

import argparse
import sys
from dataclasses import replace
from pathlib import Path
from typing import Any

from steptune.core.argtypes import (
    byte_size,
    non_negative_float,
    output_dir,
    output_file,
    positive_float,
    positive_int,
    warn_ignored,
)

__all__ = ["register"]


def _costs_args(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--memory-cap",
        type=byte_size,
        default=None,
        help="bytes per device: 80e9, 80GB, 141GiB (default: the cluster device's memory)",
    )
    p.add_argument("--cluster", default="dgx-h100", help="cluster preset for device speed, memory and links")
    p.add_argument(
        "--efficiency", type=positive_float, default=0.5, help="fraction of peak FLOP/s matmuls reach"
    )


def _model_costs(args: argparse.Namespace, model: str) -> tuple[Any, float, Any]:
    from steptune.core.specs import cluster_preset, model_preset
    from steptune.pipeline.bench import DATA_PARALLEL, EXPERT_PARALLEL
    from steptune.pipeline.costs import layer_costs

    cluster = cluster_preset(args.cluster)
    layers = layer_costs(
        model_preset(model),
        cluster.device,
        efficiency=args.efficiency,
        static_bytes_per_param=2 + 4 + 12 / DATA_PARALLEL,
        expert_parallel=EXPERT_PARALLEL,
        a2a_link=cluster.intra,
    )
    cap = args.memory_cap if args.memory_cap is not None else cluster.device.memory_bytes
    return layers, cap, cluster.inter


def _write_outputs(out: Path, sched: Any, result: Any, title: str, *, time_unit: str = "ms") -> list[Path]:
    from steptune.core.plot import gantt

    out.mkdir(parents=True, exist_ok=True)
    return [
        sched.save(out / "schedule.csv"),
        sched.save(out / "schedule.json"),
        result.trace().write(out / "trace.json"),
        gantt(result.spans, out / "gantt.png", title=title, time_unit=time_unit),
    ]


def _tune(args: argparse.Namespace) -> int:
    from rich.console import Console

    from steptune.core.report import Table
    from steptune.pipeline.tune import TuneConfig, resimulate, tune

    console = Console(stderr=True)
    layers, cap, link = _model_costs(args, args.model)
    cfg = TuneConfig(
        num_devices=args.devices,
        num_microbatches=args.microbatches,
        memory_cap=cap,
        link=link,
        time_budget=args.time_budget,
    )
    with console.status("tuning ...") as status:
        res = tune(layers, cfg, progress=lambda msg: status.update(f"tuning: {msg}"))
    table = Table(
        title=f"{args.model}, P={args.devices}, M={args.microbatches} (SIMULATED, seconds per step)",
        columns=["schedule", "makespan", "vs tuned", "bubble %", "peak GB", "fits cap"],
    )
    best = res.best
    for name, c in sorted(res.anchors.items(), key=lambda kv: kv[1].makespan):
        table.add(
            name,
            c.makespan,
            c.makespan / best.makespan,
            100 * c.result.bubble_fraction,
            max(c.result.peak_memory) / 1e9,
            c.memory_ok,
        )
    table.add(
        f"TUNED {best.recipe}",
        best.makespan,
        1.0,
        100 * best.result.bubble_fraction,
        max(best.result.peak_memory) / 1e9,
        best.memory_ok,
    )
    table.notes += [
        f"lower bound max(work/P, heaviest unit): {res.lower_bound:.4g} s; tuner {res.seconds:.1f} s, "
        f"{res.num_evaluated} schedules simulated",
        *(f"not compared: {line}" for line in res.skipped_anchors),
        *_memory_bound_notes(res, cap),
        "assumptions: docs/pipeline.md",
    ]
    table.print()
    full = resimulate(best, layers, link=link)
    # the cost settings ride in the schedule, so that `pipeline simulate --model` can name a mismatch
    tuned = replace(best.schedule, meta={**best.schedule.meta, **_cost_settings(args, cap)})
    paths = _write_outputs(args.out, tuned, full, f"tuned: {best.recipe}")
    paths += list(table.write(args.out / "comparison"))
    print("wrote: " + ", ".join(str(p) for p in paths))
    return 0


def _cost_settings(args: argparse.Namespace, cap: float | None) -> dict[str, Any]:
    """The settings a schedule is tuned with: model, cluster, efficiency and the memory cap in bytes as
    resolved (``--memory-cap``, else the cluster device's memory)."""
    return {"model": args.model, "cluster": args.cluster, "efficiency": args.efficiency, "memory_cap": cap}


def _settings_notes(name: str, meta: dict[str, Any], args: argparse.Namespace, cap: float) -> list[str]:
    """Notes for the cost settings the schedule was tuned under that this simulation does not use."""
    if meta.get("model") and meta["model"] != args.model:  # same unit count, other model: its own note
        return [
            f"{name} was tuned for {meta['model']}; simulated with {args.model}'s costs, for which it is not "
            "tuned"
        ]

    def said(flag: str, value: Any) -> str:
        if flag == "--memory-cap" and isinstance(value, int | float):
            return f"{flag} {value / 1e9:g}GB"
        return f"{flag} {value:g}" if isinstance(value, float) else f"{flag} {value}"

    now, notes = _cost_settings(args, cap), []
    flags = (("cluster", "--cluster"), ("efficiency", "--efficiency"), ("memory_cap", "--memory-cap"))
    for key, flag in flags:
        if key in meta and meta[key] != now[key]:
            notes.append(
                f"{name} was tuned with {said(flag, meta[key])}, simulated with {said(flag, now[key])}: "
                "pass the tuner's settings to simulate what it tuned"
            )
    return notes


def _memory_bound_notes(res: Any, cap: float) -> list[str]:
    """Say so when the memory cap, not the schedule, sets the step time: no anchor fits, or the tuned
    step is far above the lower bound (few microbatches in flight, so most of the step is bubble)."""
    best, notes = res.best, []
    if res.anchors and res.best_anchor is None:
        notes.append(f"no anchor fits the {cap / 1e9:.4g} GB memory cap; only the tuned schedule does")
    peak = max(best.result.peak_memory)
    # the cap, not M < P, keeps the step long; no anchor at all (none could be built: M < P, or more stages
    # than layers) is no sign of a binding cap (found in a sweep: gemma-2b at P=24, M=4, a 10 TB cap)
    binds = (bool(res.anchors) and res.best_anchor is None) or peak >= 0.8 * cap
    if best.makespan > 2 * res.lower_bound and best.result.bubble_fraction > 0.5 and binds:
        notes.append(
            f"MEMORY-BOUND: the tuned step is {best.makespan / res.lower_bound:.1f}x the lower bound and "
            f"{100 * best.result.bubble_fraction:.0f}% bubble, because the cap leaves room for few "
            "microbatches in flight; more devices, activation checkpointing (steptune memory) or a "
            "larger --memory-cap would shorten it"
        )
    return notes


def _simulate(args: argparse.Namespace) -> int:
    from steptune.core.report import Table
    from steptune.pipeline.costs import StageCosts, split_layer, stage_costs, uniform_partition
    from steptune.pipeline.schedule import Schedule
    from steptune.pipeline.simulate import simulate

    written = {args.out / name for name in ("schedule.csv", "schedule.json", "trace.json", "gantt.png")}
    if Path(args.schedule).expanduser().resolve() in {p.expanduser().resolve() for p in written}:
        # a sweep: the tuner's schedule.json rewritten without its partition, a CSV without its SEND/RECV
        raise ValueError(
            f"--out {args.out} would write over the --schedule it reads ({args.schedule}): give --out a "
            "folder of its own"
        )
    sched = Schedule.load(args.schedule)
    notes = []
    if args.model:
        layers, cap, link = _model_costs(args, args.model)
        layers = split_layer(layers, layers.num_layers - 1, int(sched.meta.get("head_split", 1)))
        part = sched.partition
        if part is not None and sum(part) != layers.num_layers:
            tuned = sched.meta.get("model")
            raise ValueError(
                f"{args.schedule}: its partition covers {sum(part)} units, --model {args.model} has "
                f"{layers.num_layers} (after the head split): "
                + (f"it was tuned for {tuned}; " if tuned else "")
                + f"tune a schedule for {args.model} (steptune pipeline tune --model {args.model} ...)"
            )
        if part is None:
            if sched.num_stages > layers.num_layers:
                raise ValueError(
                    f"{args.schedule}: its {sched.num_stages} stages need at least one layer each, and "
                    f"--model {args.model} has {layers.num_layers}; use a schedule with at most "
                    f"{layers.num_layers} stages (steptune pipeline tune --model {args.model} ...)"
                )
            part = uniform_partition(layers.num_layers, sched.num_stages)
            split = int(sched.meta.get("head_split", 1))  # applied above: the note said "unsplit" (a sweep)
            head = f"split {split} ways (its meta.head_split)" if split > 1 else "unsplit"
            notes.append(
                f"{args.schedule.name} carries no layer partition (a CSV holds only the orders, and a JSON "
                "written by hand may not): "
                f"simulated with the uniform partition {list(part)} and the head {head}; the tuner's "
                "schedule.json carries its partition and head split"
            )
        notes += _settings_notes(args.schedule.name, sched.meta, args, cap)
        costs = stage_costs(layers, part, link=link)
    else:  # unit costs: F = I = W = 1, free communication
        if args.memory_cap is not None:
            raise ValueError(
                "--memory-cap is in bytes and needs --model: unit costs count activations, not bytes"
            )
        warn_ignored(args, ("cluster", "efficiency"), "without --model (unit costs)")
        cap = None
        costs = StageCosts.uniform(sched.num_stages)
        if sched.meta.get("model"):  # a tuned schedule: its model's costs were one flag away (a sweep)
            notes.append(
                f"{args.schedule.name} was tuned for {sched.meta['model']}; simulated with unit costs "
                f"(F = I = W = 1): pass --model {sched.meta['model']} (and the tuner's other settings) for "
                "its seconds and bytes"
            )
    res = simulate(sched, costs)
    timed = bool(args.model)  # seconds and bytes from the cost model; else unit costs and unit activations
    table = Table(
        title=f"{sched.name}: {sched.num_devices} devices, {sched.num_stages} stages, "
        f"{sched.num_microbatches} microbatches (SIMULATED)",
        columns=["device", "busy s" if timed else "busy (units)", "idle s" if timed else "idle (units)",
                 "peak memory GB" if timed else "peak memory (activations)"],
    )  # fmt: skip
    for d in range(sched.num_devices):
        mem = res.peak_memory[d] / 1e9 if timed else res.peak_memory[d]
        table.add(d, res.busy[d], res.idle(d), mem)
    unit = " s" if timed else " (units)"
    table.notes.append(
        f"makespan {res.makespan:.6g}{unit}, bubble fraction {res.bubble_fraction:.3f}"
        + (
            f", memory within cap: {res.memory_ok(cap)} ({args.model} on {args.cluster}; "
            "assumptions: docs/pipeline.md)"
            if timed
            else " (unit costs: F=I=W=1; trace.json shows one unit as 1 s)"
        )
    )
    table.notes += notes
    table.print()
    paths = _write_outputs(args.out, sched, res, f"{sched.name}", time_unit="ms" if timed else "units")
    print("wrote: " + ", ".join(str(p) for p in paths))
    return 0


def _bench(args: argparse.Namespace) -> int:
    from steptune.pipeline.bench import run_bench, suite, write_bench

    budget = args.time_budget if args.time_budget is not None else (5.0 if args.suite == "quick" else 25.0)
    result = run_bench(
        suite(args.suite),
        time_budget=budget,
        progress=lambda msg: print(msg, file=sys.stderr, flush=True),
    )
    paths = write_bench(result, args.json)
    print("wrote: " + ", ".join(str(p) for p in paths))
    return 0


def _run(args: argparse.Namespace) -> int:
    import json
    import os

    from steptune.core.argtypes import distinct_paths
    from steptune.pipeline.runner import rank_main
    from steptune.pipeline.schedule import Schedule

    distinct_paths(schedule=args.schedule, json=args.json)  # a sweep: the report replaced the schedule
    sched = Schedule.load(args.schedule)
    if sched.partition is None:
        raise ValueError(
            f"{args.schedule} has no partition: run a schedule written by `steptune pipeline tune` "
            "(schedule.json), or add a 'partition' list to the JSON"
        )
    # Check here what each rank would otherwise find on its own, in a traceback per rank: the model
    # preset against the partition, and that the schedule runs (simulate raises on a deadlock).
    from steptune.pipeline.costs import StageCosts
    from steptune.pipeline.runner import build_bundle
    from steptune.pipeline.simulate import simulate

    build_bundle(args.model, sched)
    simulate(sched, StageCosts.uniform(sched.num_stages))
    idle = [d for d in range(sched.num_devices) if not sched.stages_of(d)]
    with_torch = args.check and not idle
    if args.check and idle:  # torch's runtime refuses a rank without a stage (after spawning, per rank)
        print(
            f"note: device(s) {idle} hold no stage, which torch's runtime cannot run: --check compares "
            "gradients with the single-process reference but does not time torch's runtime",
            file=sys.stderr,
        )
    call = (sched.to_json(), args.model, args.repeats, with_torch, args.check)
    if "WORLD_SIZE" in os.environ:  # launched by torchrun: this process is one rank
        import datetime

        import torch.distributed as dist

        from steptune.core.dist import init_default_group

        if int(os.environ["WORLD_SIZE"]) != sched.num_devices:
            raise ValueError(
                f"torchrun started {os.environ['WORLD_SIZE']} ranks, the schedule needs {sched.num_devices}"
            )
        group = init_default_group(timeout=datetime.timedelta(seconds=120))
        try:
            report = rank_main(dist.get_rank(), group, *call)
        finally:
            dist.destroy_process_group()
        if int(os.environ.get("RANK", 0)) != 0:
            return 0
    else:
        from steptune.testing import SpawnPool

        if args.ranks != sched.num_devices:
            raise ValueError(
                f"--ranks {args.ranks} but the schedule places stages on {sched.num_devices} devices"
            )
        with SpawnPool(args.ranks, default_group=True, timeout=600, group_timeout=120) as pool:
            report = pool.run(rank_main, *call, timeout=600)[0]
    _run_table(report, args.repeats).print()
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(report, indent=1))
        print(f"wrote: {args.json}")
    return 0


def _run_table(report: dict[str, Any], repeats: int) -> Any:
    from steptune.core.report import Table

    t = Table(
        title=f"{report['schedule']}: {report['model']} on {report['num_ranks']} gloo ranks (MEASURED)",
        columns=["what", "value"],
    )
    t.add(f"our executor, step time (median of {repeats})", f"{report['measured_step_s']:.4g} s")
    if "torch_runtime_step_s" in report:
        ratio = report["torch_runtime_step_s"] / report["measured_step_s"]
        t.add(
            "torch.distributed.pipelining, same schedule",
            f"{report['torch_runtime_step_s']:.4g} s ({ratio:.2f}x ours)",
        )
    if "simulated_step_s" in report:
        t.add("simulator, calibrated latency and overhead", f"{report['simulated_step_s']:.4g} s (SIMULATED)")
        t.add("measured / simulated", f"{report['measured_step_s'] / report['simulated_step_s']:.3f}")
    if "grad_max_rel_diff" in report:
        t.add("gradients vs one process, max relative diff", f"{report['grad_max_rel_diff']:.2e}")
    t.notes.append("steps interleaved between the engines; the JSON (--json) holds every step's time")
    return t


def register(sub: Any) -> None:
    p = sub.add_parser(
        "pipeline",
        help="OctoPipe: pipeline simulator, bubble-aware co-tuner, anchor schedules",
        description="OctoPipe: simulate pipeline schedules and co-tune partition, placement and "
        "schedule for heterogeneous models. tune, simulate and bench times are simulated; run measures "
        "real ranks (docs/pipeline.md).",
    )
    verbs = p.add_subparsers(dest="verb", metavar="VERB", required=True)

    t = verbs.add_parser("tune", help="co-tune a model preset and compare with every anchor")
    t.add_argument("--model", required=True, help="model preset, e.g. gemma-2b")
    t.add_argument("--devices", type=positive_int, required=True, help="pipeline devices P")
    t.add_argument("--microbatches", type=positive_int, required=True, help="microbatches per step M")
    t.add_argument(
        "--time-budget",
        type=non_negative_float,
        default=20.0,
        help="seconds for the search (default 20); every anchor and the first list policy always run, so a "
        "large P x M can take longer than this (llama2-70b, P=64, M=1024: 27 s at --time-budget 5)",
    )
    t.add_argument("--out", type=output_dir, default=Path("runs/pipeline/tune"), help="output folder")
    _costs_args(t)
    t.set_defaults(func=_tune)

    s = verbs.add_parser("simulate", help="simulate a schedule file (.csv as torch writes it, or .json)")
    s.add_argument(
        "--schedule",
        type=Path,
        required=True,
        help="schedule file: torch's CSV, or JSON from `pipeline tune`",
    )
    s.add_argument("--model", default=None, help="model preset for costs (default: unit costs F=I=W=1)")
    s.add_argument("--out", type=output_dir, default=Path("runs/pipeline/simulate"), help="output folder")
    _costs_args(s)
    s.set_defaults(func=_simulate)

    r = verbs.add_parser(
        "run",
        help="run a schedule on real ranks with the executor; compare with the simulator",
        description="Run a schedule on N gloo ranks (spawned here, or one per process under "
        "torchrun) and report the measured step time against the simulator's prediction.",
    )
    r.add_argument("--schedule", type=Path, required=True, help="schedule.json written by `pipeline tune`")
    r.add_argument(
        "--model",
        default="sleep:gemma-2b",
        help="sleep:PRESET (sleeping layers timed from the preset) or tiny-decoder",
    )
    r.add_argument("--ranks", type=positive_int, default=4, help="ranks to spawn (ignored under torchrun)")
    r.add_argument("--repeats", type=positive_int, default=3, help="steps per engine; the median is reported")
    r.add_argument(
        "--check",
        action="store_true",
        help="also time torch's _PipelineScheduleRuntime on the same schedule, and compare our executor's "
        "gradients with a single-process reference",
    )
    r.add_argument("--json", type=output_file, default=None, help="write the report here")
    r.set_defaults(func=_run)

    b = verbs.add_parser(
        "bench", help="tuner vs every anchor on the benchmark suite; writes JSON + table + PNG"
    )
    b.add_argument(
        "--suite",
        choices=("quick", "full"),
        default="quick",
        help="quick: 3 models on 4 devices; full: every model on 4, 8 and 16 devices (default %(default)s)",
    )
    b.add_argument(
        "--json",
        type=output_file,
        default=Path("runs/pipeline/bench.json"),
        help="where to write the results; the table and PNG go next to it (default %(default)s)",
    )
    b.add_argument(
        "--time-budget",
        type=non_negative_float,
        default=None,
        help="search seconds per config (default: 5 for quick, 25 for full)",
    )
    b.set_defaults(func=_bench)
