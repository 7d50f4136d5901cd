"""`steptune resilience` verbs: detect (simulated scoring), trace (the real straggler trace),
simulate (one scenario, one or every policy) and bench (every policy on the 256-GPU scenarios)."""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any

from steptune.core.argtypes import (
    distinct_paths,
    output_file,
    plot_file,
    positive_float,
    positive_int,
    seed,
    warn_ignored,
)
from steptune.core.report import plural

__all__ = ["register"]


def _detect(args: argparse.Namespace) -> int:
    from steptune.core.report import Table
    from steptune.resilience.evaluate import JobSpec, detector_scores

    job = JobSpec(model=args.model, pp=args.pp, dp=args.dp, lengths=args.lengths)
    scores = detector_scores(job, runs=args.runs, steps=args.steps, factor=args.factor)
    table = Table(
        title=f"detectors on simulated {args.model} PP={args.pp} DP={args.dp} ({args.runs} runs, "
        f"one fail-slow x{args.factor} or fail-stop each)",
        columns=["detector", "detection rate", "false alarms / run", "mean latency (steps)"],
    )
    for name, s in scores.items():
        table.add(name, s["detection_rate"], s["false_alarms_per_run"], s["mean_latency_steps"])
    table.notes.append("SIMULATED device time; fail-stop runs are scored for the heartbeat monitor only")
    table.print()
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({"detector": scores}, indent=1))
        print(f"wrote: {args.json}")
    return 0


def _trace(args: argparse.Namespace) -> int:
    from steptune.core.report import Table
    from steptune.resilience.detect import ChangePointDetector, FixedThresholdDetector, ResiHPDetector
    from steptune.resilience.trace import load_trace, replay, trace_stats, trace_steps

    cols = load_trace(args.path)
    steps = trace_steps(cols)
    alarms = replay([ResiHPDetector(), FixedThresholdDetector(0.10), ChangePointDetector()], steps)
    stats = trace_stats(cols)
    table = Table(
        title=f"fail-slow alarms on the healthy straggler trace ({len(steps)} steps)",
        columns=["detector", "alarms", "ranks alarmed"],
    )
    for name, found in alarms.items():
        table.add(name, len(found), len({a.unit for a in found}))
    table.notes.append(
        f"trace: {stats.num_ranks} ranks x {stats.num_steps} steps; "
        f"step time mean {stats.step_time_mean:.2f} s, "
        f"CV {stats.step_time_cv:.3f}, slowest/median {stats.step_max_over_median:.2f}, "
        f"{stats.frac_steps_over_1p1:.0%} of steps over 1.1x the median; forward-compute CV "
        f"{stats.forward_cv:.2f} per microbatch, {stats.forward_rank_cv:.2f} across ranks per step"
    )
    table.print()
    return 0


