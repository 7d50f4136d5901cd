"""Does the simulator (``sim.run``) predict the live runs? Predicted vs measured tokens/s per run.

``predict_live(result)`` takes a ``live.compare``, ``pipelined.compare_pipelined`` or
``tensorpar.compare_tensor_parallel`` result and builds the simulator's job from the same spec: model,
cluster, layout (TP groups run at k x the slowest member, communication free, as in the live TP job),
microbatch count. It then simulates the healthy run (NoOp, no failure), the unmitigated run (NoOp with the
fail-slow) and the adapted run (ResiHP with the live planner's settings). Three predictions:

- ``workload``: every simulated step runs that step's own microbatches (``LiveWorkload``): the live
  run's packed sequence lengths, assigned to replicas by the live job's rule, each block with the
  emulation's lognormal device noise, pipelines as 1F1B over per-microbatch durations, plus the emulated
  gradient all-reduce (the DP job's; the PP job's per stage with ``stage_sync``), paced by its slowest
  link while a link fault (``link_faults``) lasts.
  Policies still plan with the mean microbatch. Nothing is fitted.
- ``mean_microbatch``: every microbatch is the mean one (its mean tokens and mean sum of squared
  lengths); steps cost the same. This is the bench's model, and it cannot see load imbalance between
  replicas or the bubbles that uneven microbatches leave in a pipeline. It does not model link faults.
- ``calibrated``: ``workload`` plus one constant per step (``SimJob.step_overhead_s``), the healthy run's
  measured step minus the simulated one: what the live run pays outside the device model (the
  runtime's gather, the real gloo messages, host overheads of the CPU emulation). It is fitted on the
  healthy run only, so the unmitigated and adapted errors are out of sample.

Errors are (predicted - measured) / measured over the same window of steps as the measured figures.
"""

from __future__ import annotations

import math
import statistics
from pathlib import Path
from typing import Any

import numpy as np

from steptune.pipeline.costs import StageCosts
from steptune.pipeline.simulate import makespan
from steptune.resilience.live import allreduce_seconds, global_batch, stage_model, stage_sync_seconds
from steptune.resilience.plan import ExecutionPlan, ReconfigCosts
from steptune.resilience.planners import plan_dp
from steptune.resilience.policies import NoOp, ResiHPPolicy
from steptune.resilience.runtime import LinkFault, RuntimeConfig, SlowFault, lpt_assign
from steptune.resilience.sim import (
    Decision,
    FailureEvent,
    Policy,
    SimContext,
    SimJob,
    SimResult,
    StepTimeOf,
    cached_one_f_one_b,
    run,
)
from steptune.resilience.workload import StageModel, features

__all__ = ["LiveWorkload", "plot_live", "predict_live", "sim_job_for"]

_RUNS = ("healthy", "unmitigated", "adapted")
_WARMUP = 5
"""Steps a plot's y axis ignores (the live runs' first steps pay process and allocator warm-up)."""


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


