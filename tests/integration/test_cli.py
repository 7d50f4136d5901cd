import subprocess
import sys

import pytest

from steptune.cli import AREAS, main

pytestmark = pytest.mark.timeout(120)


def test_help_lists_six_subcommands(capsys):
    with pytest.raises(SystemExit) as info:
        main(["--help"])
    assert info.value.code == 0
    out = capsys.readouterr().out
    for cmd in (*AREAS, "demo"):
        assert cmd in out


@pytest.mark.parametrize("area", [*AREAS, "demo"])
def test_area_help_works(area, capsys):
    with pytest.raises(SystemExit) as info:
        main([area, "--help"])
    assert info.value.code == 0
    assert "usage: steptune" in capsys.readouterr().out


@pytest.mark.parametrize("area", AREAS)
def test_unbuilt_area_says_so_and_fails(area, capsys):
    import importlib

    if importlib.import_module(f"steptune.{area}").__all__:
        pytest.skip(f"{area} is built")
    assert main([area]) == 2
    assert "not built yet" in capsys.readouterr().err


@pytest.mark.timeout(240)
def test_demo_writes_report(tmp_path):
    # --quick runs every demo's code path at smaller sizes; `make demo` runs the full sizes. The demos that
    # run in one process (core, memory, pipeline) are checked in the parallel pass
    # (tests/unit/core/test_demo_areas.py); these start processes.
    assert main(["demo", "--quick", "--only", "comm,kernels,resilience", "--out", str(tmp_path)]) == 0
    report = (tmp_path / "report.md").read_text()
    assert "Detectors on 2 simulated runs" in report
    assert (tmp_path / "resilience" / "false_alarms.png").stat().st_size > 0
    assert "Recovery policies, SIMULATED llama2-7b" in report
    assert (tmp_path / "resilience" / "policies_vs_oracle.png").stat().st_size > 0
    assert "Fail-stop in your own DP loop (MEASURED, 3 gloo ranks, rank 1 SIGKILLed in step 2)" in report
    assert "Adversarial candidates (softmax): verdicts" in report
    assert (tmp_path / "kernels" / "kernels_demo.json").stat().st_size > 0
    assert "comm (TIDE): zero-copy FSDP2 collectives on gloo" in report
    for name in ("comm_bench.json", "rs_staging.png"):
        assert (tmp_path / "comm" / name).stat().st_size > 0
    assert not (tmp_path / "core").exists()


def test_python_dash_m_entry():
    r = subprocess.run(
        [sys.executable, "-m", "steptune", "--version"], capture_output=True, text=True, timeout=60
    )
    assert r.returncode == 0 and r.stdout.startswith("steptune ")


def test_resilience_simulate_help_names_every_policy_and_scenario_kind(capsys):
    from steptune.resilience.bench import POLICIES
    from steptune.resilience.scenarios import KINDS

    with pytest.raises(SystemExit):
        main(["resilience", "simulate", "--help"])
    out = " ".join(capsys.readouterr().out.split()).replace("- ", "-")  # argparse wraps at hyphens
    for name in POLICIES:
        assert name in out, name
    for kind in KINDS:
        if kind.startswith("fail-slow-") and kind != "fail-slow-link":
            kind = kind.removeprefix("fail-slow-")  # written as fail-slow-weak|medium|strong
        assert kind in out, kind


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (
            ["--inject", "slow:rank=1,factor=0.5,at=3"],
            "(factor=0.5): a slowdown factor is a number from 1 to 1000",
        ),
        (["--inject", "slow:rank=1,factor=nan,at=3"], "(factor=nan): a slowdown factor"),
        (["--inject", "slow:rank=1,factor=1e300,at=3"], "a device slower than that is hung"),  # overflowed
        (["--inject", "slow:rank=1,factr=1.6,at=3"], "unknown key(s) factr; missing factor"),
        (["--inject", "slow:rank=1,factor=2,at=3;slow:rank=2,factor=2,at=3"], "repeat the flag"),
        (["--inject", "slow:rank=1,factor=2,at=-1"], "(at=-1): the first slow step"),
        (["--inject", "slow:rank=x,factor=2,at=3"], "whole numbers"),
        (["--inject", "slow:rank=1,factor=2,at=3,for=0"], "(for=0): steps, a whole number >= 1"),
        (["--inject", "slow:rank=9,factor=2,at=3"], "outside 0..3"),
        (["--inject", "slow:rank=1"], "expected slow:rank=R,factor=F,at=S"),
        (["--layout", "dp=2,pp=2", "--ranks", "3"], "needs dp*pp*tp = 4 ranks"),
        (["--ranks", "2", "--inject", "slow:rank=5,factor=2,at=1"], "outside 0..1"),  # layout was dp=4
        (["--plot", "x.png"], "add --compare"),
    ],
)
def test_resilience_run_rejects_bad_input_before_spawning(argv, message, capsys):
    assert main(["resilience", "run", "--steps", "2", *argv]) == 2
    assert message in capsys.readouterr().err