def _simulate(args: argparse.Namespace) -> int:
    from steptune.core.report import Table
    from steptune.resilience.bench import POLICIES, DetectorCosts, job_for, make_policies, workload_for
    from steptune.resilience.scenarios import KINDS, generate, read_csv
    from steptune.resilience.sim import run

    distinct_paths(scenario=args.scenario if Path(args.scenario).is_file() else None, json=args.json)
    job = job_for(args.model)
    if args.free_comm:
        job = replace(job, comm=False)
    if args.scenario in KINDS:
        failures = generate(
            args.scenario, num_devices=job.num_devices, duration_s=args.duration, seed=args.seed
        )
    elif Path(args.scenario).is_file():
        try:
            failures = read_csv(Path(args.scenario), num_devices=job.num_devices)
        except ValueError as e:
            print(f"steptune resilience simulate: error: {e}", file=sys.stderr)
            return 2
        if _lengths(args.lengths) is None:  # --seed seeds a generated scenario and the packed lengths
            warn_ignored(args, ["seed"], "with a CSV scenario and --lengths mean")
    else:
        looks_like_path = args.scenario.endswith(".csv") or os.sep in args.scenario
        what = "no such file" if looks_like_path else "neither a CSV file nor a scenario name"
        print(
            f"steptune resilience simulate: error: --scenario {args.scenario!r}: {what}; give a CSV trace "
            f"(kind,device,start_s,duration_s,factor) or one of {', '.join(KINDS)}",
            file=sys.stderr,
        )
        return 2
    late = [f for f in failures if f.start_s >= args.duration]
    if late:
        print(
            f"steptune resilience simulate: warning: {len(late)} failure(s) start at or after --duration "
            f"{args.duration:g} s and never happen (first: {late[0].kind} at {late[0].start_s:g} s)",
            file=sys.stderr,
        )
    if not job.comm and any(f.target == "link" for f in failures):
        print(
            "steptune resilience simulate: error: the scenario has link fail-slows; drop --free-comm so that "
            "communication is priced",
            file=sys.stderr,
        )
        return 2
    names = POLICIES if args.policy == "all" else (args.policy,)
    makers = make_policies(DetectorCosts())
    unknown = [n for n in names if n not in makers]
    if unknown:
        print(
            f"steptune resilience simulate: error: unknown policy {unknown[0]!r}; choose all or one of "
            f"{', '.join(POLICIES)}",
            file=sys.stderr,
        )
        return 2
    table = Table(
        title=f"{args.model} TP{job.tp} PP{job.pp} DP{job.dp} ({job.num_devices} GPUs), "
        f"{args.scenario}: {plural(len(failures), 'failure')} in {args.duration:.0f} s",
        columns=["policy", "tokens/s", "stall s", "lost s", "halted s", "cut s", "plans"],
    )
    results = {}
    workload = workload_for(job, _lengths(args.lengths), seed=args.seed)
    for name in names:
        r = run(job, makers[name](), failures, args.duration, workload=workload)
        results[name] = {
            "tokens_per_s": r.tokens_per_s,
            "stall_s": r.stall_s,
            "lost_s": r.lost_s,
            "halted_s": r.halted_s,
            "cut_s": r.cut_s,
            "log": list(r.log),
        }
        table.add(name, r.tokens_per_s, r.stall_s, r.lost_s, r.halted_s, r.cut_s, len(r.log))
        if args.verbose:
            for line in r.log:
                print(f"  {name}: {line}")
    table.notes.append(
        "cut s: the last step, cut off by the end of the run (a step is priced at the speeds when it starts, "
        "so a device slowed mid-step shows from the next one)"
    )
    table.notes.append(
        "SIMULATED (docs/resilience.md lists the assumptions); "
        + (
            f"each step's batch packed from the {args.lengths!r} lengths"
            if workload
            else "every microbatch costs the mean"
        )
    )
    table.print()
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(
            json.dumps(
                {
                    "scenario": args.scenario,
                    "model": args.model,
                    "duration_s": args.duration,
                    "seed": args.seed,
                    "free_comm": args.free_comm,
                    "lengths": _lengths(args.lengths),
                    # one object per failure, the scenario CSV's columns; duration_s null: persistent
                    "failures": [
                        {**asdict(f), "duration_s": None if f.duration_s == math.inf else f.duration_s}
                        for f in failures
                    ],
                    "policies": results,
                },
                indent=1,
                allow_nan=False,
            )
        )
        print(f"wrote: {args.json}")
    return 0


def _slowdown(text: str) -> float:
    factor = positive_float(text)
    if factor <= 1:
        raise argparse.ArgumentTypeError(f"must be a slowdown > 1 (1.25 = 25% slower), got {text}")
    return factor


def _add_lengths(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--lengths",
        choices=("code", "chat", "uniform", "mean"),
        default="mean",
        help="mean (default): every microbatch costs the mean; or a length preset each step's packed batch "
        "is drawn from (baselines deal it to DP replicas by count, ResiHP and steptune by predicted cost; "
        "experimental: its linear pricing overstates the gain in deep pipelines, see docs/resilience.md)",
    )


def _lengths(name: str) -> str | None:
    return None if name == "mean" else name


def _bench(args: argparse.Namespace) -> int:
    from steptune.resilience.bench import BenchConfig, quick_config, run_bench
    from steptune.resilience.report import plot_bench, print_bench

    distinct_paths(json=args.json, plot=args.plot)
    if args.quick:
        warn_ignored(args, ["seeds"], "with --quick (one seed per scenario)")
    cfg = (
        quick_config(workers=args.workers)
        if args.quick
        else BenchConfig(seeds=tuple(range(args.seeds)), workers=args.workers)
    )
    if args.models:
        from steptune.core.specs import model_preset
        from steptune.resilience.bench import job_for
        from steptune.resilience.policies import NoOp
        from steptune.resilience.sim import run

        models = tuple(dict.fromkeys(m.strip() for m in args.models.split(",")))  # a repeat counted twice
        for m in models:  # every name before the first scenario runs (a typo used to surface minutes in)
            model_preset(m)
            try:  # and that it fits the bench's job: a model that did not lost every row run before it
                run(job_for(m), NoOp(), [], 1.0)
            except ValueError as err:
                raise ValueError(
                    f"--models {m} does not fit the bench's job (TP 4, PP 16, DP 4 on 256 GPUs): {err}; "
                    "leave it out, or simulate it alone with `steptune resilience simulate --model`"
                ) from None
        cfg = replace(cfg, models=models)
    cfg = replace(cfg, lengths=_lengths(args.lengths))
    res = run_bench(cfg, progress=lambda m: print(m, flush=True))
    print_bench(res)
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(res, indent=1, allow_nan=False))
    print(f"wrote: {args.json}")
    if args.plot:
        plot_bench(res, args.plot)
        print(f"wrote: {args.plot}")
    return 0


