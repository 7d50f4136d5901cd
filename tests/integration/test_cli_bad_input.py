"""Mistakes on the command line end at once with exit 2 and a message that says what to change, before
any measurement runs or any rank is spawned (found by an audit of every verb, 2026-12-01)."""

import json

import pytest
import torch

from steptune.cli import main

pytestmark = pytest.mark.timeout(120)


def _refused(argv, capsys):
    """Exit code 2 (argparse's SystemExit or main's return) and the error text."""
    try:
        rc = main(argv)
    except SystemExit as exc:
        rc = exc.code
    return rc, capsys.readouterr().err


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["resilience", "simulate", "--scenario", "fail-stop", "--duration", "nan"], "> 0 and finite"),
        (["resilience", "detect", "--factor", "0.5"], "must be a slowdown > 1"),
        (["resilience", "detect", "--lengths", "nope"], "invalid choice"),
        (["resilience", "run", "--inject", "slow:rank=1,factor=2,at=100", "--steps", "4"], "never comes"),
        (["resilience", "failstop", "--ranks", "1", "--kill-rank", "0", "--kill-step", "1", "--steps", "2"],
         "--ranks must be >= 2"),
        (["resilience", "failstop", "--layout", "dp=1,pp=2", "--kill-rank", "0", "--kill-step", "1",
          "--steps", "2"], "needs dp >= 2"),
        (["memory", "plan", "--model", "llama-tiny", "--limit", "1.5"], "a fraction must lie in (0, 1]"),
        (["memory", "plan", "--model", "llama-tiny", "--limit", "inf"], "positive and finite"),
        (["memory", "plan", "--model", "llama-tiny", "--limit", "0.5", "--seq", "-4"], "must be >= 1"),
        (["kernels", "eval", "--problem", "relu", "--candidate", "x.py", "--rounds", "0"], "must be >= 1"),
        (["kernels", "bench", "--problems", "relu"], "no fast and slow C examples to compare; choose from"),
        (["pipeline", "tune", "--model", "gemma-2b", "--devices", "30", "--microbatches", "8",
          "--time-budget", "1"], "use fewer devices"),
    ],
)  # fmt: skip
def test_bad_numbers_and_names_are_refused(argv, message, capsys, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    rc, err = _refused(argv, capsys)
    assert rc == 2 and message in err, err


@pytest.mark.parametrize(
    "argv",
    [
        ["memory", "compare", "--model", "qwen3-tiny", "--json", "{file}/x.json"],
        ["memory", "pareto", "--model", "llama-tiny", "--out", "{dir}"],
        ["pipeline", "tune", "--model", "gemma-2b", "--out", "{file}"],
        ["kernels", "eval", "--problem", "relu", "--candidate", "x.py", "--json", "{dir}"],
        ["resilience", "bench", "--quick", "--json", "{file}/x.json"],
        ["comm", "simulate", "--json", "{dir}"],
    ],
)
def test_an_unwritable_output_path_is_refused_before_the_work(argv, capsys, tmp_path):
    afile = tmp_path / "afile"
    afile.write_text("")
    argv = [a.format(file=afile, dir=tmp_path) for a in argv]
    rc, err = _refused(argv, capsys)
    assert rc == 2 and ("is a directory" in err or "is a file, not a folder" in err), err


def test_pipeline_run_checks_model_and_schedule_before_spawning_ranks(tmp_path, capsys):
    dead = {"name": "dead", "num_stages": 2, "num_microbatches": 2, "placement": [0, 1], "partition": [9, 11],
            "orders": [["0F0", "0B1", "0F1", "0B0"], ["1F0", "1F1", "1B1", "1B0"]]}  # fmt: skip
    path = tmp_path / "dead.json"
    path.write_text(json.dumps(dead))
    run = ["pipeline", "run", "--schedule", str(path), "--ranks", "2"]
    rc, err = _refused([*run, "--model", "nope"], capsys)
    assert rc == 2 and "unknown model 'nope'" in err, err
    rc, err = _refused(run, capsys)
    assert rc == 2 and "schedule deadlocks" in err, err


def test_comm_calibration_must_be_finite_numbers(tmp_path, capsys):
    for text, message in (
        ('{"fit": {"copy_out_bytes_per_s": NaN}}', "is not a positive number"),
        ('{"fit": {"copy_out_bytes_per_s": true}}', "is not a positive number"),
        ("[1]", "no 'fit' section"),
        ("{bad", "not a JSON file"),
    ):
        path = tmp_path / "fit.json"
        path.write_text(text)
        rc, err = _refused(["comm", "calibrate", str(path)], capsys)
        assert rc == 2 and message in err, (text, err)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal on a machine without CUDA")
def test_kernels_eval_on_cuda_without_a_gpu_is_a_usage_error(tmp_path, capsys):
    cand = tmp_path / "k.py"
    cand.write_text("")
    rc, err = _refused(["kernels", "eval", "--problem", "relu", "--candidate", str(cand), "--device", "cuda"],
                       capsys)  # fmt: skip
    assert rc == 2 and "sees no CUDA device" in err, err


def test_pipeline_schedules_of_the_wrong_shape_are_named(tmp_path, capsys):
    for content, message in (
        (b"[1, 2]", "schedule JSON must be an object, got a list"),
        (b'{"name": "x", "num_stages": "eight", "num_microbatches": 2, "placement": [0], "orders": [[]]}',
         "num_stages must be a whole number"),
        (b"\x89PNG\r\n\x1a\n\xff\xfe", "not a UTF-8 text schedule (byte 0x89 at offset 0)"),
    ):  # fmt: skip
        path = tmp_path / "schedule.json"
        path.write_bytes(content)
        argv = ["pipeline", "simulate", "--schedule", str(path), "--out", str(tmp_path / "o")]
        rc, err = _refused(argv, capsys)
        assert rc == 2 and message in err, (content, err)


def test_files_that_are_not_utf8_text_are_named(tmp_path, capsys):
    # Before: "'utf-8' codec can't decode byte 0xff in position 57", without the file's name.
    scenario = tmp_path / "s.csv"
    scenario.write_bytes(b"kind,device,start_s,duration_s,factor\nfail-stop,3,10,100,\xff\n")
    rc, err = _refused(["resilience", "simulate", "--scenario", str(scenario), "--duration", "100"], capsys)
    assert rc == 2 and f"{scenario}: not a UTF-8 text scenario CSV (byte 0xff at offset 57)" in err, err
    cand = tmp_path / "k.py"
    cand.write_bytes(b"import torch\n# \xfe\n")
    rc, err = _refused(["kernels", "eval", "--problem", "relu", "--candidate", str(cand)], capsys)
    assert rc == 2 and f"{cand}: not a UTF-8 text kernel candidate (byte 0xfe" in err, err
    prob = tmp_path / "p.py"
    prob.write_bytes(b"import torch\n# \xff\n")
    rc, err = _refused(["kernels", "eval", "--problem", str(prob), "--candidate", str(cand)], capsys)
    assert rc == 2 and f"{prob}: not a UTF-8 text problem file (byte 0xff" in err, err