class LiveWorkload:
    """The live job's steps as the simulator's truth (``sim.run(step_time_of=)``).

    Step ``i`` runs the live run's own global batch ``i`` (``live.global_batch``). Each microbatch costs
    what the emulation sleeps: the cost model's per-layer F and B+W seconds of its packed lengths, over
    the device's true speed, times lognormal noise (the runtime's sigma; one draw per device, microbatch
    and block, seeded by step, so every policy sees the same noise). Replicas get their microbatches by
    the live job's rule, from the speeds the policy has detected (all ones for NoOp, whose live
    counterpart does not adapt):
    - DP (``live``): LPT over ranks (``runtime.lpt_assign``); the step adds the emulated all-reduce.
    - PP (``pipelined``): ``plan_dp`` over each replica's modelled throughput and fill
      (``pipelined.replica_rates``); each replica runs 1F1B over per-microbatch F and B+W durations.
    - TP (``tensorpar``): ``plan_dp`` over k x the slowest member's speed; a microbatch lasts as long as
      the group's slowest member (the group meets before each one).
    """

    def __init__(self, spec: dict[str, Any], ranks: int) -> None:
        self.spec = spec
        self.seed = int(spec.get("seed", 0))
        self.pp, self.tp = int(spec.get("pp", 1)), int(spec.get("tp", 1))
        self.ranks = ranks
        full = stage_model(spec.get("model", "llama3.1-8b"), spec.get("cluster", "dgx-h100"))
        rate = full.device.peak_flops * full.efficiency
        coef = {
            ph: np.array([StageModel(layers=(x,), device=full.device).coefficients(ph) for x in full.layers])
            / rate
            for ph in "FBW"
        }
        self._f = coef["F"]  # (layers, 2): seconds per token and per token^2 of a sequence
        self._bw = coef["B"] + coef["W"]
        self.sync_s = allreduce_seconds(spec, ranks) if self.pp == self.tp == 1 else 0.0
        self.sigma = RuntimeConfig().noise_sigma
        self._layer_costs: tuple[float, ...] | None = None
        if self.pp > 1:
            from steptune.resilience.pipelined import planner_layer_costs

            self._layer_costs = planner_layer_costs(spec, full)
        self._cache: dict[int, tuple[int, np.ndarray, np.ndarray, np.ndarray]] = {}

    def _step(self, step: int) -> tuple[int, np.ndarray, np.ndarray, np.ndarray]:
        """(tokens, per-microbatch per-layer F seconds, B+W seconds, noise[device, microbatch, block])."""
        if step not in self._cache:
            mbs = global_batch(self.seed, step, self.spec)[0]
            feats = np.array([features(mb) for mb in mbs], dtype=float)
            rng = np.random.default_rng((self.seed, step, 0x5EED))
            noise = rng.lognormal(0.0, self.sigma, size=(self.ranks, len(mbs), 2))
            self._cache[step] = (sum(sum(mb) for mb in mbs), feats @ self._f.T, feats @ self._bw.T, noise)
        return self._cache[step]

    def tokens(self, step: int) -> int:
        return self._step(step)[0]

    def step_time(
        self,
        step: int,
        plan: ExecutionPlan,
        truth: tuple[float, ...],
        speeds: tuple[float, ...],
        links: bool = False,
    ) -> float:
        """Seconds of step ``step`` under ``plan`` at ``truth`` speeds, assigned by detected ``speeds``;
        with ``links`` the gradient all-reduce is slowed by the spec's link faults at that step."""
        _, f, bw, noise = self._step(step)
        cost = (f + bw).sum(axis=1)  # whole-model F+B+W seconds per microbatch
        if self.pp == 1 and self.tp == 1:
            assignment = lpt_assign(list(cost), [speeds[g[0]] for g in plan.tp_groups])
        elif self.pp == 1:
            rates = [len(g) * min(speeds[d] for d in g) for g in plan.tp_groups]
            assignment = plan_dp(list(cost), rates)
        else:
            from steptune.resilience.pipelined import replica_rates

            assert self._layer_costs is not None
            rates, base = replica_rates(plan, self._layer_costs, speeds, self.pp)
            assignment = plan_dp(list(cost), rates, base=base)
        out = max(
            (self._replica(plan, r, mine, f, bw, noise, truth) for r, mine in enumerate(assignment) if mine),
            default=0.0,
        )
        if self.pp > 1:
            return out + self._stage_sync_s(plan, step if links else None)
        return out + self.sync_s * (self.link_slowdown(step) if links else 1.0)

    def _stage_sync_s(self, plan: ExecutionPlan, step: int | None) -> float:
        """The PP job's gradient all-reduces (``stage_sync``): each stage's among its DP replicas, all of
        them after the pipeline's last microbatch, so the step waits for the slowest: its bytes (the
        stage's largest layer share over replicas) times its slowest link (at ``step``, if given)."""
        if not self.spec.get("stage_sync"):
            return 0.0
        from steptune.resilience.pipelined import owned_layers

        dp = self.ranks // self.pp
        faults = [LinkFault(**f) for f in self.spec.get("link_faults") or []] if step is not None else []
        worst = 0.0
        for stage in range(self.pp):
            peers = [rep * self.pp + stage for rep in range(dp)]
            secs = max(
                stage_sync_seconds(self.spec, owned_layers(plan.layer_partition[rep], stage), dp, self.ranks)
                for rep in range(dp)
            )
            slow = max(math.prod(f.factor_at(r, step) for f in faults) for r in peers) if faults else 1.0
            worst = max(worst, secs * slow)
        return worst

    def _replica(
        self,
        plan: ExecutionPlan,
        r: int,
        mine: list[int],
        f: np.ndarray,
        bw: np.ndarray,
        noise: np.ndarray,
        truth: tuple[float, ...],
    ) -> float:
        ns = plan.num_stages

        def on_group(g: tuple[int, ...], secs: float, j: int, phase: int) -> float:
            # Equal shares of the block; the group waits for its slowest member.
            return max(secs / len(g) / truth[d] * float(noise[d, j, phase]) for d in g)

        if ns == 1:  # one timed block (F+B+W) per microbatch
            g = plan.group(r, 0)
            return sum(on_group(g, float(f[j].sum() + bw[j].sum()), j, 0) for j in mine)
        bounds = np.cumsum((0, *plan.layer_partition[r]))

        def block(stage: int, j: int, phase: int) -> float:
            lo, hi = bounds[stage], bounds[stage + 1]
            return on_group(plan.group(r, stage), float((f if phase == 0 else bw)[j, lo:hi].sum()), j, phase)

        zero = (0.0,) * ns
        unit = (1.0,) * ns  # only the schedule's links and shape matter: durations give every block
        costs = StageCosts(f=unit, i=unit, w=zero, act_bytes=zero, out_bytes=zero, static_bytes=zero)
        return makespan(
            cached_one_f_one_b(ns, len(mine)),
            costs,
            durations=lambda a: block(a.stage, mine[a.microbatch], 0 if a.kind.value == "F" else 1),
        )

    def true_speeds(self, step: int) -> tuple[float, ...]:
        """Device speeds at step ``step`` under the spec's faults, counted in steps as the live runtime
        counts them (``SlowFault``: from ``start`` for ``duration`` steps)."""
        faults = [SlowFault(**f) for f in self.spec.get("faults") or []]
        return tuple(1.0 / math.prod(f.factor_at(r, step) for f in faults) for r in range(self.ranks))

    def link_slowdown(self, step: int) -> float:
        """How much longer the DP job's ring all-reduce takes at step ``step`` under the spec's link faults:
        its slowest link's factor, as the live runtime emulates it (``Runtime.comm_timed``)."""
        faults = [LinkFault(**f) for f in self.spec.get("link_faults") or []]
        return max(math.prod(f.factor_at(r, step) for f in faults) for r in range(self.ranks))

    def for_policy(self, policy: Policy, *, faulted: bool) -> tuple[Policy, StepTimeOf]:
        """``policy`` wrapped to record the speeds it detects, and the matching ``step_time_of``. With
        ``faulted`` the true speeds follow the spec's faults by step index (the failure events then only
        drive what the policy observes)."""
        watched = _Watched(policy, adapts=not isinstance(policy, NoOp), devices=self.ranks)

        def step_time_of(step: int, plan: ExecutionPlan, truth: tuple[float, ...]) -> float:
            if not faulted:
                return self.step_time(step, plan, truth, watched.speeds())
            return self.step_time(step, plan, self.true_speeds(step), watched.speeds(), links=True)

        return watched, step_time_of