def _sweep(args: argparse.Namespace) -> int:
    from steptune.core.report import Table
    from steptune.resilience.sweep import fail_slow_duration_sweep, failure_rate_sweep, length_cv_sweep

    say = lambda m: print(m, flush=True)  # noqa: E731
    scales = (0.5, 2.0) if args.quick else (0.5, 1.0, 2.0)
    rate = failure_rate_sweep(
        model=args.model,
        rate_scales=scales,
        duration_s=1800.0 if args.quick else 7200.0,
        detector_runs=4 if args.quick else 12,
        workers=args.workers,
        progress=say,
    )
    t = Table(
        title=f"failure-rate sensitivity, {args.model} (SIMULATED): ResiHP / baseline",
        columns=["rate x", "kind", "failures", "ResiHP / oracle", "ratio vs home baselines"],
    )
    for r in rate["rows"]:
        vs = ", ".join(f"{b} {x:.3f}" if x is not None else f"{b} inf" for b, x in r["ratio_vs"].items())
        t.add(r["rate_scale"], r["kind"], r["failures"], r["of_oracle"], vs)
    t.print()
    dur = fail_slow_duration_sweep(
        model=args.model,
        kinds=("fail-slow-strong",) if args.quick else ("fail-slow-medium", "fail-slow-strong"),
        duration_s=1800.0 if args.quick else 7200.0,
        detector_runs=4 if args.quick else 12,
        workers=args.workers,
        progress=say,
    )
    homes = sorted({b for r in dur["rows"] for xs in r["ratio_vs"].values() for b in xs})
    t = Table(
        title=f"fail-slow duration sensitivity, {args.model} (SIMULATED): ours / baseline",
        columns=["fail-slows", "kind", "failures", "policy", "of oracle", *(f"vs {b}" for b in homes)],
    )
    for r in dur["rows"]:
        what = "persistent" if r["persistent"] else f"median {r['median_s'] / 60:.0f} min"
        for ours, xs in r["ratio_vs"].items():
            vs = [xs.get(b) if xs.get(b) is not None else float("inf") for b in homes]
            t.add(what, r["kind"], r["failures"], ours, r["of_oracle"][ours], *vs)
    t.print()
    sigmas = (0.5, 1.5) if args.quick else (0.5, 1.0, 1.5)
    cv = length_cv_sweep(sigmas=sigmas, runs=4 if args.quick else 20)
    t = Table(
        title="length-spread sensitivity of the detectors (SIMULATED, 1.25x fail-slow or fail-stop per run)",
        columns=[
            "sigma",
            "mb fwd CV",
            "step CV",
            "ResiHP false/run",
            "ResiHP det.",
            "fixed false/run",
            "change-pt false/run",
        ],
    )
    for r in cv["rows"]:
        d = r["detector"]
        t.add(
            r["sigma"],
            r["microbatch_forward_cv"],
            r["step_cv"],
            d["resihp"]["false_alarms_per_run"],
            d["resihp"]["detection_rate"],
            d["fixed-threshold"]["false_alarms_per_run"],
            d["change-point"]["false_alarms_per_run"],
        )
    t.print()
    args.json.parent.mkdir(parents=True, exist_ok=True)
    res = {"failure_rate": rate, "fail_slow_duration": dur, "length_cv": cv}
    args.json.write_text(json.dumps(res, indent=1, allow_nan=False))
    print(f"wrote: {args.json}")
    return 0


