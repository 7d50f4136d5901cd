"""Does the simulator (``sim.run``) predict the live runs? Predicted vs measured tokens/s per run.

``predict_live(result)`` takes a ``live.compare``, ``pipelined.compare_pipelined`` or
``tensorpar.compare_tensor_parallel`` result and builds the simulator's job from the same spec: model,
cluster, layout (TP groups run at k x the slowest member, communication free, as in the live TP job),
microbatch count, and a representative packed
microbatch (the mean tokens and mean sum of squared lengths over every microbatch the live run drew). It
then simulates the healthy run (NoOp, no failure), the unmitigated run (NoOp with the fail-slow) and the
adapted run (ResiHP with the live planner's settings).

The simulator leaves out what the live run pays on every step outside the pipeline: gradient sync, the
optimizer, the runtime's own gather, and host overheads of the CPU emulation. Two predictions are
therefore reported:
- ``raw``: the simulator as it is (overhead 0).
- ``calibrated``: one constant, the healthy run's measured step minus the simulated step, added to every
  simulated step (``SimJob.step_overhead_s``). It is fitted on the healthy run only, so the errors of
  the unmitigated and adapted predictions are out of sample.
Errors are (predicted - measured) / measured over the same window of steps as the measured figures.
"""

from __future__ import annotations

import statistics
from typing import Any

from steptune.resilience.live import global_batch
from steptune.resilience.plan import ReconfigCosts
from steptune.resilience.sim import FailureEvent, NoOp, ResiHPPolicy, SimJob, SimResult, run
from steptune.resilience.workload import features

__all__ = ["predict_live", "sim_job_for"]

_RUNS = ("healthy", "unmitigated", "adapted")


def sim_job_for(spec: dict[str, Any], ranks: int, overhead_s: float = 0.0) -> SimJob:
    """The simulator's job for a live spec (DP-only live runs have pp = tp = 1, dp = ranks)."""
    pp, tp = int(spec.get("pp", 1)), int(spec.get("tp", 1))
    dp = int(spec.get("dp", ranks // (pp * tp)))
    ns, qs = [], []
    for step in range(int(spec.get("steps", 60))):
        for mb in global_batch(int(spec.get("seed", 0)), step, spec)[0]:
            n, q = features(mb)
            ns.append(n)
            qs.append(q)
    return SimJob(
        model=spec.get("model", "llama3.1-8b"),
        cluster=spec.get("cluster", "dgx-h100"),
        tp=tp,
        pp=pp,
        dp=dp,
        global_microbatches=int(spec.get("microbatches", 16)),
        tokens_per_microbatch=round(statistics.fmean(ns)),
        microbatch_sq_tokens=statistics.fmean(qs),
        step_overhead_s=overhead_s,
        memory_bytes=float("inf"),  # the live ranks emulate device time, not device memory
        reconfig=ReconfigCosts(tp_s=1.0, pp_s=float(spec.get("pp_stall_s", 5.0)), dp_s=0.0),
    )


def _window_rate(res: SimResult, job: SimJob, first: int, last: int) -> float:
    rows = res.timeline[first:last]
    if not rows:
        raise ValueError(f"the simulation completed {len(res.timeline)} steps, fewer than {first + 1}")
    return len(rows) * job.tokens_per_step / (rows[-1][0] + rows[-1][1] - rows[0][0])


def _simulate(job: SimJob, spec: dict[str, Any], healthy_step_s: float, first: int) -> dict[str, float]:
    steps = int(spec.get("steps", 60))
    faults = spec.get("faults") or []
    failures = [
        FailureEvent(
            kind="fail-slow",
            device=int(f["rank"]),
            start_s=int(f["start"]) * healthy_step_s,
            duration_s=int(f["duration"]) * healthy_step_s if f.get("duration") else float("inf"),
            factor=1.0 / float(f["factor"]),
        )
        for f in faults
    ]
    duration = healthy_step_s * steps * 3.0  # long enough for every step of the slowest run
    adapted = ResiHPPolicy(
        detect_slow_steps=2.0,
        expected_slow_s=float(spec.get("expected_slow_s", 24 * 60.0)),
        per_replica_partitions=bool(spec.get("per_replica_partitions", True)),
    )
    runs = {
        "healthy": run(job, NoOp(), [], duration),
        "unmitigated": run(job, NoOp(), failures, duration),
        "adapted": run(job, adapted, failures, duration),
    }
    return {k: _window_rate(r, job, first, steps) for k, r in runs.items()}


def _one_step(job: SimJob) -> float:
    """The simulated healthy step time of ``job``."""
    horizon = 1.0
    while not (res := run(job, NoOp(), [], horizon)).timeline:
        horizon *= 4.0
    return res.timeline[0][1]


def predict_live(result: dict[str, Any]) -> dict[str, Any]:
    """Predicted vs measured tokens/s of the three runs of a live comparison (module docstring)."""
    spec, ranks = result["spec"], int(result["ranks"])
    first = max(int(result["throughput_window_from_step"]), 5)
    measured = result["throughput_tokens_per_s"]
    healthy_rows = [r for r in result["runs"]["healthy"] if r["step"] >= first]
    measured_step = sum(r["wall_s"] for r in healthy_rows) / len(healthy_rows)
    raw_job = sim_job_for(spec, ranks)
    raw_healthy_step = _one_step(raw_job)
    overhead = max(0.0, measured_step - raw_healthy_step)
    out: dict[str, Any] = {
        "window_from_step": first,
        "measured_tokens_per_s": dict(measured),
        "simulated_healthy_step_s": raw_healthy_step,
        "measured_healthy_step_s": measured_step,
        "calibrated_overhead_s": overhead,
    }
    for name, job, step in (
        ("raw", raw_job, raw_healthy_step),
        ("calibrated", sim_job_for(spec, ranks, overhead), raw_healthy_step + overhead),
    ):
        pred = _simulate(job, spec, step, first)
        out[name] = {
            "tokens_per_s": pred,
            "error": {k: (pred[k] - measured[k]) / measured[k] for k in _RUNS},
        }
    return out
