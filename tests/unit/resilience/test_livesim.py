"""The simulator's model of the live runs: a workload whose steps differ (``run(step_time_of=)``) and the
live jobs' own microbatches (``livesim.LiveWorkload``), checked against the measured live runs."""

import json
import math
from pathlib import Path

import pytest

from steptune.resilience.livesim import LiveWorkload, plot_live, predict_live, sim_job_for
from steptune.resilience.plan import ClusterState
from steptune.resilience.policies import NoOp
from steptune.resilience.replans import initial_plan
from steptune.resilience.runtime import lpt_assign
from steptune.resilience.sim import FailureEvent, run
from steptune.resilience.steptune_policy import SteptunePolicy

RESULTS = Path(__file__).resolve().parents[3] / "benchmarks" / "results"


def _plan(dp: int, pp: int = 1, tp: int = 1, layers: int = 34):
    state = ClusterState(speeds=(1.0,) * (dp * pp * tp), layer_costs=(1.0,) * layers, num_heads=32)
    return initial_plan(state, tp=tp, pp=pp, dp=dp, global_microbatches=16)


def test_a_step_time_of_that_returns_the_models_time_changes_nothing():
    job = sim_job_for({"steps": 3}, ranks=4)  # DP = 4: a step is 4 microbatches on the slowest rank
    fail = [FailureEvent(kind="fail-slow", device=1, start_s=100.0, factor=0.5)]
    healthy = run(job, NoOp(), [], 1000.0).timeline[0][1]
    seen = []

    def same(step, plan, truth):
        seen.append(step)
        return healthy / min(truth)

    a = run(job, NoOp(), fail, 600.0)
    b = run(job, NoOp(), fail, 600.0, step_time_of=same)
    assert len(a.timeline) == len(b.timeline) > 3 and a.tokens == b.tokens
    assert [v for x in a.timeline for v in x[:2]] == pytest.approx([v for x in b.timeline for v in x[:2]])
    assert seen[: len(b.timeline)] == list(range(len(b.timeline)))  # called once per step, in order


def test_a_policy_that_prices_its_own_steps_refuses_a_varying_workload():
    job = sim_job_for({"steps": 3}, ranks=4)
    with pytest.raises(ValueError, match="prices its own steps"):
        run(job, SteptunePolicy(), [], 100.0, step_time_of=lambda step, plan, truth: 1.0)


def test_dp_step_is_the_lpt_of_its_own_microbatches():
    spec = {"steps": 4, "seed": 3}
    wl = LiveWorkload(spec, ranks=4)
    wl.sigma = 0.0  # no noise: the step is exactly the slowest rank's load plus the all-reduce
    plan = _plan(dp=4)
    for step in range(4):
        _, f, bw, _ = wl._step(step)
        cost = list((f + bw).sum(axis=1))
        loads = [sum(cost[i] for i in a) for a in lpt_assign(cost, [1.0] * 4)]
        t = wl.step_time(step, plan, (1.0,) * 4, (1.0,) * 4)
        assert t == pytest.approx(max(loads) + wl.sync_s)
        assert max(loads) > sum(cost) / 4  # variable microbatches never balance exactly
        # A 1.6x slow rank the assignment does not know about takes 1.6x its load ...
        slow = wl.step_time(step, plan, (1.0, 1 / 1.6, 1.0, 1.0), (1.0,) * 4)
        owner = lpt_assign(cost, [1.0] * 4)[1]
        assert slow >= sum(cost[i] for i in owner) * 1.6 + wl.sync_s - 1e-9
        # ... and one it knows about gets less work, so the step is shorter.
        assert wl.step_time(step, plan, (1.0, 1 / 1.6, 1.0, 1.0), (1.0, 1 / 1.6, 1.0, 1.0)) < slow
    assert sum(wl.tokens(s) for s in range(4)) > 0