def _parse_inject(spec: str) -> dict[str, Any]:
    """``slow:...`` (a slow device) or ``slow-link:...`` (a slow network link); ``kind`` says which."""
    kind, _, rest = spec.partition(":")
    if kind not in ("slow", "slow-link"):
        raise ValueError(
            f"--inject {spec!r}: use slow:rank=R,factor=F,at=S[,for=D] (a device) or slow-link:... (rank R's "
            "network link); fail-stop is `steptune resilience failstop`"
        )
    if ";" in rest:  # a sweep: "slow:...;slow:..." was reported as "factor is given twice"
        raise ValueError(f"--inject {spec!r}: one fault per --inject; repeat the flag for two faults")
    kv: dict[str, str] = {}
    for item in rest.split(","):
        key, eq, value = item.partition("=")
        if not eq or key != key.strip() or value != value.strip() or not key:
            raise ValueError(
                f"--inject {spec!r}: {item!r} is not key=value (no spaces): "
                f"write {kind}:rank=R,factor=F,at=S[,for=D]"
            )
        if key in kv:
            raise ValueError(f"--inject {spec!r}: {key} is given twice")
        kv[key] = value
    unknown = sorted(set(kv) - {"rank", "factor", "at", "for"})
    missing = sorted({"rank", "factor", "at"} - set(kv))
    if unknown or missing:
        what = "; ".join(
            ([f"unknown key(s) {', '.join(unknown)}"] if unknown else [])
            + ([f"missing {', '.join(missing)}"] if missing else [])
        )
        raise ValueError(f"--inject {spec!r}: {what}: expected {kind}:rank=R,factor=F,at=S[,for=D]")
    try:
        fault: dict[str, Any] = {
            "rank": int(kv["rank"]),
            "factor": float(kv["factor"]),
            "start": int(kv["at"]),
        }
        if "for" in kv:
            fault["duration"] = int(kv["for"])
    except ValueError:
        raise ValueError(
            f"--inject {spec!r}: rank, at and for are whole numbers (steps), factor a number"
        ) from None
    from steptune.resilience.runtime import fault_range_error

    # SlowFault's ranges, named by this flag's keys
    args = (fault["rank"], fault["factor"], fault["start"], fault.get("duration"))
    problem = fault_range_error(*args, names=("rank", "factor", "at", "for"))
    if problem:
        raise ValueError(f"--inject {spec!r} ({problem}")
    fault["kind"] = kind
    return fault


def _steps_to_arm(microbatches: int = 16) -> int:
    """Steps before the runtime judges a rank: the predictor's warm-up samples (every rank's microbatches
    count), then the detector's baseline of residuals per rank."""
    from steptune.resilience.runtime import RuntimeConfig

    cfg = RuntimeConfig()  # the runtime's own warm-ups (its predictor's is not PredictorConfig's default)
    return math.ceil(cfg.predictor.warmup / microbatches) + cfg.detector.warmup


