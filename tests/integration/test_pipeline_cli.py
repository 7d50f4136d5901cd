import json

import pytest

from steptune.cli import main
from steptune.pipeline.anchors import zb_h1
from steptune.pipeline.bench import run_bench, suite

pytestmark = pytest.mark.timeout(180)


def test_tune_writes_schedule_trace_and_gantt(tmp_path, capsys):
    out = tmp_path / "t"
    assert (
        main(
            [
                "pipeline",
                "tune",
                "--model",
                "gemma-2b",
                "--devices",
                "4",
                "--microbatches",
                "8",
                "--time-budget",
                "1",
                "--out",
                str(out),
            ]
        )
        == 0
    )
    printed = capsys.readouterr().out
    assert "TUNED" in printed and "zb_h1/balanced" in printed
    assert "MEMORY-BOUND" not in printed and "no anchor fits" not in printed
    for name in ("schedule.csv", "schedule.json", "trace.json", "gantt.png", "comparison.json"):
        assert (out / name).stat().st_size > 0
    # the written schedule simulates again, with the model's costs
    assert (
        main(
            [
                "pipeline",
                "simulate",
                "--schedule",
                str(out / "schedule.json"),
                "--model",
                "gemma-2b",
                "--out",
                str(tmp_path / "s"),
            ]
        )
        == 0
    )
    assert "makespan" in capsys.readouterr().out
    # ... and for another model it says to tune one (it said "partition ... must cover all 34 layers")
    argv = ["pipeline", "simulate", "--schedule", str(out / "schedule.json"), "--model", "llama2-7b"]
    assert main([*argv, "--out", str(tmp_path / "s2")]) == 2
    assert "tune a schedule for llama2-7b" in capsys.readouterr().err


def test_tune_calls_out_a_step_the_memory_cap_sets(tmp_path, capsys):
    # llama2-70b on 8 H100s: no anchor fits 80 GB, and the schedule that does keeps so few microbatches
    # in flight that the step is ~5.8x the lower bound; without the cap the tuner reaches ~1.1x
    argv = ["pipeline", "tune", "--model", "llama2-70b", "--devices", "8", "--microbatches", "16"]
    argv += ["--time-budget", "1", "--out", str(tmp_path / "t")]
    assert main(argv) == 0
    printed = capsys.readouterr().out
    assert "MEMORY-BOUND" in printed and "no anchor fits the 80 GB memory cap" in printed
    notes = json.loads((tmp_path / "t" / "comparison.json").read_text())
    assert any("MEMORY-BOUND" in n for n in notes["notes"])
    assert main([*argv, "--memory-cap", "1000GB"]) == 0
    printed = capsys.readouterr().out
    assert "MEMORY-BOUND" not in printed and "no anchor fits" not in printed
    # a long bubble from M < P, far under the cap, is not blamed on memory (found in review)
    few = ["pipeline", "tune", "--model", "gemma-2b", "--devices", "8", "--microbatches", "2"]
    assert main([*few, "--memory-cap", "10TB", "--time-budget", "1", "--out", str(tmp_path / "f")]) == 0
    assert "MEMORY-BOUND" not in capsys.readouterr().out
    # ... nor one where no anchor could be built at all (more stages than gemma-2b's 20 layers; a sweep)
    wide = ["pipeline", "tune", "--model", "gemma-2b", "--devices", "24", "--microbatches", "4"]
    assert main([*wide, "--memory-cap", "10TB", "--time-budget", "1", "--out", str(tmp_path / "w")]) == 0
    assert "MEMORY-BOUND" not in capsys.readouterr().out


def test_simulate_a_torch_csv_with_unit_costs(tmp_path, capsys):
    path = zb_h1(4, 8).save(tmp_path / "zb.csv")
    assert main(["pipeline", "simulate", "--schedule", str(path), "--out", str(tmp_path / "o")]) == 0
    assert "makespan 27" in capsys.readouterr().out  # 3 M + (P - 1) with F = I = W = 1


def test_simulate_rejects_a_malformed_schedule(tmp_path, capsys):
    bad = tmp_path / "bad.csv"
    bad.write_text("0F0,0X1\n")
    assert main(["pipeline", "simulate", "--schedule", str(bad), "--out", str(tmp_path / "o")]) == 2
    assert "bad action '0X1'" in capsys.readouterr().err