class _Watched:
    """A policy that remembers the speeds it last saw: the live runtime assigns by its detected speeds."""

    def __init__(self, policy: Policy, *, adapts: bool, devices: int) -> None:
        self._policy = policy
        self._adapts = adapts
        self._ones = (1.0,) * devices
        self._seen = self._ones
        self.name = policy.name
        self.detect_stop_steps = policy.detect_stop_steps
        self.detect_slow_steps = policy.detect_slow_steps

    def __getattr__(self, name: str) -> Any:  # detection delays, reset, ...: the wrapped policy's
        return getattr(self._policy, name)

    def speeds(self) -> tuple[float, ...]:
        return self._seen if self._adapts else self._ones

    def on_step(
        self,
        t: float,
        step: int,
        observed: tuple[float, ...],
        plan: ExecutionPlan,
        state: Any,
        ctx: SimContext,
    ) -> Decision:
        self._seen = tuple(state.speeds)
        return self._policy.on_step(t, step, observed, plan, state, ctx)


def _window(res: SimResult, first: int, last: int, tokens: list[int]) -> float:
    rows = res.timeline[first:last]
    if len(rows) < last - first:
        raise ValueError(f"the simulation completed {len(res.timeline)} steps, fewer than {last}")
    return sum(tokens[first:last]) / (rows[-1][0] + rows[-1][1] - rows[0][0])