def _run(args: argparse.Namespace) -> int:
    from steptune.resilience.live import compare, run_live
    from steptune.resilience.livesim import predict_live
    from steptune.resilience.pipelined import compare_pipelined, parse_layout, run_pipelined
    from steptune.resilience.tensorpar import compare_tensor_parallel, run_tensor_parallel

    if (args.json or args.plot) and not args.compare:
        raise ValueError("--json and --plot write the --compare results: add --compare")
    distinct_paths(json=args.json, plot=args.plot)
    if args.layout is None:
        args.layout = f"dp={args.ranks}"
    dp, pp, tp = parse_layout(args.layout)
    if dp * pp * tp != args.ranks:
        raise ValueError(
            f"--layout {args.layout!r} needs dp*pp*tp = {dp * pp * tp} ranks; got --ranks {args.ranks}"
        )
    faults = [_parse_inject(x) for x in args.inject]
    for f in faults:
        if not 0 <= f["rank"] < args.ranks:
            raise ValueError(f"--inject rank {f['rank']} is outside 0..{args.ranks - 1}")
        if not 0 <= f["start"] < args.steps:
            raise ValueError(f"--inject at={f['start']} never comes: the run has steps 0..{args.steps - 1}")
    if args.compare:  # the comparison measures from after the warm-up and the fault's first step
        first = max([5, *(f["start"] + 1 for f in faults)])
        if args.steps <= first:
            raise ValueError(
                f"--compare measures throughput from step {first} on; --steps {args.steps} leaves nothing to "
                "measure (80 with a fault at step 20 is the documented setting)"
            )
    armed = _steps_to_arm()
    for f in faults:
        if f["start"] < armed:
            print(
                f"steptune resilience run: warning: --inject at={f['start']} comes before the detector has "
                f"learned each rank's normal (its first {armed} steps at 16 microbatches per step): the "
                "slowdown is partly taken as rank "
                f"{f['rank']}'s normal, so it is found late and underestimated; inject at={armed} or later",
                file=sys.stderr,
            )
    links = [{k: v for k, v in f.items() if k != "kind"} for f in faults if f["kind"] == "slow-link"]
    faults = [{k: v for k, v in f.items() if k != "kind"} for f in faults if f["kind"] == "slow"]
    if links and tp > 1:
        raise ValueError(
            "--inject slow-link is built for the DP and DP x PP layouts (their gradient all-reduces), not "
            "with tp > 1"
        )
    if links and args.ranks_per_node is None:
        print(
            "steptune resilience run: warning: every rank is on one node, so the gradient all-reduce runs "
            "over the node's own links and a slow link barely shows; add --ranks-per-node 1 to put it on "
            "the network",
            file=sys.stderr,
        )
    spec: dict[str, Any] = {
        "steps": args.steps,
        "faults": faults,
        "link_faults": links,
        "ranks_per_node": args.ranks_per_node,
        "time_scale": args.time_scale if args.time_scale is not None else (0.05 if pp * tp > 1 else 0.02),
        "seed": args.seed,
    }
    if links and dp < 2:
        raise ValueError("--inject slow-link slows a gradient all-reduce among DP replicas: use dp >= 2")
    if pp > 1:
        spec.update(dp=dp, pp=pp)
        if links:  # each stage's DP all-reduce over the link, in all three runs of --compare
            spec.update(stage_sync=True)
    if tp > 1:
        spec.update(dp=dp, tp=tp, tp_policy=args.tp_policy)
    if tp == 1 or args.compare:
        warn_ignored(
            args, ["tp_policy"], "without tp > 1 in --layout" if tp == 1 else "with --compare (it runs both)"
        )
    if args.compare:

        def progress(line: str) -> None:
            print(f"steptune resilience run --compare: {line}", file=sys.stderr, flush=True)

        if tp > 1:
            res = compare_tensor_parallel(spec, progress)
        else:
            res = compare_pipelined(spec, progress) if pp > 1 else compare(spec, args.ranks, progress)
        tput = res["throughput_tokens_per_s"]
        print(f"healthy run: ResiHP false alarms {res['false_alarms']}, fixed 10% threshold "
              f"{res['fixed_threshold_false_alarms']} (step CV {res['healthy_step_cv']:.1%})")  # fmt: skip
        if res["detection_delay_steps"] is not None:
            print(f"detection delay {res['detection_delay_steps']} steps, rank {res['detected_rank']}, "
                  f"estimated slowdown {res['estimated_slowdown']}")  # fmt: skip
        elif faults:
            print("the injected slowdown was not detected in this run")
        for x in res.get("link_alarms", []):
            delay = res["link_detection_delay_steps"]
            print(f"slow link detected after step {x['step']} ({delay} steps after onset): "
                  f"rank {x['rank']}'s link, probe {x['link']} x{x['slowdown']} "
                  "(no adaptation: see docs/resilience.md)")  # fmt: skip
        for change in res.get("plan_changes", []):
            print(f"plan change after step {change['step']}: {'; '.join(change['log'])}")
        for change in res.get("adapted_uneven_plan_changes", []):
            print(f"steptune uneven TP shares, after step {change['step']}: {'; '.join(change['log'])}")
        if "uneven_vs_resihp" in res:
            print(f"steptune (uneven TP shares) vs ResiHP (exclusion): {res['uneven_vs_resihp']:.3f}x "
                  f"({tput['adapted_uneven']:.0f} tokens/s)")  # fmt: skip
        print(f"throughput from step {res['throughput_window_from_step']} (tokens/s, emulated): healthy "
              f"{tput['healthy']:.0f}, unmitigated {tput['unmitigated']:.0f}, adapted {tput['adapted']:.0f} "
              f"({tput['adapted'] / tput['healthy'] - 1:+.1%} vs healthy, "
              f"{tput['adapted'] / tput['unmitigated']:.2f}x unmitigated)")  # fmt: skip
        if faults or links:
            pred = res["simulated"] = predict_live(res)
            for name in ("workload", "mean_microbatch", "calibrated"):
                err = pred[name]["error"]
                print(
                    f"simulator ({name}) vs measured: " + ", ".join(f"{k} {v:+.1%}" for k, v in err.items())
                )
            print(f"(workload: this run's own microbatches, nothing fitted; calibrated: + "
                  f"{pred['calibrated_overhead_s']:.2f} s per step fitted on the healthy run"
                  + ("; mean_microbatch does not model the slow link" if links else "") + ")")  # fmt: skip
            steps = pred["workload"]["per_step"]
            print("per step (workload): " + ", ".join(
                f"{k} MAPE {v['mape']:.1%} r={v['corr']:.2f}" for k, v in steps.items()))  # fmt: skip
        if args.plot:
            from steptune.resilience.livesim import plot_live

            print(f"wrote: {plot_live(res, args.plot)}")
        if args.json:
            args.json.parent.mkdir(parents=True, exist_ok=True)
            args.json.write_text(json.dumps(res, indent=2) + "\n")
            print(f"wrote: {args.json}")
        return 0
    if tp > 1:
        out = run_tensor_parallel({**spec, "adapt": not args.no_adapt})
    elif pp > 1:
        out = run_pipelined({**spec, "adapt": not args.no_adapt})
    else:
        out = run_live({**spec, "adapt": not args.no_adapt}, args.ranks)
    print(f"per step: emulated device seconds (wall / --time-scale {spec['time_scale']}; step 0 includes "
          "start-up), tokens per emulated second, loss, each rank's estimated speed")  # fmt: skip
    for r in out["reports"]:
        alarms = ", ".join(f"rank {u} x{s}" for u, s in r["alarms"])
        print(f"step {r['step']:3d}  {r['wall_s']:6.2f} s  {r['tokens'] / r['wall_s']:8.0f} tok/s  "
              f"loss {out['losses'][r['step']]:.4f}  speeds {[round(x, 2) for x in r['speeds']]}"
              + (f"  partition {r['partition']}" if "partition" in r else "")
              + (f"  tp groups {r['tp_groups']} units {r['units']}" if "tp_groups" in r else "")
              + (f"  DETECTED {alarms}" if alarms else "")
              + "".join(f"  SLOW LINK rank {x['rank']} (link {x['link']}) x{x['slowdown']}"
                        for x in r.get("link_alarms", [])))  # fmt: skip
        for line in r.get("plan_log", []):
            print(f"          plan: {line}")
    return 0