def test_pipeline_step_lies_between_the_busiest_stage_and_all_the_work():
    spec = {"steps": 2, "seed": 0, "dp": 2, "pp": 2}
    wl = LiveWorkload(spec, ranks=4)
    wl.sigma = 0.0
    plan = _plan(dp=2, pp=2)
    _, f, bw, _ = wl._step(1)
    t = wl.step_time(1, plan, (1.0,) * 4, (1.0,) * 4)
    cut = plan.layer_partition[0][0]
    per_mb = (f + bw).sum(axis=1)
    # Each replica runs about half the batch; its slowest stage bounds it from below.
    stage_work = [(f + bw)[:, :cut].sum(), (f + bw)[:, cut:].sum()]
    assert max(stage_work) / 2 * 0.8 < t < per_mb.sum()
    # A slower stage device only makes it longer.
    assert wl.step_time(1, plan, (1.0, 0.5, 1.0, 1.0), (1.0,) * 4) > t


def test_noise_is_the_same_for_every_policy_and_seeded_by_step():
    wl = LiveWorkload({"steps": 3, "seed": 0}, ranks=4)
    plan = _plan(dp=4)
    a = wl.step_time(2, plan, (1.0,) * 4, (1.0,) * 4)
    other = LiveWorkload({"steps": 3, "seed": 0}, ranks=4)
    other.step_time(1, plan, (1.0,) * 4, (1.0,) * 4)  # a different order of calls
    assert other.step_time(2, plan, (1.0,) * 4, (1.0,) * 4) == a
    assert wl.step_time(1, plan, (1.0,) * 4, (1.0,) * 4) != a


LIVE = ["resilience_live.json", "resilience_live_pp.json", "resilience_live_tp.json"]  # time scale 0.02-0.05
PREDICT = [
    "resilience_live_predict_dp.json",
    "resilience_live_predict_pp.json",
    "resilience_live_predict_tp.json",
]


@pytest.mark.parametrize("name", LIVE + PREDICT)
def test_the_workload_model_predicts_the_measured_live_runs(name):
    """The stored live runs (MEASURED, emulated device time): the per-step workload model is closer to the
    healthy run than the mean microbatch; with one constant fitted on the healthy run every run is within
    10% (the issue's bar), and at time scale 0.1 (host overheads under 5% of a step) it is within 10%
    with nothing fitted."""
    result = json.loads((RESULTS / name).read_text())
    pred = predict_live(result)
    err = {k: pred[k]["error"] for k in ("workload", "mean_microbatch", "calibrated")}
    assert abs(err["workload"]["healthy"]) < abs(err["mean_microbatch"]["healthy"])
    assert pred["simulated_healthy_step_s"] > pred["mean_microbatch_healthy_step_s"]
    assert all(abs(v) < 0.10 for v in err["calibrated"].values()), err
    assert abs(err["calibrated"]["healthy"]) < 1e-6  # the fitted constant closes the healthy run exactly
    assert math.isfinite(pred["calibrated_overhead_s"]) and pred["calibrated_overhead_s"] >= 0
    if name in PREDICT:
        assert result["spec"]["time_scale"] == 0.1
        assert all(abs(v) < 0.10 for v in err["workload"].values()), err


def test_a_slow_link_is_predicted_from_the_slowest_link_of_the_ring():
    # The stored DP run with rank 2's network link 4x slow from step 20 (MEASURED, emulated time). Before
    # 2026-12-05 the prediction left link faults out: the unmitigated run came out 13.9% fast (workload)
    # and 7.3% fast (calibrated).
    result = json.loads((RESULTS / "resilience_live_link.json").read_text())
    wl = LiveWorkload(result["spec"], 4)
    assert wl.link_slowdown(19) == 1.0 and wl.link_slowdown(20) == 4.0 and wl.link_slowdown(59) == 4.0
    pred = predict_live(result)
    assert all(abs(v) < 0.03 for v in pred["calibrated"]["error"].values()), pred["calibrated"]
    assert all(abs(v) < 0.08 for v in pred["workload"]["error"].values()), pred["workload"]
    assert pred["workload"]["per_step"]["unmitigated"]["mape"] < 0.08


