"""`steptune comm bench`: JSON in the issue's shape, tables and the staging plot (small settings)."""

import json

import pytest

import steptune.comm.bench as bench
from steptune.cli import main

pytestmark = pytest.mark.timeout(300)


def test_comm_bench_writes_json_and_plot(tmp_path, monkeypatch, capsys):
    real_fsdp, real_rs = bench.fsdp_bench, bench.rs_staging_bench
    monkeypatch.setattr(bench, "fsdp_bench", lambda *a, **k: real_fsdp((2,), ("mlp",), steps=2))
    monkeypatch.setattr(
        bench, "rs_staging_bench", lambda *a, **k: real_rs((2, 3), rows_per_rank=8, cols=8, reps=1)
    )
    out = tmp_path / "comm.json"
    assert main(["comm", "bench", "--quick", "--json", str(out)]) == 0
    gloo = json.loads(out.read_text())["gloo"]
    assert set(gloo) >= {
        "max_param_rel_diff",
        "layout_bytes",
        "wire_bytes",
        "rs_staging_bytes",
        "step_time_s",
    }
    assert gloo["bitwise_equal"] and gloo["max_param_rel_diff"] == 0.0
    assert 5 * gloo["layout_bytes"]["tide"] <= gloo["layout_bytes"]["stock"]
    assert gloo["wire_bytes"]["tide"]["reduce_scatter"] == {
        "bfloat16": gloo["runs"][0]["wire_bytes"]["tide"]["reduce_scatter"]["bfloat16"]
    }
    assert set(gloo["rs_staging_bytes"]["stock"]) == {"2", "3"}
    sim = json.loads(out.read_text())["sim"]
    assert {r["system"] for r in sim} == {"stock", "symmmem", "tide"} and all(r["simulated"] for r in sim)
    assert set(sim[0]) >= {
        "model",
        "gpus",
        "system",
        "step_time_s",
        "layout_share",
        "rs_sm_time_s",
        "peak_buffer_bytes",
    }
    assert out.with_suffix(".staging.png").stat().st_size > 0
    text = capsys.readouterr().out
    assert "wrote:" in text and "FSDP2 on gloo" in text


def test_comm_bench_needs_a_json_path(capsys):
    with pytest.raises(SystemExit):
        main(["comm", "bench"])
    assert "--json" in capsys.readouterr().err


def test_comm_simulate_prints_every_system_and_writes_json(tmp_path, capsys):
    out = tmp_path / "sim.json"
    assert main(["comm", "simulate", "--model", "llama3.1-70b", "--gpus", "64", "--json", str(out)]) == 0
    text = capsys.readouterr().out
    assert "SIMULATED" in text and all(s in text for s in ("stock", "symm", "tide"))
    data = json.loads(out.read_text())
    assert data["simulated"] is True and set(data["systems"]) == {"stock", "symmmem", "tide"}
    assert data["systems"]["tide"]["step_time_s"] < data["systems"]["stock"]["step_time_s"]
    assert "simulated with" not in text
    # more GPUs than the preset has: the node type is repeated, and the table says so (it did not)
    assert main(["comm", "simulate", "--model", "llama3.1-70b", "--gpus", "128"]) == 0
    assert "dgx-h100 has 64 GPUs as a preset; simulated with 16 nodes of 8" in capsys.readouterr().out


def test_comm_simulate_bad_preset_says_which_exist(capsys):
    assert main(["comm", "simulate", "--model", "gpt-9"]) != 0
    assert "gpt-9" in capsys.readouterr().err