def test_quick_bench_json_shape(tmp_path):
    result = run_bench(suite("quick")[:2], time_budget=1.0)
    row = result["rows"][0]
    for key in (
        "config",
        "heterogeneous",
        "num_devices",
        "num_microbatches",
        "anchors",
        "best_anchor",
        "tuned",
        "lower_bound",
        "speedup_vs_best_anchor",
        "tuner_seconds",
        "memory_ok",
    ):
        assert key in row
    assert row["speedup_vs_best_anchor"] >= 1.0 - 1e-9
    assert row["tuned"] >= row["lower_bound"]
    assert result["geomean_speedup_heterogeneous"] >= 1.0
    json.dumps(result)


@pytest.mark.timeout(120)
def test_run_on_one_rank_skips_the_ping_pong_instead_of_hanging(tmp_path, capsys):
    # A one-device schedule on a sleep model: the latency calibration used to send to rank 1, which
    # does not exist, and hang until the pool's timeout.
    path = tmp_path / "one.json"
    path.write_text(json.dumps({"name": "one", "num_stages": 1, "num_microbatches": 1, "placement": [0],
                                "partition": [20], "orders": [["0F0", "0B0"]], "meta": {}}))  # fmt: skip
    args = ["pipeline", "run", "--schedule", str(path), "--model", "sleep:gemma-2b", "--ranks", "1"]
    assert main([*args, "--repeats", "1", "--json", str(tmp_path / "r.json")]) == 0
    assert "measured / simulated" in capsys.readouterr().out


def test_a_tuned_schedule_names_its_model_when_simulated_with_another(tmp_path, capsys):
    # Found in a sweep (2026-12-05): nothing recorded the model, so another model of the same unit count was
    # simulated silently and the "it was tuned for" hint could never show
    tuned = tmp_path / "t"
    argv = ["pipeline", "tune", "--model", "llama2-7b", "--devices", "2", "--microbatches", "4"]
    assert main([*argv, "--time-budget", "0", "--out", str(tuned)]) == 0
    meta = json.loads((tuned / "schedule.json").read_text())["meta"]
    assert (meta["model"], meta["memory_cap"]) == ("llama2-7b", 80e9)  # the cap as resolved: the device's
    capsys.readouterr()
    sim = ["pipeline", "simulate", "--schedule", str(tuned / "schedule.json"), "--out", str(tmp_path / "s")]
    assert main([*sim, "--model", "llama3.1-8b"]) == 0
    assert "was tuned for llama2-7b; simulated with llama3.1-8b's costs" in capsys.readouterr().out
    assert main([*sim, "--model", "llama2-7b"]) == 0
    assert "was tuned" not in capsys.readouterr().out
    # ... and its cluster, efficiency and memory cap: simulate's defaults priced another setting silently
    argv += ["--cluster", "dgx-h200", "--efficiency", "0.4", "--memory-cap", "60GB"]
    assert main([*argv, "--time-budget", "0", "--out", str(tuned)]) == 0
    meta = json.loads((tuned / "schedule.json").read_text())["meta"]
    assert (meta["cluster"], meta["efficiency"], meta["memory_cap"]) == ("dgx-h200", 0.4, 60e9)
    capsys.readouterr()
    assert main([*sim, "--model", "llama2-7b"]) == 0
    out = " ".join(capsys.readouterr().out.split())  # the notes wrap at the terminal's width
    assert "was tuned with --cluster dgx-h200, simulated with --cluster dgx-h100" in out
    assert "was tuned with --efficiency 0.4, simulated with --efficiency 0.5" in out
    assert "was tuned with --memory-cap 60GB, simulated with --memory-cap 80GB" in out  # the resolved caps
    assert main(sim) == 0  # no --model: unit costs, said (a session-48 sweep found no note)
    out = " ".join(capsys.readouterr().out.split())
    assert "was tuned for llama2-7b; simulated with unit costs" in out
    same = ["--cluster", "dgx-h200", "--efficiency", "0.4", "--memory-cap", "60e9"]
    assert main([*sim, "--model", "llama2-7b", *same]) == 0
    assert "was tuned" not in capsys.readouterr().out


def test_outputs_over_the_schedule_they_read_are_refused(tmp_path, capsys):
    # A sweep: simulate --out rewrote the tuner's schedule.json without its partition (and a torch CSV
    # without its SEND/RECV actions); run --json over --schedule replaced the schedule with the report
    sched = zb_h1(2, 4, partition=(9, 9))
    path = sched.save(tmp_path / "schedule.json")
    before = path.read_text()
    assert main(["pipeline", "simulate", "--schedule", str(path), "--out", str(tmp_path)]) == 2
    assert "would write over the --schedule it reads" in capsys.readouterr().err
    assert main(["pipeline", "run", "--schedule", str(path), "--ranks", "2", "--json", str(path)]) == 2
    assert "--schedule and --json name the same file" in capsys.readouterr().err
    assert path.read_text() == before
