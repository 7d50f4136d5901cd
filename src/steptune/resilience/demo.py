"""Resilience demo: detectors on simulated failures and on the real straggler trace, every recovery
policy on one simulated 256-GPU failure scenario, and (measured) a DP loop that survives a SIGKILL."""

from __future__ import annotations

from pathlib import Path

from steptune.core.demo import DemoResult
from steptune.core.plot import bars
from steptune.core.report import Table
from steptune.resilience.evaluate import JobSpec, detector_scores

__all__ = ["run_resilience_demo"]


def run_resilience_demo(out_dir: Path, *, runs: int = 8, quick: bool = False) -> DemoResult:
    if quick:
        runs = 2
    out_dir.mkdir(parents=True, exist_ok=True)
    scores = detector_scores(JobSpec(), runs=runs, steps=60)
    sim = Table(
        title=f"Detectors on {runs} simulated runs (SIMULATED llama2-7b PP4 x DP4, variable-length packs)",
        columns=["detector", "detection rate", "false alarms / run", "mean latency (steps)"],
    )
    for name, s in scores.items():
        sim.add(name, s["detection_rate"], s["false_alarms_per_run"], s["mean_latency_steps"])
    sim.notes.append(
        "one injected fail-slow (1.25x) or fail-stop per run; docs/resilience.md has the assumptions"
    )
    tables = [sim]
    artifacts = [
        bars(
            list(scores),
            [s["false_alarms_per_run"] for s in scores.values()],
            out_dir / "false_alarms.png",
            ylabel="false alarms per run",
            title="False alarms per simulated run",
        )
    ]
    try:
        from steptune.resilience.detect import ChangePointDetector, FixedThresholdDetector, ResiHPDetector
        from steptune.resilience.trace import load_trace, replay, trace_steps

        steps = trace_steps(load_trace())
        alarms = replay([ResiHPDetector(), FixedThresholdDetector(0.10), ChangePointDetector()], steps)
        real = Table(
            title=f"Real 128-GPU straggler trace, healthy ({len(steps)} steps): fail-slow alarms",
            columns=["detector", "alarms", "ranks alarmed"],
        )
        for name, found in alarms.items():
            real.add(name, len(found), len({a.unit for a in found}))
        real.notes.append("sequence-length imbalance, no faulty device: every alarm is a false alarm")
        tables.append(real)
    except (FileNotFoundError, ImportError) as exc:  # the shared trace or pyarrow is absent
        sim.notes.append(f"real-trace replay skipped: {exc}")
    policy_table, plot = _policies_on_one_scenario(out_dir, quick=quick)
    tables.append(policy_table)
    artifacts.append(plot)
    tables.append(_elastic_survival(quick=quick))
    for k, t in enumerate(tables):
        artifacts += list(t.write(out_dir / f"resilience_{k}"))
    title = "resilience: ResiHP detectors and recovery policies vs baselines"
    return DemoResult(title=title, tables=tables, artifacts=artifacts)


_DEMO_POLICIES = ("resihp", "steptune", "recycle", "oobleck", "greyhound", "adaptra", "ckpt-restart", "noop")


def _policies_on_one_scenario(out_dir: Path, *, quick: bool) -> tuple[Table, Path]:
    """The bench's mixed scenario (fail-stops and fail-slows) on llama2-13b, every policy, tokens/s
    (quick: one fail-stop on llama2-7b, four policies)."""
    from steptune.resilience.bench import DetectorCosts, RowTask, job_for, run_row

    model, kind, duration = ("llama2-7b", "fail-stop", 1800.0) if quick else ("llama2-13b", "mixed", 3600.0)
    policies = ("resihp", "steptune", "greyhound", "noop") if quick else _DEMO_POLICIES
    row = run_row(
        RowTask(
            model=model,
            kind=kind,
            seed=0,
            duration_s=duration,
            det=DetectorCosts(),
            policies=(*policies, "oracle"),
        )
    )
    job, tps = job_for(model), row["tokens_per_s"]
    table = Table(
        title=f"Recovery policies, SIMULATED {model} TP{job.tp} PP{job.pp} DP{job.dp} ({job.num_devices} "
        f"A100s), {kind} ({row['failures']} failures in {duration / 60:.0f} min)",
        columns=["policy", "tokens/s", "of oracle", "stall s", "lost s", "halted s"],
    )
    for name in (*policies, "oracle"):
        d = row["detail"][name]
        table.add(name, tps[name], tps[name] / tps["oracle"], d["stall_s"], d["lost_s"], d["halted_s"])
    table.notes.append(
        "communication priced; `steptune resilience bench` runs 42 scenarios; docs/resilience.md lists the "
        "assumptions and the baselines' fidelity"
    )
    plot = bars(
        list(policies),
        [tps[p] / tps["oracle"] for p in policies],
        out_dir / "policies_vs_oracle.png",
        ylabel="tokens/s / oracle",
        title=f"{model}, {kind}, {duration / 60:.0f} simulated minutes",
        reference=1.0,
    )
    return table, plot


def _elastic_survival(*, quick: bool) -> Table:
    """MEASURED: ``elastic.toy_train`` on spawned gloo ranks, one SIGKILLed mid-step, against the same loop
    in one process without a failure."""
    from steptune.resilience.elastic import launch, toy_train

    ranks, steps, kill = (3, 6, [1, 2]) if quick else (4, 12, [2, 5])
    ref = launch(toy_train, 1, steps)
    res = launch(toy_train, ranks, steps, [kill])
    first = res["survivors"][0]
    losses = res["results"][first]
    worst = max(abs(losses[k] - ref["results"][0][k]) / abs(ref["results"][0][k]) for k in range(steps))
    table = Table(
        title=f"Fail-stop in your own DP loop (MEASURED, {ranks} gloo ranks, rank {kill[0]} SIGKILLed in "
        f"step {kill[1]})",
        columns=["run", "ranks at the end", "steps done", "max loss rel. diff", "wall s"],
    )
    table.add("failure-free, 1 process", "0", len(ref["results"][0]), "-", "-")
    table.add(
        "elastic, survive in place", " ".join(map(str, res["survivors"])), len(losses), worst, res["wall_s"]
    )
    table.notes.append(
        "steptune.resilience.elastic: the survivors rejoin and redo the step without a restart; wall s "
        "includes spawning the ranks; examples/elastic_dp.py shows the loop"
    )
    return table
