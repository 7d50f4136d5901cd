"""Sensitivity sweeps: more failures cost every policy throughput; more length spread means more
false alarms for the fixed threshold and none for ResiHP."""

import json
import math

import pytest

from steptune.cli import main
from steptune.resilience.sweep import fail_slow_duration_sweep, failure_rate_sweep, length_cv_sweep

pytestmark = pytest.mark.timeout(300)


def test_failure_rate_sweep() -> None:
    res = failure_rate_sweep(
        model="llama2-7b",
        kinds=("fail-stop",),
        rate_scales=(0.5, 2.0),
        duration_s=1200.0,  # 0 and 1 fail-stops; the oracle's pricing makes longer runs slow
        detector_runs=1,  # the detector study is not what these tests check
        workers=1,
        policies=("resihp", "recycle", "oobleck", "ckpt-restart", "oracle"),
    )
    lo, hi = res["rows"]
    assert (lo["rate_scale"], hi["rate_scale"]) == (0.5, 2.0)
    assert hi["failures"] > lo["failures"]
    for p in ("resihp", "oracle", "ckpt-restart"):
        assert hi["tokens_per_s"][p] < lo["tokens_per_s"][p]
    assert set(lo["ratio_vs"]) == {"recycle", "oobleck"}  # the fail-stop baselines in the sweep
    with pytest.raises(ValueError, match="rate scales"):
        failure_rate_sweep(rate_scales=(0.0,))


def test_fail_slow_duration_sweep() -> None:
    res = fail_slow_duration_sweep(
        model="llama2-7b",
        kinds=("fail-slow-strong",),
        medians_s=(120.0, math.inf),
        duration_s=1200.0,
        detector_runs=1,  # the detector study is not what these tests check
        workers=1,
        policies=("resihp", "steptune", "greyhound", "adaptra", "ckpt-restart", "oracle"),
    )
    short, persistent = res["rows"]
    assert (short["persistent"], persistent["persistent"]) == (False, True)
    assert short["median_s"] == 120.0 and persistent["median_s"] is None
    assert short["failures"] == persistent["failures"] > 0  # same onsets and devices, other durations
    # A persistent episode costs a policy blind to fail-slows more; the oracle can only lose too.
    t_s, t_p = short["tokens_per_s"], persistent["tokens_per_s"]
    assert t_p["ckpt-restart"] < t_s["ckpt-restart"] and t_p["oracle"] <= t_s["oracle"]
    assert set(persistent["ratio_vs"]) == {"resihp", "steptune"}
    assert set(persistent["ratio_vs"]["resihp"]) == {"greyhound", "adaptra"}
    assert all(0 < x <= 1 + 1e-9 for x in persistent["of_oracle"].values())
    with pytest.raises(ValueError, match="median durations"):
        fail_slow_duration_sweep(medians_s=(0.0,))


def test_length_cv_sweep() -> None:
    res = length_cv_sweep(sigmas=(0.3, 1.5), runs=4, steps=50)
    narrow, wide = res["rows"]
    assert wide["microbatch_forward_cv"] > 1.5 * narrow["microbatch_forward_cv"]
    fixed = [r["detector"]["fixed-threshold"]["false_alarms_per_run"] for r in (narrow, wide)]
    assert fixed[1] > fixed[0]
    assert wide["detector"]["resihp"]["false_alarms_per_run"] < fixed[1] / 10


def test_sweep_cli(tmp_path, monkeypatch, capsys) -> None:
    import steptune.resilience.sweep as sweep

    monkeypatch.setattr(sweep, "failure_rate_sweep", lambda **kw: {"rows": []})
    monkeypatch.setattr(sweep, "length_cv_sweep", lambda **kw: {"rows": []})
    monkeypatch.setattr(sweep, "fail_slow_duration_sweep", lambda **kw: {"rows": []})
    out = tmp_path / "s.json"
    assert main(["resilience", "sweep", "--quick", "--json", str(out)]) == 0
    assert set(json.loads(out.read_text())) == {"failure_rate", "fail_slow_duration", "length_cv"}