@pytest.mark.parametrize("argv", [["--steps", "0"], ["--time-scale", "-1"], ["--time-scale", "inf"]])
def test_resilience_run_rejects_bad_numbers(argv, capsys):
    with pytest.raises(SystemExit) as info:
        main(["resilience", "run", *argv])
    assert info.value.code == 2
    assert "must be" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["pipeline", "simulate", "--schedule", "/nonexistent/schedule.json"], "no such file"),
        (["comm", "calibrate", "/nonexistent/comm.json"], "no such file"),
        (["resilience", "failstop", "--kill-rank", "9"], "has ranks 0..3"),
        (["resilience", "failstop", "--kill-step", "30"], "has steps 0..19"),
        (["resilience", "failstop", "--layout", "dp=2,pp=2", "--kill-rank", "4"], "has ranks 0..3"),
        (["resilience", "failstop", "--layout", "dp=2,pp=2", "--ranks", "8"], "has 4 ranks: drop --ranks"),
        (
            ["resilience", "bench", "--quick", "--models", "llama2-7b,llama-7b", "--json", "/tmp/never.json"],
            "unknown model preset 'llama-7b'",
        ),
        (["memory", "plan", "--model", "qwen3-tiny", "--limit", "abc"], "write bytes (300MiB"),
        (
            [
                "kernels",
                "optimize",
                "--problem",
                "softmax",
                "--llm-url",
                "http://127.0.0.1:9/v1",
                "--model",
                "m",
            ],
            "Start an OpenAI-compatible server",
        ),
    ],
)
def test_bad_paths_and_ranges_are_user_errors(argv, message, capsys):
    assert main(argv) == 2
    assert message in capsys.readouterr().err


@pytest.mark.parametrize(
    "argv",
    [
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
            "-1",
        ],
        ["pipeline", "tune", "--model", "gemma-2b", "--devices", "four", "--microbatches", "8"],
        ["comm", "simulate", "--gpus", "0"],
        ["resilience", "failstop", "--ranks", "0"],
        ["resilience", "bench", "--quick", "--workers", "0", "--json", "x.json"],
        ["memory", "bench", "--model", "qwen3-tiny", "--repeats", "0"],
        ["kernels", "bench", "--lane", "sim", "--seeds", "0"],
    ],
)
def test_bad_numbers_fail_at_parse_time(argv, capsys):
    with pytest.raises(SystemExit) as info:
        main(argv)
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert "must be" in err or "expected a whole number" in err


def test_every_verb_help_says_what_the_verb_does():
    # Found in review: pipeline tune/simulate/bench and resilience detect/trace/simulate/bench/sweep printed
    # usage and options only.
    import argparse

    from steptune.cli import build_parser

    def verbs(parser, path):
        subs = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
        if not subs:
            yield path, parser
        for action in subs:
            for name, child in action.choices.items():
                yield from verbs(child, [*path, name])

    found = list(verbs(build_parser(), []))
    assert len(found) > 20
    assert [" ".join(p) for p, parser in found if not parser.description] == []