def _failures(spec: dict[str, Any], starts: list[float], ends: list[float]) -> list[FailureEvent]:
    """The live faults as failure events: from the simulated start of their first step (``starts[i]``:
    step i's start; the steps before a fault are the same in every run) to the start of the step after
    their last (``ends``: the run's own step starts)."""
    out = []
    for f in spec.get("faults") or []:
        start = int(f["start"])
        end = start + int(f["duration"]) if f.get("duration") else None
        t0 = starts[start]
        t1 = ends[end] if end is not None and end < len(ends) else float("inf")
        out.append(
            FailureEvent(
                kind="fail-slow",
                device=int(f["rank"]),
                start_s=t0,
                duration_s=max(t1 - t0, 1e-9),
                factor=1.0 / float(f["factor"]),
            )
        )
    return out


def _policies(spec: dict[str, Any]) -> dict[str, Policy]:
    return {
        "healthy": NoOp(),
        "unmitigated": NoOp(),
        "adapted": ResiHPPolicy(
            detect_slow_steps=2.0,
            expected_slow_s=float(spec.get("expected_slow_s", 24 * 60.0)),
            per_replica_partitions=bool(spec.get("per_replica_partitions", True)),
        ),
    }


def _simulate(
    job: SimJob, spec: dict[str, Any], first: int, workload: LiveWorkload | None
) -> tuple[dict[str, float], float, dict[str, list[float]]]:
    """Tokens/s of the three runs over steps [first, steps), the simulated healthy step (window mean), and
    each run's simulated step times by step index."""
    steps = int(spec.get("steps", 60))
    policies = _policies(spec)
    tokens = [workload.tokens(i) if workload else job.tokens_per_step for i in range(steps)]

    def one(name: str, failures: list[FailureEvent], horizon: float) -> SimResult:
        policy = policies[name]
        if workload is None:
            return run(job, policy, failures, horizon)
        watched, step_time_of = workload.for_policy(policy, faulted=name != "healthy")
        return run(job, watched, failures, horizon, step_time_of=step_time_of)

    def grown(name: str, failures: list[FailureEvent], horizon: float) -> SimResult:
        """``one`` with the horizon doubled until the run completes ``steps + 1`` steps."""
        for _ in range(12):
            if len((res := one(name, failures, horizon)).timeline) > steps:
                return res
            horizon *= 2.0
        raise ValueError(f"the simulated {name} run did not complete {steps} steps (a halted plan?)")

    healthy = grown("healthy", [], 1.0)
    starts = [row[0] for row in healthy.timeline]
    runs = {"healthy": healthy}
    bounded = any(f.get("duration") for f in spec.get("faults") or [])
    for name in ("unmitigated", "adapted"):
        ends = starts  # a fault's end in the run's own steps: a second pass takes them from the first
        for _ in range(2 if bounded else 1):
            runs[name] = grown(name, _failures(spec, starts, ends), 3.0 * starts[-1])
            ends = [row[0] for row in runs[name].timeline]
    rates = {k: _window(r, first, steps, tokens) for k, r in runs.items()}
    step_s = {k: [row[1] for row in r.timeline[:steps]] for k, r in runs.items()}
    return rates, statistics.fmean(step_s["healthy"][first:]), step_s