def _failstop(args: argparse.Namespace) -> int:
    from steptune.resilience.failstop import compare_failstop
    from steptune.resilience.pipelined import parse_layout

    spec = {"steps": args.steps, "kill_rank": args.kill_rank, "kill_step": args.kill_step,
            "checkpoint_every": args.checkpoint_every, "time_scale": args.time_scale,
            "seed": args.seed}  # fmt: skip
    if not 0 <= args.kill_step < args.steps:
        raise ValueError(f"--kill-step {args.kill_step}: the run has steps 0..{args.steps - 1} (--steps)")
    if args.layout is None:
        args.ranks = 4 if args.ranks is None else args.ranks
        if args.ranks < 2:
            raise ValueError("--ranks must be >= 2: a dead rank's survivors are its data-parallel peers")
        if not 0 <= args.kill_rank < args.ranks:
            raise ValueError(f"--kill-rank {args.kill_rank}: the job has ranks 0..{args.ranks - 1} (--ranks)")
        res = compare_failstop({**spec, "ranks": args.ranks})
        where = f"before step {args.kill_step}'s all-reduce"
    else:
        dp, pp, tp = parse_layout(args.layout)
        if args.ranks is not None and args.ranks != dp * pp * tp:  # it was ignored without a word
            raise ValueError(
                f"--ranks {args.ranks} but --layout {args.layout} has {dp * pp * tp} ranks: drop --ranks"
            )
        if dp < 2:
            raise ValueError(
                f"--layout {args.layout}: fail-stop survival restores a dead rank's state from a "
                "data-parallel peer, so it needs dp >= 2"
            )
        if not 0 <= args.kill_rank < dp * pp * tp:
            raise ValueError(
                f"--kill-rank {args.kill_rank}: the layout {args.layout} has ranks 0..{dp * pp * tp - 1}"
            )
        where = f"mid-step {args.kill_step} ({args.layout})"
        if pp > 1:
            from steptune.resilience.failstop_pipe import compare_failstop_pipe

            res = compare_failstop_pipe({**spec, "dp": dp, "pp": pp})
        elif tp > 1:
            from steptune.resilience.failstop_tp import compare_failstop_tp

            res = compare_failstop_tp({**spec, "dp": dp, "tp": tp, "ranks": dp * tp})
        else:
            res = compare_failstop({**spec, "ranks": dp})
    w, d = res["wall_s"], res["max_loss_rel_diff"]
    print(f"SIGKILL rank {args.kill_rank} {where}")
    print(f"survivors: {res['survivors']}")
    print(f"steps completed: {res['steps_completed']}")
    for rec in res["recovery"]["survive"].get("recoveries", []):
        print(f"recovery at step {rec['step']} from {rec['from']}: "
              + ", ".join(f"{k} {rec[k]}" for k in ("moves", "pipes", "owners") if k in rec))  # fmt: skip
    print("max loss difference vs the failure-free run: "
          + ", ".join(f"{m} {v:.2e}" for m, v in d.items()))  # fmt: skip
    ckpt = f" (restart-everything: checkpoint every {args.checkpoint_every} steps)" if "restart" in w else ""
    print("wall s (incl. spawning): " + ", ".join(f"{m} {v:.1f}" for m, v in w.items()) + ckpt)
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(res, indent=2) + "\n")
        print(f"wrote: {args.json}")
    return 0


