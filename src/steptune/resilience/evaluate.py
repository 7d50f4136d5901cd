"""Simulated training runs with variable-length workloads and injected failures, to score detectors.

A job is DP replicas of a PP pipeline (TP folded into each stage's speed). Every step, each replica
packs ``num_microbatches`` microbatches from a length distribution; each (stage, microbatch, phase)
takes the analytic time of its workload (``StageModel``) times kernel noise times the unit's
slowdown. The step time is the slowest replica's pipeline critical path (``pipeline.simulate`` with
per-action durations). The predictor learns per (stage, phase) from healthy samples only; the
detectors see per-unit compute times (and, for ResiHP, the predicted ones). All of it is SIMULATED;
docs/resilience.md lists the assumptions.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from steptune.core.specs import Phase, cluster_preset, model_preset
from steptune.pipeline.anchors import one_f_one_b
from steptune.pipeline.costs import StageCosts, uniform_partition
from steptune.pipeline.schedule import Action, ActionKind
from steptune.pipeline.simulate import makespan
from steptune.resilience.detect import (
    Alarm,
    ChangePointDetector,
    FixedThresholdDetector,
    HeartbeatMonitor,
    ResiHPDetector,
)
from steptune.resilience.predict import WorkloadPredictor, mape
from steptune.resilience.workload import LENGTH_PRESETS, LengthDist, StageModel, features, pack

__all__ = ["FailSlow", "FailStop", "JobSpec", "RunResult", "detector_scores", "simulate_run"]

_PHASES = (Phase.F, Phase.B, Phase.W)


@dataclass(frozen=True, kw_only=True, slots=True)
class JobSpec:
    model: str = "llama2-7b"
    cluster: str = "a100-256"
    pp: int = 4
    dp: int = 4
    tp: int = 2
    num_microbatches: int = 8
    token_budget: int = 32768
    lengths: str | LengthDist = "code"
    """A ``LENGTH_PRESETS`` name or a distribution."""
    noise_cv: float = 0.03
    """Kernel-time noise per (stage, microbatch, phase), independent of the workload."""
    efficiency: float = 0.5

    @property
    def num_units(self) -> int:
        return self.pp * self.dp


@dataclass(frozen=True, kw_only=True, slots=True)
class FailSlow:
    unit: int
    factor: float
    start: int
    end: int = 1 << 30


@dataclass(frozen=True, kw_only=True, slots=True)
class FailStop:
    unit: int
    step: int


@dataclass(kw_only=True)
class RunResult:
    step_times: list[float] = field(default_factory=list)
    predicted_step_times: list[float] = field(default_factory=list)
    mb_pred: list[float] = field(default_factory=list)
    mb_obs: list[float] = field(default_factory=list)
    alarms: dict[str, list[Alarm]] = field(default_factory=dict)
    healthy_steps: list[bool] = field(default_factory=list)

    def mtp_mape(self) -> float:
        return mape(self.mb_pred, self.mb_obs)

    def itp_mape(self) -> float:
        pairs = [
            (p, o)
            for p, o, h in zip(self.predicted_step_times, self.step_times, self.healthy_steps, strict=True)
            if h and p > 0
        ]
        return mape([p for p, _ in pairs], [o for _, o in pairs]) if pairs else float("nan")


def simulate_run(
    job: JobSpec,
    steps: int,
    *,
    failures: tuple[FailSlow | FailStop, ...] = (),
    seed: int = 0,
    heartbeat_timeout_steps: float = 2.0,
) -> RunResult:
    rng = np.random.default_rng(seed)
    model = model_preset(job.model)
    device = cluster_preset(job.cluster).device
    dist = LENGTH_PRESETS[job.lengths] if isinstance(job.lengths, str) else job.lengths
    part = uniform_partition(model.num_layers, job.pp)
    bounds = np.cumsum((0, *part))
    stages = [
        StageModel(layers=model.layers[bounds[s] : bounds[s + 1]], device=device) for s in range(job.pp)
    ]
    coef = [{ph: sm.coefficients(ph) for ph in _PHASES} for sm in stages]
    flops_rate = device.peak_flops * job.efficiency * job.tp
    sched = one_f_one_b(job.pp, job.num_microbatches)
    fused = StageCosts.uniform(job.pp)  # durations come from the override below
    predictor = WorkloadPredictor()
    detectors = [ResiHPDetector(), FixedThresholdDetector(0.10), ChangePointDetector()]
    heartbeat = HeartbeatMonitor(timeout=1.0)
    result = RunResult(alarms={d.name: [] for d in [*detectors, heartbeat]})
    stopped: dict[int, int] = {f.unit: f.step for f in failures if isinstance(f, FailStop)}
    clock = 0.0
    last_beat = {u: 0.0 for u in range(job.num_units)}
    for step in range(steps):
        obs_unit = dict.fromkeys(range(job.num_units), 0.0)
        pred_unit = dict.fromkeys(range(job.num_units), 0.0)
        slow = {f.unit: f.factor for f in failures if isinstance(f, FailSlow) and f.start <= step < f.end}
        step_time = pred_step = 0.0
        all_ready = True
        for d in range(job.dp):
            mbs = pack(rng, dist, job.token_budget, job.num_microbatches)
            true_t: dict[tuple[int, Phase, int], float] = {}
            pred_t: dict[tuple[int, Phase, int], float] = {}
            for m, lengths in enumerate(mbs):
                n, q = features(lengths)
                for s in range(job.pp):
                    unit = d * job.pp + s
                    for ph in _PHASES:
                        lin, quad = coef[s][ph]
                        base = (lin * n + quad * q) / flops_rate
                        t = base * (1 + job.noise_cv * rng.standard_normal()) * slow.get(unit, 1.0)
                        true_t[(s, ph, m)] = t
                        obs_unit[unit] += t
                        key = (s, ph)
                        if predictor.ready(key):
                            p = predictor.predict(key, n, q)
                            pred_t[(s, ph, m)] = p
                            pred_unit[unit] += p
                            result.mb_pred.append(p)
                            result.mb_obs.append(t)
                        else:
                            all_ready = False
                        predictor.observe(key, n, q, t)

            def dur(a: Action, table: dict[tuple[int, Phase, int], float]) -> float:
                if a.kind is ActionKind.F:
                    return table[(a.stage, Phase.F, a.microbatch)]
                return table[(a.stage, Phase.B, a.microbatch)] + table[(a.stage, Phase.W, a.microbatch)]

            step_time = max(
                step_time,
                makespan(sched, fused, durations=lambda a, t=true_t: dur(a, t)),
            )
            if all_ready:
                pred_step = max(
                    pred_step,
                    makespan(sched, fused, durations=lambda a, t=pred_t: dur(a, t)),
                )
        clock += step_time
        result.step_times.append(step_time)
        result.predicted_step_times.append(pred_step if all_ready else 0.0)
        result.healthy_steps.append(not slow)
        for unit in range(job.num_units):
            if unit not in stopped or step < stopped[unit]:
                last_beat[unit] = clock
        for det in detectors:
            if isinstance(det, ResiHPDetector):
                if all_ready:
                    result.alarms[det.name] += det.observe(step, obs_unit, pred_unit)
            else:
                result.alarms[det.name] += det.observe(step, obs_unit)
        # Heartbeats go out every step; silence longer than a few median steps is a fail-stop.
        heartbeat.timeout = heartbeat_timeout_steps * float(np.median(result.step_times))
        result.alarms[heartbeat.name] += heartbeat.check(step, clock, last_beat)
    return result


def detector_scores(
    job: JobSpec,
    *,
    runs: int = 20,
    steps: int = 80,
    factor: float = 1.25,
    detect_within: int = 10,
    seed: int = 0,
) -> dict[str, dict[str, float]]:
    """Per detector: detection rate of one injected fail-slow (factor) or fail-stop per run, false
    alarms per run (alarms on a healthy unit or outside the fault window), mean latency in steps."""
    if steps < 30:  # `detect --steps 1` said only "high <= 0" (a 2026-12-05 sweep)
        raise ValueError(
            f"steps={steps}: a detection run needs at least 30 steps (the detectors warm up for 10, the "
            "fault starts between steps/3 and 2*steps/3, and has 10 steps to be detected)"
        )
    rng = np.random.default_rng(seed)
    stats: dict[str, dict[str, list[float]]] = {}
    for k in range(runs):
        unit = int(rng.integers(job.num_units))
        onset = int(rng.integers(steps // 3, 2 * steps // 3))
        kind = "fail-stop" if k % 4 == 3 else "fail-slow"
        failure: FailSlow | FailStop = (
            FailStop(unit=unit, step=onset)
            if kind == "fail-stop"
            else FailSlow(unit=unit, factor=factor, start=onset)
        )
        res = simulate_run(job, steps, failures=(failure,), seed=seed * 1000 + k)
        for name, alarms in res.alarms.items():
            st = stats.setdefault(name, {"detected": [], "false": [], "latency": [], "eligible": []})
            relevant = (name == "heartbeat") == (kind == "fail-stop")
            # A detector that cannot localize (unit None, e.g. change-point on step time) hits when
            # it alarms inside the window after the onset.
            hits = [a for a in alarms if a.unit in (unit, None) and onset <= a.step <= onset + detect_within]
            false = [a for a in alarms if not (a.unit in (unit, None) and a.step >= onset)]
            st["false"].append(len(false))
            if relevant:
                st["eligible"].append(1)
                st["detected"].append(1.0 if hits else 0.0)
                if hits:
                    st["latency"].append(hits[0].step - onset)
    out = {}
    for name, st in stats.items():
        out[name] = {
            "detection_rate": float(np.mean(st["detected"])) if st["detected"] else float("nan"),
            "false_alarms_per_run": float(np.mean(st["false"])),
            "mean_latency_steps": float(np.mean(st["latency"])) if st["latency"] else float("nan"),
            "runs": float(len(st["false"])),
        }
    return out
