"""Workload model, predictor and detectors on simulated runs (SIMULATED device time)."""

import numpy as np
import pytest

from steptune.core.specs import Phase, cluster_preset, model_preset
from steptune.resilience.detect import (
    ChangePointDetector,
    FixedThresholdDetector,
    HeartbeatMonitor,
    ResiHPDetector,
)
from steptune.resilience.evaluate import FailSlow, FailStop, JobSpec, detector_scores, simulate_run
from steptune.resilience.predict import WorkloadPredictor
from steptune.resilience.workload import LENGTH_PRESETS, StageModel, features, pack

pytestmark = pytest.mark.timeout(300)


def test_pack_respects_the_budget_and_features():
    rng = np.random.default_rng(0)
    mbs = pack(rng, LENGTH_PRESETS["code"], 32768, 50)
    assert len(mbs) == 50 and all(0 < sum(m) <= 32768 for m in mbs)
    assert features([3, 4]) == (7.0, 25.0)


def test_stage_time_is_linear_plus_quadratic():
    m = model_preset("llama2-7b")
    sm = StageModel(layers=m.layers[1:3], device=cluster_preset("a100-256").device)
    one, two = sm.time([1000], Phase.F), sm.time([1000, 1000], Phase.F)
    assert two == pytest.approx(2 * one)  # two sequences: twice the work
    packed = sm.time([2000], Phase.F)
    assert packed > two  # one long sequence: the same tokens, more attention (quadratic)
    assert sm.time([1000], Phase.W) < sm.time([1000], Phase.B)  # attention has no weight gradient


def test_predictor_recovers_a_linear_model_and_refuses_failures():
    rng = np.random.default_rng(1)
    pred = WorkloadPredictor()
    with pytest.raises(ValueError, match="warm-up"):
        pred.predict("s0", 1.0, 1.0)
    for _ in range(40):
        n, q = rng.uniform(1e3, 3e4), rng.uniform(1e6, 5e8)
        pred.observe("s0", n, q, 0.01 + 2e-6 * n + 1e-10 * q)
    assert pred.predict("s0", 2e4, 2e8) == pytest.approx(0.01 + 0.04 + 0.02, rel=1e-6)
    assert not pred.observe("s0", 2e4, 2e8, 1.5 * 0.07)  # a slowed sample is not learned
    assert pred.predict("s0", 2e4, 2e8) == pytest.approx(0.07, rel=1e-6)
    # a NaN time passed the healthy band (NaN compares False) and broke the next refit inside scipy
    for bad in ((2e4, 2e8, float("nan")), (2e4, float("inf"), 0.07), (-1.0, 2e8, 0.07)):
        with pytest.raises(ValueError, match="finite and >= 0"):
            pred.observe("s0", *bad)
    assert pred.predict("s0", 2e4, 2e8) == pytest.approx(0.07, rel=1e-6)


def test_predictors_are_accurate_on_healthy_variable_lengths():
    res = simulate_run(JobSpec(), 50, seed=3)
    steps = np.array(res.step_times)
    assert steps.std() / steps.mean() > 0.03  # the workload really varies
    assert res.mtp_mape() < 0.05  # microbatch time predictor
    assert res.itp_mape() < 0.05  # iteration time = critical path of predicted times
    assert res.alarms["resihp"] == []
    assert len(res.alarms["fixed-threshold"]) >= 3  # a fixed 10% rule mistakes workload for failure
    assert res.alarms["change-point"] == [] and res.alarms["heartbeat"] == []


def test_resihp_localizes_a_fail_slow_and_heartbeat_a_fail_stop():
    res = simulate_run(
        JobSpec(), 50, failures=(FailSlow(unit=6, factor=1.25, start=30), FailStop(unit=11, step=35)), seed=4
    )
    slow = res.alarms["resihp"]
    assert [a.unit for a in slow] == [6] and 30 <= slow[0].step <= 35
    assert slow[0].slowdown == pytest.approx(1.25, rel=0.08)
    dead = res.alarms["heartbeat"]
    assert [a.unit for a in dead] == [11] and 35 <= dead[0].step <= 39


def test_change_point_sees_a_global_slowdown_but_not_healthy_noise():
    cp = ChangePointDetector()
    rng = np.random.default_rng(0)
    alarms = []
    for step in range(80):
        level = 1.0 if step < 50 else 1.3
        alarms += cp.observe(step, {0: level * (1 + 0.03 * rng.standard_normal())})
    assert len(alarms) == 1 and 50 <= alarms[0].step <= 55