def register(sub: Any) -> None:
    p = sub.add_parser(
        "resilience",
        help="ResiHP: workload-aware failure detection and hybrid-parallel adaptation",
        description="ResiHP: workload-aware failure prediction and detection, progressive TP/PP/DP "
        "replanning, and a 256-GPU cluster simulator with faithful baselines (SIMULATED). `run` is a live "
        "gloo training job with the runtime (MEASURED, emulated device time).",
    )
    verbs = p.add_subparsers(dest="verb", metavar="VERB", required=True)
    d = verbs.add_parser("detect", help="score detectors on simulated runs with injected failures")
    d.add_argument(
        "--model", default="llama2-7b", help="model preset (default %(default)s; a bad name lists them)"
    )
    d.add_argument("--pp", type=positive_int, default=4, help="pipeline stages (default %(default)s)")
    d.add_argument("--dp", type=positive_int, default=4, help="data-parallel replicas (default %(default)s)")
    d.add_argument(
        "--lengths", choices=("code", "chat", "uniform"), default="code", help="length distribution preset"
    )
    d.add_argument(
        "--runs",
        type=positive_int,
        default=20,
        help="simulated runs, one injected failure each; every detector scores the same runs "
        "(default %(default)s)",
    )
    d.add_argument("--steps", type=positive_int, default=80, help="steps per run (default %(default)s)")
    d.add_argument(
        "--factor", type=_slowdown, default=1.25, help="injected slowdown: 1.25 = 25%% slower (> 1)"
    )
    d.add_argument("--json", type=output_file, default=None, help="also write the scores here (JSON)")
    d.set_defaults(func=_detect)
    run = verbs.add_parser(
        "run",
        help="MEASURED: a real gloo training job with the runtime (emulated device time, injected fail-slow)",
        description="Spawns --ranks processes on loopback gloo: a tiny real decoder, real all-reduce, each "
        "microbatch lasting the emulated H100 time of an 8B model. The Runtime detects the injected "
        "slowdown and rebalances microbatches; with pp > 1 the stages are a real 1F1B pipeline and ResiHP's "
        "planner also moves layers between stages; with tp > 1 each replica is a real tensor-parallel group "
        "and a degraded member can be excluded (its shard moves to the survivors) and readmitted. "
        "--compare runs healthy, unmitigated and adapted with the "
        "same seeds and the simulator's prediction of each.",
    )
    run.add_argument(
        "--ranks", type=positive_int, default=4, help="processes to spawn; must equal the layout's product"
    )
    run.add_argument(
        "--layout",
        default=None,
        help="dp=N, dp=N,pp=M (rank = replica * pp + stage) or dp=N,tp=M (rank = replica * tp + member) "
        "(default: dp=--ranks)",
    )
    run.add_argument(
        "--inject",
        action="append",
        default=[],
        help="slow:rank=R,factor=F,at=S[,for=D] (a device) or slow-link:... (rank R's link; DP or DP x PP)",
    )
    run.add_argument("--steps", type=positive_int, default=80, help="training steps (default %(default)s)")
    run.add_argument(
        "--time-scale",
        type=positive_float,
        default=None,
        help="wall seconds per emulated device second (default 0.02 for dp, 0.05 with pp or tp > 1: a "
        "stage's 17 real blocks, or a TP member's gloo messages, must stay well inside the emulated time; "
        "0.1 keeps the emulation's host time under 5%% of a step, where the simulator's prediction is "
        "checked)",
    )
    run.add_argument(
        "--seed", type=seed, default=0, help="seed of the model, data and noise (default %(default)s)"
    )
    run.add_argument(
        "--ranks-per-node",
        type=positive_int,
        default=None,
        help="place this many ranks per node of the cluster (default: all on one); 1 puts the DP gradient "
        "all-reduce on the network, where a slow link shows",
    )
    run.add_argument(
        "--tp-policy",
        choices=("resihp", "uneven"),
        default="resihp",
        help="with tp > 1: resihp excludes a slow member (equal shares, the paper); uneven is steptune's "
        "re-split of each group's units by speed (--compare runs both)",
    )
    run.add_argument("--no-adapt", action="store_true", help="detect only (the unmitigated baseline)")
    run.add_argument("--compare", action="store_true", help="healthy vs unmitigated vs adapted, same seeds")
    run.add_argument("--json", type=output_file, default=None, help="with --compare: write the results here")
    run.add_argument(
        "--plot",
        type=plot_file,
        default=None,
        help="with --compare: a PNG of each run's step time, measured and as the simulator predicts it",
    )
    run.set_defaults(func=_run)
    from steptune.resilience.elastic_cli import register as register_elastic

    register_elastic(verbs)
    fs = verbs.add_parser(
        "failstop",
        help="MEASURED: SIGKILL one rank (DP, DP x PP or DP x TP); survivors continue in place vs "
        "torchrun-style restart",
        description="Three runs with the same seeds: failure-free, one rank SIGKILLed mid-step with the "
        "survivors rebuilding their gloo group and redoing the step, and restart-everything from the last "
        "checkpoint. Prints the loss difference against the failure-free run and the wall times.",
    )
    fs.add_argument(
        "--ranks", type=positive_int, default=None, help="DP ranks (default 4; with --layout, its product)"
    )
    fs.add_argument(
        "--layout",
        default=None,
        help="dp=2,pp=2 or dp=2,tp=2: the dead rank's layers / TP units come back from a DP peer "
        "(TP: no restart run)",
    )
    fs.add_argument("--steps", type=positive_int, default=20, help="training steps (default %(default)s)")
    fs.add_argument("--kill-rank", type=int, default=2, help="the rank to SIGKILL (default %(default)s)")
    fs.add_argument(
        "--kill-step", type=int, default=11, help="the step it dies in, counted from 0 (default %(default)s)"
    )
    fs.add_argument(
        "--checkpoint-every", type=positive_int, default=5, help="the restart baseline's checkpoint interval"
    )
    fs.add_argument(
        "--time-scale",
        type=positive_float,
        default=0.01,
        help="wall seconds per emulated device second (default %(default)s)",
    )
    fs.add_argument("--seed", type=seed, default=0, help="seed of the model and data (default %(default)s)")
    fs.add_argument(
        "--json", type=output_file, default=None, help="also write the runs and their comparison here (JSON)"
    )
    fs.set_defaults(func=_failstop)
    t = verbs.add_parser("trace", help="replay the real 128-GPU straggler trace through every detector")
    t.add_argument("--path", type=Path, default=None, help="trace parquet (default: the shared copy)")
    t.set_defaults(func=_trace)
    sim = verbs.add_parser("simulate", help="one failure scenario on the 256-GPU job, one or every policy")
    sim.add_argument(
        "--scenario",
        default="mixed",
        help="a CSV trace (kind,device,start_s,duration_s,factor; factor: the fail-slow device's speed "
        "in (0, 1], 0.5 = half speed) or a generated kind: fail-stop, fail-slow-weak|medium|strong, "
        "fail-slow-link, mixed",
    )
    sim.add_argument(
        "--policy",
        default="all",
        help="all, or one of resihp, steptune, recycle, oobleck, greyhound, "
        "adaptra, strengthened-recycle, strengthened-oobleck, malleus-lite, ckpt-restart, noop, oracle",
    )
    sim.add_argument(
        "--model", default="llama2-13b", help="model preset (default %(default)s; a bad name lists them)"
    )
    sim.add_argument("--duration", type=positive_float, default=7200.0, help="simulated seconds (7200)")
    sim.add_argument(
        "--seed", type=seed, default=0, help="seed of a generated scenario (default %(default)s)"
    )
    sim.add_argument("--verbose", action="store_true", help="print every plan change")
    sim.add_argument(
        "--free-comm",
        action="store_true",
        help="do not price TP/PP/DP communication (link fail-slows are then rejected)",
    )
    _add_lengths(sim)
    sim.add_argument(
        "--json", type=output_file, default=None, help="also write each policy's result here (JSON)"
    )
    sim.set_defaults(func=_simulate)
    b = verbs.add_parser("bench", help="every policy on the same simulated 256-GPU scenarios (JSON, table)")
    b.add_argument("--quick", action="store_true", help="2 models x 3 kinds x 30 min: under a minute")
    b.add_argument(
        "--seeds", type=positive_int, default=1, help="scenarios per (model, kind) in the full bench"
    )
    b.add_argument("--workers", type=positive_int, default=2, help="processes")
    b.add_argument("--models", default=None, help="comma-separated model presets (default: all seven)")
    _add_lengths(b)
    b.add_argument(
        "--json", type=output_file, required=True, help="where to write the rows, ratios and detector scores"
    )
    b.add_argument("--plot", type=plot_file, default=None, help="PNG of the ratios per scenario kind")
    b.set_defaults(func=_bench)
    sw = verbs.add_parser(
        "sweep", help="sensitivity to the failure rate, the fail-slow duration and the sequence-length spread"
    )
    sw.add_argument(
        "--model", default="llama2-13b", help="model preset (default %(default)s; a bad name lists them)"
    )
    sw.add_argument(
        "--quick", action="store_true", help="two scales, 30 simulated minutes, few detector runs"
    )
    sw.add_argument("--workers", type=positive_int, default=2, help="processes (default %(default)s)")
    sw.add_argument("--json", type=output_file, required=True, help="where to write the sweep (JSON)")
    sw.set_defaults(func=_sweep)