def test_a_slow_link_in_a_pipeline_slows_only_its_stages_all_reduce():
    # The stored DP x PP run (MEASURED, emulated time): rank 1's link 3x slow from step 20 slows stage 1's
    # all-reduce among its replicas (ranks 1 and 3), which the step waits for after the pipeline.
    from steptune.resilience.live import stage_sync_seconds
    from steptune.resilience.pipelined import owned_layers

    result = json.loads((RESULTS / "resilience_live_link_pp.json").read_text())
    spec = result["spec"]
    assert spec["stage_sync"] and spec["link_faults"] == [{"rank": 1, "factor": 3.0, "start": 20}]
    wl = LiveWorkload(spec, 4)
    plan = _plan(dp=2, pp=2)
    stage = [stage_sync_seconds(spec, owned_layers(plan.layer_partition[0], s), 2, 4) for s in (0, 1)]
    assert wl._stage_sync_s(plan, None) == pytest.approx(max(stage))
    assert wl._stage_sync_s(plan, 19) == pytest.approx(max(stage))
    assert wl._stage_sync_s(plan, 20) == pytest.approx(3 * stage[1])
    assert wl._stage_sync_s(plan, 20) > 2.5 * wl._stage_sync_s(plan, 19)
    pred = predict_live(result)
    assert all(abs(v) < 0.03 for v in pred["calibrated"]["error"].values()), pred["calibrated"]
    assert all(abs(v) < 0.12 for v in pred["workload"]["error"].values()), pred["workload"]
    # The live run found it on the right rank: the link alarm, and no device blamed
    assert result["link_alarms"] and all(a["rank"] == 1 for a in result["link_alarms"])
    assert result["false_alarms"] == 0 and not any(r["alarms"] for r in result["runs"]["unmitigated"])


def test_per_step_prediction_follows_the_measured_steps_and_plots(tmp_path):
    """At time scale 0.1 the workload model follows the batch-to-batch variation of every run (per-step
    MAPE and correlation over the window), and ``plot_live`` draws both."""
    result = json.loads((RESULTS / "resilience_live_predict_pp.json").read_text())
    result["simulated"] = pred = predict_live(result)
    for run_name, fit in pred["workload"]["per_step"].items():
        assert fit["steps"] == 80 - pred["window_from_step"], run_name
        assert fit["mape"] < 0.08 and fit["corr"] > 0.6, (run_name, fit)
        assert len(pred["workload"]["step_s"][run_name]) == 80
    out = plot_live(result, tmp_path / "live.png")
    assert out.stat().st_size > 10_000


def test_timelines_plot_checks_its_series(tmp_path):
    from steptune.core.plot import timelines

    with pytest.raises(ValueError, match="2 values for 3"):
        timelines({"a": ([0, 1, 2], [1.0, 2.0])}, tmp_path / "x.png", xlabel="x", ylabel="y")
    with pytest.raises(ValueError, match="must follow a solid series"):
        timelines({"a": ([0], [1.0])}, tmp_path / "x.png", xlabel="x", ylabel="y", dashed={"a": "b"})
    series = {"m": ([0, 1], [1.0, 2.0]), "p": ([0, 1], [1.1, 1.9])}
    path = timelines(series, tmp_path / "ok.png", xlabel="x", ylabel="y", dashed={"p": "m"}, marks={"e": 0.5})
    assert path.exists()


def test_a_bounded_fault_lasts_its_steps_and_a_strong_one_completes():
    """A fault with ``duration`` slows exactly those steps, as the live runtime counts them (not the
    healthy run's seconds), and a 5x fault still completes every step of the prediction."""
    from steptune.resilience.livesim import _simulate

    spec = {"steps": 30, "seed": 0, "faults": [{"rank": 1, "factor": 2.0, "start": 10, "duration": 8}]}
    wl = LiveWorkload(spec, ranks=4)
    assert wl.true_speeds(9) == (1.0,) * 4 and wl.true_speeds(17)[1] == 0.5 and wl.true_speeds(18)[1] == 1.0
    _, _, step_s = _simulate(sim_job_for(spec, 4), spec, 5, wl)
    ratio = [u / h for u, h in zip(step_s["unmitigated"], step_s["healthy"], strict=True)]
    assert all(r == pytest.approx(1.0) for r in ratio[:10] + ratio[18:])
    assert all(r > 1.3 for r in ratio[10:18])  # the slow rank's share, doubled, paces every slow step
    strong = {**spec, "faults": [{"rank": 1, "factor": 5.0, "start": 10}]}
    rates, _, step_s = _simulate(sim_job_for(strong, 4), strong, 5, LiveWorkload(strong, ranks=4))
    assert all(len(v) == 30 for v in step_s.values()) and rates["adapted"] > rates["unmitigated"]
