"""Replay of the real SE trace (128-GPU job, healthy, sequence-length imbalance) through the detectors."""

import re
import sys

import numpy as np
import pytest

from steptune.resilience.detect import ChangePointDetector, FixedThresholdDetector, ResiHPDetector
from steptune.resilience.trace import (
    TRACE_ENV,
    TraceConfig,
    default_trace_path,
    inject_fail_slow,
    load_trace,
    replay,
    trace_stats,
    trace_steps,
)

ONSET = 20
"""Step index (into the recorded steps) where the injected fail-slow starts."""
FACTOR = 1.4

needs_trace = pytest.mark.skipif(
    not default_trace_path().is_file(),
    reason=f"SE trace not at {default_trace_path()} (set {TRACE_ENV} to trace-SE.parquet)",
)


@pytest.fixture(scope="module")
def columns():
    pytest.importorskip("pyarrow", reason="reading the trace needs pyarrow: pip install steptune[data]")
    return load_trace()


@pytest.fixture(scope="module")
def steps(columns):
    return trace_steps(columns)


def _residuals(steps, skip):
    return np.array([[o.observed[u] / o.predicted[u] - 1 for u in o.observed] for o in steps[skip:]])


def test_missing_trace_says_where_to_put_it(monkeypatch, tmp_path):
    monkeypatch.setenv(TRACE_ENV, str(tmp_path / "absent.parquet"))
    assert default_trace_path() == tmp_path / "absent.parquet"
    with pytest.raises(FileNotFoundError, match=TRACE_ENV):
        load_trace()


def test_missing_pyarrow_names_the_extra(monkeypatch, tmp_path):
    path = tmp_path / "trace.parquet"
    path.write_bytes(b"")
    monkeypatch.setitem(sys.modules, "pyarrow", None)
    with pytest.raises(ImportError, match=re.escape("pip install steptune[data]")):
        load_trace(path)


@needs_trace
def test_trace_shape(columns, steps):
    # meta-SE.yaml: world size 128 = DP 32 x PP 2 x DSP 2; the trace records one rank of each DSP
    # pair (the even global ranks), so 64 units, spanning global ranks 0..126.
    ranks = np.unique(columns["rank"])
    assert len(ranks) == 64 and ranks.tolist() == list(range(0, 128, 2))
    assert len(np.unique(columns["step"])) == 43
    assert len(steps) == 43
    assert all(set(o.observed) == set(ranks.tolist()) == set(o.predicted) for o in steps)


@needs_trace
def test_calibration_stats(columns, record_property):
    stats = trace_stats(columns)
    record_property("trace_stats", str(stats))
    print(stats)
    assert stats.forward_cv == pytest.approx(0.34, abs=0.005)  # README
    assert stats.forward_rank_cv == pytest.approx(0.28, abs=0.005)  # README
    assert stats.step_time_mean == pytest.approx(9.11, abs=0.01)  # research brief
    assert stats.step_time_cv == pytest.approx(0.071, abs=0.001)
    assert stats.step_max_over_median == pytest.approx(1.245, abs=0.001)
    assert stats.frac_steps_over_1p1 == pytest.approx(4 / 43)


@needs_trace
def test_partner_prediction_pooled_ratio_beats_per_dp(columns, steps, record_property):
    warmup = TraceConfig().warmup_steps
    pooled = np.abs(_residuals(steps, warmup))
    per_dp = np.abs(_residuals(trace_steps(columns, TraceConfig(pooled_ratio=False)), warmup))
    record_property("mape_pooled", float(pooled.mean()))
    record_property("mape_per_dp", float(per_dp.mean()))
    assert pooled.mean() < 0.05
    assert pooled.mean() <= per_dp.mean() and pooled.max() <= per_dp.max()


@needs_trace
def test_healthy_trace_no_resihp_alarm_but_baselines_fire(steps, record_property):
    alarms = replay([ResiHPDetector(), FixedThresholdDetector(threshold=0.10), ChangePointDetector()], steps)
    counts = {name: len(a) for name, a in alarms.items()}
    record_property("alarm_counts", counts)
    print(f"alarms on the healthy SE trace: {counts}")
    assert counts["resihp"] == 0
    assert counts["fixed-threshold"] >= 3
    assert "change-point" in counts


def _inject(columns, steps, rank):
    injected = inject_fail_slow(columns, rank=rank, start_step=steps[ONSET].step, factor=FACTOR)
    alarms = replay([ResiHPDetector()], trace_steps(injected))["resihp"]
    index = {o.step: i for i, o in enumerate(steps)}
    return alarms, [index[a.step] - ONSET for a in alarms]


@needs_trace
@pytest.mark.parametrize("rank", [0, 64], ids=["stage0", "stage1"])
def test_injected_fail_slow_localized(columns, steps, rank, record_property):
    alarms, latency = _inject(columns, steps, rank)
    record_property("alarms", [str(a) for a in alarms])
    print(f"rank {rank}: {alarms}, latency {latency} steps")
    assert [a.unit for a in alarms] == [rank]
    assert 0 <= latency[0] <= 5
    assert alarms[0].slowdown == pytest.approx(FACTOR, rel=0.15)


@needs_trace
def test_injected_fail_slow_every_rank(columns, steps, record_property):
    latencies, slowdowns = [], []
    for rank in sorted(steps[0].observed):
        alarms, latency = _inject(columns, steps, rank)
        assert [a.unit for a in alarms] == [rank], rank
        latencies.append(latency[0])
        slowdowns.append(alarms[0].slowdown)
    record_property("latency_counts", np.bincount(latencies).tolist())
    record_property(
        "slowdown_min_median_max", [float(min(slowdowns)), float(np.median(slowdowns)), float(max(slowdowns))]
    )
    assert max(latencies) <= 5
    assert np.median(slowdowns) == pytest.approx(FACTOR, rel=0.05)


@needs_trace
def test_step_without_partner_data_is_skipped(columns):
    # Drop rank 64's backward of microbatch 3 in the first step: that step has no complete partner data.
    first = columns["step"].min()
    drop = (
        (columns["rank"] == 64)
        & (columns["step"] == first)
        & (columns["optype"] == "backward-compute")
        & (columns["mb_id"] == 3)
    )
    assert drop.sum() == 1
    broken = {k: v[~drop] for k, v in columns.items()}
    with pytest.warns(UserWarning, match="skipped 1 of 43 steps"):
        steps = trace_steps(broken)
    assert len(steps) == 42 and steps[0].step != first


def test_bad_inputs_say_what_to_change():
    cols = {
        "dp_rank": np.array([0, 0]),
        "stage": np.array([0, 0]),
        "rank": np.array([0, 0]),
        "step": np.array([1, 1]),
        "optype": np.array(["forward-compute", "backward-compute"]),
        "start_ts": np.array([0.0, 1.0]),
        "duration": np.array([1.0, 1.0]),
        "mb_id": np.array([0, 0]),
    }
    with pytest.raises(ValueError, match="exactly 2 pipeline stages"):
        trace_steps(cols)
    with pytest.raises(ValueError, match="rank 5 is not in the trace"):
        inject_fail_slow(cols, rank=5, start_step=1, factor=1.4)
    with pytest.raises(ValueError, match="lacks columns"):
        trace_steps({k: v for k, v in cols.items() if k != "mb_id"})
    with pytest.raises(ValueError, match="distinct"):
        replay([ResiHPDetector(), ResiHPDetector()], [])
