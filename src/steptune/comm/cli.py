"""`steptune comm` verbs: bench (stock FSDP2 vs TIDE on gloo), simulate and calibrate (the cost model)."""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from steptune.core.argtypes import output_file, positive_int

__all__ = ["register"]


def _bench(args: argparse.Namespace) -> int:
    from rich.console import Console

    from steptune.comm.bench import run_bench
    from steptune.comm.report import bench_tables, staging_plot

    console = Console(stderr=True)
    with console.status("comm bench ...") as status:
        report = run_bench(quick=args.quick, progress=status.update)
    out = Path(args.json)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2) + "\n")  # first: nothing measured is lost if printing fails
    for table in bench_tables(report):
        table.print()
    plot = staging_plot(report, out.with_suffix(".staging.png"))
    print(f"wrote: {out}\nwrote: {plot}")
    return 0


def _check_gpus(gpus: int) -> None:
    if gpus < 2:
        raise ValueError(
            f"--gpus {gpus}: FSDP shards over W >= 2 GPUs (at W = 1 there is nothing to communicate and "
            "enable_tide keeps stock FSDP2)"
        )


def _consts(path: str | None) -> Any:
    from steptune.comm.constants import CommConstants, calibrated

    return calibrated(path) if path else CommConstants()


def _simulate(args: argparse.Namespace) -> int:
    from steptune.comm.simreport import simulate_all, simulate_table

    _check_gpus(args.gpus)
    consts = _consts(args.calibration)
    simulate_table(args.model, args.cluster, args.gpus, consts, args.tokens).print()
    if args.json:
        res = simulate_all(args.model, args.cluster, args.gpus, consts, args.tokens)
        data = {
            "simulated": True,
            "model": args.model,
            "cluster": args.cluster,
            "gpus": args.gpus,
            "tokens_per_gpu": args.tokens,
            "constants": {k: getattr(consts, k) for k in consts.__slots__},
            "systems": {k: {f: getattr(r, f) for f in r.__slots__ if f != "spans"} for k, r in res.items()},
        }
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(data, indent=2, default=list) + "\n")
        print(f"wrote: {args.json}")
    return 0


def _calibrate(args: argparse.Namespace) -> int:
    from steptune.comm.constants import CommConstants
    from steptune.comm.simreport import simulate_table

    _check_gpus(args.gpus)
    consts = _consts(args.results)
    base = CommConstants()
    unfitted = {"hbm_contention": "the file's fit has none", **dict(consts.unfitted)}
    print(f"calibrated from {consts.calibrated_from}")
    for k in ("copy_out_bytes_per_s", "chunk_cat_elems_per_s", "pack_elems_per_s", "cast_elems_per_s",
              "accumulate_elems_per_s", "hbm_contention"):  # fmt: skip
        if k in consts.fitted:
            print(f"  {k:24s} {getattr(base, k):.4g} (cited) -> {getattr(consts, k):.4g} (measured)")
        else:
            why = f": {unfitted[k]}" if k in unfitted else ""
            print(f"  {k:24s} {getattr(base, k):.4g} (cited; not fitted{why})")
    simulate_table(args.model, args.cluster, args.gpus, consts).print()
    print(f"use it: steptune comm simulate --calibration {args.results} ...")
    return 0


def register(sub: Any) -> None:
    from steptune.core.specs import list_cluster_presets

    p = sub.add_parser(
        "comm",
        help="TIDE: zero-copy FSDP2 all-gather and bf16->fp32 reduce-scatter (bench on gloo)",
        description="TIDE: zero-copy, layout-aware FSDP2 collectives. Use enable_tide(model) from Python "
        "after fully_shard; `bench` measures stock FSDP2 and TIDE side by side on gloo (issue #9); "
        "`simulate` and `calibrate` run the 16-64 GPU cost model (issue #10, SIMULATED).",
    )
    verbs = p.add_subparsers(dest="verb", metavar="VERB", required=True)
    b = verbs.add_parser(
        "bench",
        help="stock FSDP2 vs TIDE on gloo: parameter equality, layout bytes, wire bytes, staging, time",
        description="Spawns W = 2, 3, 4 gloo ranks on loopback and trains an MLP and small HF Qwen3/Llama "
        "models with stock FSDP2 and with TIDE, interleaved; then sweeps the reduce-scatter alone over "
        "W = 2..8 thread ranks. Writes JSON and a staging plot next to it.",
    )
    b.add_argument("--json", type=output_file, required=True, help="where to write the results (JSON)")
    b.add_argument("--quick", action="store_true", help="W = 2, 4 and two models only (about a minute)")
    b.set_defaults(func=_bench)
    sim = verbs.add_parser(
        "simulate",
        help="SIMULATED: one FSDP2 step under stock, FSDP2+SymmMem and TIDE (per-layer event model)",
        description="The per-layer event model of issue #10: step time, layout-conversion share, "
        "interference, reduce-scatter SM time and buffers for each system. Constants are cited in "
        "steptune/comm/constants.py; --calibration replaces the kernel rates with measured ones.",
    )
    sim.add_argument("--model", default="llama3.1-70b", help="model preset (steptune.core presets)")
    sim.add_argument("--gpus", type=positive_int, default=64, help="FSDP world size W")
    sim.add_argument(
        "--cluster", default="dgx-h100", help=f"cluster preset: {', '.join(list_cluster_presets())}"
    )
    sim.add_argument("--tokens", type=positive_int, default=8192, help="tokens per GPU per step")
    sim.add_argument("--calibration", default=None, help="a benchmarks/gpu/comm.py JSON with a 'fit' section")
    sim.add_argument("--json", type=output_file, default=None, help="also write the results as JSON")
    sim.set_defaults(func=_simulate)
    cal = verbs.add_parser(
        "calibrate",
        help="feed a benchmarks/gpu/comm.py JSON into the model and show what changes",
    )
    cal.add_argument("results", help="JSON written by benchmarks/gpu/comm.py (its 'fit' section is used)")
    cal.add_argument("--model", default="llama3.1-70b", help="model preset (default %(default)s)")
    cal.add_argument("--gpus", type=positive_int, default=64, help="FSDP world size W (default %(default)s)")
    cal.add_argument(
        "--cluster",
        default="dgx-h200",
        help=f"cluster preset: {', '.join(list_cluster_presets())} (default dgx-h200: the GPU measured)",
    )
    cal.set_defaults(func=_calibrate)