@pytest.mark.parametrize("jump", [1.2, 1.5, 3.0, 100.0])
def test_change_point_sees_a_slowdown_of_any_size(jump):
    # Found in a sweep (2026-12-05): from 1.5x at 1% noise every likelihood underflowed to 0 and the
    # detector never alarmed again (detection 0 at --factor 100, 1 at --factor 3)
    cp = ChangePointDetector()
    rng = np.random.default_rng(1)
    alarms = []
    for step in range(45):
        level = 1.0 if step < 30 else jump
        alarms += cp.observe(step, {0: level * (1 + 0.01 * rng.standard_normal())})
    assert len(alarms) == 1 and 30 <= alarms[0].step <= 33, alarms
    assert np.isfinite(cp._probs).all() and cp._probs.sum() == pytest.approx(1.0)


def test_fixed_threshold_and_heartbeat_units():
    det = FixedThresholdDetector(0.10)
    assert [a.unit for a in det.observe(0, {0: 1.0, 1: 1.0, 2: 1.2})] == [2]
    hb = HeartbeatMonitor(timeout=5.0)
    assert [a.unit for a in hb.check(3, 10.0, {0: 9.0, 1: 2.0})] == [1]
    assert hb.check(4, 20.0, {0: 19.0, 1: 2.0}) == []  # declared once
    with pytest.raises(ValueError):
        HeartbeatMonitor(timeout=0)
    with pytest.raises(ValueError, match="predicted"):
        ResiHPDetector().observe(0, {0: 1.0})


def test_detector_scores_small_sample():
    scores = detector_scores(JobSpec(), runs=8, steps=60, factor=1.25)
    assert scores["resihp"]["detection_rate"] == 1.0
    assert scores["resihp"]["false_alarms_per_run"] <= 0.3
    assert scores["heartbeat"]["detection_rate"] == 1.0
    assert scores["fixed-threshold"]["false_alarms_per_run"] >= 3
    with pytest.raises(ValueError, match="steps=1: a detection run needs at least 30 steps"):
        detector_scores(JobSpec(), runs=2, steps=1)  # said "high <= 0"


def test_detectors_refuse_times_and_settings_that_would_blind_them():
    # A session-47 sweep: one NaN in a unit's warm-up made its baseline NaN, and a later 2x slowdown of it
    # never alarmed; consecutive=0 alarmed every healthy unit every step; HeartbeatMonitor(nan) never did
    import math

    from steptune.resilience.detect import (
        ChangePointDetector,
        FixedThresholdDetector,
        HeartbeatMonitor,
        ResiHPDetector,
    )

    det = ResiHPDetector()
    with pytest.raises(ValueError, match="observed time of unit 1 must be a finite number"):
        det.observe(0, {0: 1.0, 1: math.nan}, {0: 1.0, 1: 1.0})
    with pytest.raises(ValueError, match="predicted time of unit 0 must be a finite number of seconds > 0"):
        det.observe(0, {0: 1.0}, {0: 0.0})
    with pytest.raises(ValueError, match=r"no predicted time for unit\(s\) \[1\]"):
        det.observe(0, {0: 1.0, 1: 1.0}, {0: 1.0})
    for bad in ({"consecutive": 0}, {"threshold": -0.1}, {"consecutive": 1.5}):
        with pytest.raises(ValueError, match=r"threshold must be|consecutive must be"):
            FixedThresholdDetector(**bad)
    with pytest.raises(ValueError, match="timeout must be a finite number"):
        HeartbeatMonitor(math.nan)
    for empty in (ChangePointDetector(), FixedThresholdDetector(), ResiHPDetector()):  # no unit ran
        assert empty.observe(0, {}, {}) == []


def test_a_preset_without_a_head_count_is_refused_under_tp():
    # it ran as one head, and steptune's uneven shares put a whole TP group's work on one member (a sweep)
    from steptune.resilience.policies import NoOp
    from steptune.resilience.sim import SimJob, run

    with pytest.raises(ValueError, match="names no attention head count"):
        run(SimJob(model="qwen2-vl-7b-like", tp=4, pp=4, dp=2), NoOp(), [], 10.0)
    assert run(SimJob(model="qwen2-vl-7b-like", tp=1, pp=4, dp=2), NoOp(), [], 10.0).tokens_per_s > 0
