"""The resilience bench: JSON in the issue's shape, ResiHP >= every baseline, nobody above the oracle."""

import json
import math

import pytest

from steptune.cli import main
from steptune.resilience import bench
from steptune.resilience.bench import HOME, POLICIES, BenchConfig, run_bench

pytestmark = pytest.mark.timeout(300)
TINY = BenchConfig(
    models=("llama2-7b",), kinds=("fail-stop", "mixed"), duration_s=1800.0, detector_runs=4, workers=2
)


@pytest.fixture(scope="module")
def result() -> dict:
    return run_bench(TINY)


def test_json_shape(result: dict) -> None:
    json.dumps(result, allow_nan=False)  # strict JSON: no NaN or inf anywhere
    assert {"rows", "ratios", "detector"} <= set(result)
    for row in result["rows"]:
        assert {"scenario", "kind", "model", "tokens_per_s"} <= set(row)
        assert set(row["tokens_per_s"]) == set(POLICIES)
    for name, s in result["ratios"].items():
        assert name in HOME and {"min", "median", "max"} <= set(s)
    for d in result["detector"].values():
        assert {"false_alarms_per_run", "detection_rate", "mean_latency_steps"} <= set(d)


def test_oracle_bounds_and_resihp_leads_the_restart_family(result: dict) -> None:
    assert result["above_oracle"] == []
    for row in result["rows"]:
        t = row["tokens_per_s"]
        assert t["resihp"] > 0 and math.isfinite(t["resihp"])
        # Systems that meet a fail-stop with a checkpoint restart, and doing nothing, trail ResiHP.
        for p in ("greyhound", "adaptra", "malleus-lite", "ckpt-restart", "noop"):
            assert t["resihp"] >= t[p] * (1 - 1e-9), (row["scenario"], p)
    # Where a baseline wins (ReCycle can, with deep pipelines' bubbles), the bench says so.
    for ours in ("resihp", "steptune"):
        listed = {(x["scenario"], x["baseline"]) for x in result[f"{ours}_below_baseline"]}
        for row in result["rows"]:
            for p, x in row["tokens_per_s"].items():
                if p not in ("resihp", "steptune", "oracle") and x > row["tokens_per_s"][ours] * (1 + 1e-9):
                    assert (row["scenario"], p) in listed, ours
    # steptune over every baseline with home rows in this bench (fail-stop, mixed), and over ResiHP
    homes = {b for b, kinds in HOME.items() if set(kinds) & {"fail-stop", "mixed"}}
    assert set(result["steptune_ratios"]) == {*homes, "resihp"}


def test_bench_cli_quick(tmp_path, monkeypatch, capsys) -> None:
    micro = BenchConfig(
        models=("llama2-7b",), kinds=("fail-stop",), duration_s=900.0, detector_runs=2, workers=1
    )
    monkeypatch.setattr(bench, "quick_config", lambda **kw: micro)
    out, png = tmp_path / "b.json", tmp_path / "b.png"
    assert main(["resilience", "bench", "--quick", "--json", str(out), "--plot", str(png)]) == 0
    assert json.loads(out.read_text())["rows"] and png.stat().st_size > 1000
    printed = capsys.readouterr().out
    assert "SIMULATED" in printed and "steptune below a baseline in" in printed
    assert json.loads(out.read_text())["steptune_ratios"]["resihp"]["rows"] == 1


def test_outputs_that_name_an_input_or_each_other_are_refused(tmp_path, capsys) -> None:
    # Found in a sweep (2026-12-05): --json over the --scenario CSV replaced the trace; --json and --plot
    # on one path wrote the PNG over the JSON; both printed "wrote:"
    trace = tmp_path / "victim.csv"
    trace.write_text("kind,device,start_s,duration_s,factor\nfail-stop,3,100,inf,0\n")
    before = trace.read_text()
    argv = ["resilience", "simulate", "--scenario", str(trace), "--policy", "resihp", "--json", str(trace)]
    assert main(argv) == 2
    assert "--scenario and --json name the same file" in capsys.readouterr().err
    assert trace.read_text() == before
    same = tmp_path / "same.png"
    assert main(["resilience", "bench", "--quick", "--json", str(same), "--plot", str(same)]) == 2
    assert "--json and --plot name the same file" in capsys.readouterr().err and not same.exists()


def test_a_model_that_does_not_fit_the_bench_job_is_refused_before_any_row(tmp_path, capsys) -> None:
    # A session-47 sweep: three qwen2.5-32b rows ran, then deepseek-v3-like raised and nothing was written
    out = tmp_path / "b.json"
    argv = ["resilience", "bench", "--quick", "--models", "qwen2.5-32b,deepseek-v3-like", "--json", str(out)]
    assert main(argv) == 2
    printed = capsys.readouterr()
    assert "--models deepseek-v3-like does not fit the bench's job (TP 4, PP 16, DP 4" in printed.err
    assert "qwen2.5-32b" not in printed.out and not out.exists()  # no row ran
