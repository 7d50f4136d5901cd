"""Sensitivity of the resilience results to the failure rate and to the sequence-length spread. SIMULATED.

- Failure rate: one model, each scenario kind's arrival rates scaled by ``rate_scales`` (2 = twice as
  many failures), ResiHP and the baselines on the same generated scenarios; ratios per scale.
- Fail-slow duration: one model, fail-slow kinds with Greyhound-like episodes (lognormal, median
  ``slow_median_s``) against persistent ones (never end: the setting ResiHP's paper evaluates), ResiHP's
  and steptune's ratios over the home baselines.
- Length CV: the detector study on length distributions of increasing spread (lognormal sigma), with
  the healthy microbatch and step CVs they produce: how many false alarms each detector raises as the
  workload varies more, and whether ResiHP still catches 1.25x fail-slows.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import replace
from typing import Any

import numpy as np

from steptune.core.specs import Phase, cluster_preset, model_preset
from steptune.resilience.bench import HOME, POLICIES, RowTask, measure_detectors, run_rows
from steptune.resilience.evaluate import JobSpec, detector_scores, simulate_run
from steptune.resilience.scenarios import Rates
from steptune.resilience.workload import LENGTH_PRESETS, StageModel, pack

__all__ = ["fail_slow_duration_sweep", "failure_rate_sweep", "length_cv_sweep"]

_SWEEP_POLICIES = tuple(p for p in POLICIES if p not in ("malleus-lite", "noop"))


def _run_cases(
    model: str,
    cases: list[tuple[Rates, str]],
    duration_s: float,
    detector_runs: int,
    workers: int,
    progress: Callable[[str], None] | None,
    policies: tuple[str, ...],
) -> list[tuple[Rates, dict[str, Any], list[str]]]:
    """One bench row per (rates, kind) case, the policies paying what the detector study measured:
    (rates, row, the kind's home baselines in the row)."""
    _, det = measure_detectors(detector_runs)
    tasks = [
        RowTask(model=model, kind=k, seed=0, duration_s=duration_s, det=det, rates=r, policies=policies)
        for r, k in cases
    ]
    out = []
    for (rates, _), row in zip(cases, run_rows(tasks, workers, progress), strict=True):
        t = row["tokens_per_s"]
        homes = [b for b, ks in HOME.items() if row["kind"] in ks and b in t and b != "ckpt-restart"]
        out.append((rates, row, homes))
    return out


def failure_rate_sweep(
    *,
    model: str = "llama2-13b",
    kinds: tuple[str, ...] = ("fail-stop", "fail-slow-medium", "mixed"),
    rate_scales: tuple[float, ...] = (0.5, 1.0, 2.0),
    duration_s: float = 7200.0,
    detector_runs: int = 12,
    workers: int = 2,
    progress: Callable[[str], None] | None = None,
    policies: tuple[str, ...] = _SWEEP_POLICIES,
) -> dict[str, Any]:
    """Per (scale, kind): tokens/s of each policy and ResiHP's ratio over the kind's home baselines."""
    if any(x <= 0 for x in rate_scales):
        raise ValueError(f"rate scales must be > 0, got {rate_scales}")
    base = Rates()
    cases = [
        (
            Rates(
                stop_every_s=base.stop_every_s / scale,
                slow_every_s=base.slow_every_s / scale,
                slow_median_s=base.slow_median_s,
                mixed_stop_every_s=base.mixed_stop_every_s / scale,
            ),
            k,
        )
        for scale in rate_scales
        for k in kinds
    ]
    out = []
    for rates, row, homes in _run_cases(model, cases, duration_s, detector_runs, workers, progress, policies):
        t = row["tokens_per_s"]
        scale = base.stop_every_s / rates.stop_every_s
        out.append(
            {
                "rate_scale": scale,
                "kind": row["kind"],
                "failures": row["failures"],
                "tokens_per_s": t,
                "ratio_vs": {b: (t["resihp"] / t[b] if t[b] > 0 else None) for b in homes},
                "of_oracle": t["resihp"] / t["oracle"],
            }
        )
    return {"model": model, "duration_s": duration_s, "rows": out, "simulated": True}


def fail_slow_duration_sweep(
    *,
    model: str = "llama2-13b",
    kinds: tuple[str, ...] = ("fail-slow-medium", "fail-slow-strong"),
    medians_s: tuple[float, ...] = (900.0, math.inf),
    duration_s: float = 7200.0,
    detector_runs: int = 12,
    workers: int = 2,
    progress: Callable[[str], None] | None = None,
    policies: tuple[str, ...] = _SWEEP_POLICIES,
) -> dict[str, Any]:
    """Per (median fail-slow duration, kind): tokens/s of each policy, and ResiHP's and steptune's ratios
    over the kind's home baselines (inf median: persistent fail-slows)."""
    if any(not x > 0 for x in medians_s):
        raise ValueError(f"median durations must be > 0 seconds (inf: persistent), got {medians_s}")
    cases = [(Rates(slow_median_s=med), k) for med in medians_s for k in kinds]
    out = []
    for rates, row, homes in _run_cases(model, cases, duration_s, detector_runs, workers, progress, policies):
        t = row["tokens_per_s"]
        med = rates.slow_median_s
        out.append(
            {
                "median_s": None if math.isinf(med) else med,
                "persistent": math.isinf(med),
                "kind": row["kind"],
                "failures": row["failures"],
                "tokens_per_s": t,
                "ratio_vs": {
                    ours: {b: (t[ours] / t[b] if t[b] > 0 else None) for b in homes}
                    for ours in ("resihp", "steptune")
                },
                "of_oracle": {ours: t[ours] / t["oracle"] for ours in ("resihp", "steptune")},
            }
        )
    return {"model": model, "duration_s": duration_s, "rows": out, "simulated": True}


def length_cv_sweep(
    *, sigmas: tuple[float, ...] = (0.5, 1.0, 1.5), runs: int = 20, steps: int = 80, seed: int = 0
) -> dict[str, Any]:
    """Per lognormal sigma of the ``code`` length preset: healthy CVs and the detector scores."""
    code = LENGTH_PRESETS["code"]
    out = []
    for sigma in sigmas:
        job = JobSpec(lengths=replace(code, sigma=sigma))
        st = np.array(simulate_run(job, steps, seed=seed).step_times)
        mb = _forward_times(job, seed)
        scores = detector_scores(job, runs=runs, steps=steps, factor=1.25, seed=seed)
        out.append(
            {
                "sigma": sigma,
                "step_cv": float(st.std() / st.mean()),
                "microbatch_forward_cv": float(mb.std() / mb.mean()),
                "detector": {
                    name: {k: (v if math.isfinite(v) else None) for k, v in s.items() if k != "runs"}
                    for name, s in scores.items()
                },
            }
        )
    return {"runs": runs, "steps": steps, "factor": 1.25, "rows": out, "simulated": True}


def _forward_times(job: JobSpec, seed: int, n: int = 400) -> np.ndarray:
    """Analytic forward time (one decoder layer) of ``n`` microbatches packed like the job's."""
    dist = job.lengths if not isinstance(job.lengths, str) else LENGTH_PRESETS[job.lengths]
    stage = StageModel(layers=(model_preset(job.model).layers[1],), device=cluster_preset(job.cluster).device)
    rng = np.random.default_rng(seed)
    return np.array([stage.time(lengths, Phase.F) for lengths in pack(rng, dist, job.token_budget, n)])