def predict_live(result: dict[str, Any]) -> dict[str, Any]:
    """Predicted vs measured tokens/s of the three runs of a live comparison (module docstring)."""
    spec, ranks = result["spec"], int(result["ranks"])
    first = max(int(result["throughput_window_from_step"]), 5)
    measured = result["throughput_tokens_per_s"]
    healthy_rows = [r for r in result["runs"]["healthy"] if r["step"] >= first]
    measured_step = sum(r["wall_s"] for r in healthy_rows) / len(healthy_rows)
    workload = LiveWorkload(spec, ranks)
    job = sim_job_for(spec, ranks)
    preds = {}
    preds["workload"], sim_step, step_s = _simulate(job, spec, first, workload)
    preds["mean_microbatch"], mean_step, _ = _simulate(job, spec, first, None)
    overhead = max(0.0, measured_step - sim_step)
    preds["calibrated"], _, _ = _simulate(sim_job_for(spec, ranks, overhead), spec, first, workload)
    out: dict[str, Any] = {
        "window_from_step": first,
        "measured_tokens_per_s": dict(measured),
        "measured_healthy_step_s": measured_step,
        "simulated_healthy_step_s": sim_step,
        "mean_microbatch_healthy_step_s": mean_step,
        "calibrated_overhead_s": overhead,
    }
    for name, pred in preds.items():
        out[name] = {
            "tokens_per_s": pred,
            "error": {k: (pred[k] - measured[k]) / measured[k] for k in _RUNS},
        }
    out["workload"]["step_s"] = step_s
    out["workload"]["per_step"] = {k: _per_step(step_s[k], result["runs"][k], first) for k in _RUNS}
    return out


def _per_step(simulated: list[float], rows: list[dict[str, Any]], first: int) -> dict[str, float]:
    """Step-by-step agreement over the window: mean absolute percentage error and Pearson correlation of
    the simulated step times against the measured ones (how well the model follows the batch-to-batch
    variation, not only the mean)."""
    pairs = [(simulated[r["step"]], r["wall_s"]) for r in rows if first <= r["step"] < len(simulated)]
    sim, meas = np.array([p[0] for p in pairs]), np.array([p[1] for p in pairs])
    corr = float(np.corrcoef(sim, meas)[0, 1]) if len(pairs) > 2 and sim.std() > 0 and meas.std() > 0 else 0.0
    return {"steps": len(pairs), "mape": float(np.mean(np.abs(sim - meas) / meas)), "corr": corr}


def plot_live(result: dict[str, Any], path: str | Path) -> Path:
    """Measured step time per step of each run (solid) and the workload model's prediction (dashed), with
    the fault's onset and its detection marked. ``result``: a ``--compare`` result with ``simulated``."""
    from steptune.core.plot import timelines

    pred = result.get("simulated") or predict_live(result)
    series: dict[str, tuple[list[float], list[float]]] = {}
    dashed = {}
    for run_name, rows in result["runs"].items():
        series[run_name] = ([r["step"] for r in rows], [r["wall_s"] for r in rows])
        sim = pred["workload"].get("step_s", {}).get(run_name)
        if sim:
            series[f"{run_name} (simulated)"] = (list(range(len(sim))), sim)
            dashed[f"{run_name} (simulated)"] = run_name
    marks = {}
    faults = result["spec"].get("faults") or []
    if faults:
        marks[f"fault: rank {faults[0]['rank']} x{faults[0]['factor']}"] = float(faults[0]["start"])
    if result.get("detection_delay_steps") is not None and faults:
        marks["detected (adapted run)"] = float(faults[0]["start"] + result["detection_delay_steps"])
    settled = [r["wall_s"] for rows in result["runs"].values() for r in rows if r["step"] >= _WARMUP]
    ylim = (0.0, 1.1 * max(settled)) if settled else None  # the first steps pay process warm-up
    spec = result["spec"]
    layout = ", ".join(f"{k}={spec[k]}" for k in ("dp", "pp", "tp") if k in spec) or f"dp={result['ranks']}"
    title = f"live run ({layout}, time scale {spec.get('time_scale')}): measured vs simulated (dashed)"
    return timelines(
        series,
        path,
        xlabel="step",
        ylabel="step time (emulated s)",
        title=title,
        dashed=dashed,
        marks=marks,
        ylim=ylim,
    )
