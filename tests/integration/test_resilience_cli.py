import json

import pytest

from steptune.cli import main

pytestmark = pytest.mark.timeout(180)


def test_detect_scores_detectors(tmp_path, capsys):
    out = tmp_path / "d.json"
    assert main(["resilience", "detect", "--runs", "4", "--steps", "50", "--json", str(out)]) == 0
    scores = json.loads(out.read_text())["detector"]
    assert scores["resihp"]["detection_rate"] == 1.0
    assert scores["fixed-threshold"]["false_alarms_per_run"] > scores["resihp"]["false_alarms_per_run"]
    assert "SIMULATED" in capsys.readouterr().out


def test_trace_replay(capsys):
    from steptune.resilience.trace import default_trace_path

    if not default_trace_path().exists():
        pytest.skip("the shared straggler trace is not beside the checkout (STEPTUNE_STRAGGLER_TRACE)")
    assert main(["resilience", "trace"]) == 0
    assert "fixed-threshold" in capsys.readouterr().out


def test_simulate_one_policy_and_bad_input(tmp_path, capsys):
    out = tmp_path / "s.json"
    argv = ["resilience", "simulate", "--scenario", "fail-stop", "--policy", "resihp", "--model", "llama2-7b"]
    assert main([*argv, "--duration", "1800", "--json", str(out)]) == 0
    saved = json.loads(out.read_text())
    res = saved["policies"]["resihp"]
    assert res["tokens_per_s"] > 0
    # the failures come back as events (they were repr strings, without the run's duration or seed)
    from steptune.resilience.scenarios import generate
    from steptune.resilience.sim import FailureEvent

    assert (saved["duration_s"], saved["seed"]) == (1800.0, 0)
    inf = float("inf")  # strict JSON: a failure without an end (every fail-stop) is null
    back = tuple(FailureEvent(**{**f, "duration_s": f["duration_s"] or inf}) for f in saved["failures"])
    assert back == generate("fail-stop", num_devices=256, duration_s=1800.0, seed=0) and back
    assert "SIMULATED" in capsys.readouterr().out
    assert main(["resilience", "simulate", "--scenario", "nope"]) == 2
    assert "neither a CSV file" in capsys.readouterr().err
    assert main(["resilience", "simulate", "--policy", "bamboo", "--duration", "60"]) == 2
    assert "unknown policy" in capsys.readouterr().err
    bad = tmp_path / "t.csv"
    bad.write_text("kind,device,start_s,duration_s,factor\nfail-stop,9999,1,inf,1\n")
    assert main(["resilience", "simulate", "--scenario", str(bad)]) == 2
    assert "not among the job's 256 devices" in capsys.readouterr().err
    # a bad cell names its column; a slowdown where a speed belongs says which factor to write
    bad.write_text("kind,device,start_s,duration_s,factor\nfail-slow,3,1,inf,x\nfail-slow,3,1,inf,1.6\n")
    assert main(["resilience", "simulate", "--scenario", str(bad)]) == 2
    assert ":2: column factor: expected a speed in (0, 1]" in capsys.readouterr().err
    bad.write_text("kind,device,start_s,duration_s,factor\nfail-slow,3,1,inf,1.6\n")
    assert main(["resilience", "simulate", "--scenario", str(bad)]) == 2
    assert "a 1.6x slowdown is factor 0.625" in capsys.readouterr().err
    # --seed with a CSV and mean lengths does nothing: said (it was silent)
    bad.write_text("kind,device,start_s,duration_s,factor\nfail-slow,3,1,inf,0.5\n")
    assert main(["resilience", "simulate", "--scenario", str(bad), "--duration", "60", "--seed", "5"]) == 0
    assert "--seed has no effect with a CSV scenario and --lengths mean" in capsys.readouterr().err
    assert main(["resilience", "simulate", "--scenario", str(tmp_path / "missing.csv")]) == 2
    assert "missing.csv': no such file" in capsys.readouterr().err


def test_an_interrupted_bench_stops_its_workers_at_once():
    # Found in a sweep (2026-12-05): with --workers 2 the pool's exit ran every queued row first (still
    # running 158 s after SIGTERM). Four oracle rows take ~10 s each here; Ctrl-C comes after 1 s.
    import multiprocessing
    import os
    import signal
    import threading
    import time

    from steptune.resilience import bench

    _, det = bench.measure_detectors(2)
    tasks = [
        bench.RowTask(model="llama2-7b", kind="fail-stop", seed=s, duration_s=7200.0, det=det,
                      policies=("oracle",))
        for s in range(4)
    ]  # fmt: skip

    def interrupted(signum, frame):  # SIGUSR1 as Ctrl-C, leaving SIGINT alone
        raise KeyboardInterrupt

    previous = signal.signal(signal.SIGUSR1, interrupted)
    timer = threading.Timer(1.0, os.kill, (os.getpid(), signal.SIGUSR1))
    t0 = time.perf_counter()
    timer.start()
    try:
        with pytest.raises(KeyboardInterrupt):
            bench.run_rows(tasks, workers=2)
        elapsed = time.perf_counter() - t0
    finally:
        timer.cancel()
        signal.signal(signal.SIGUSR1, previous)
    assert elapsed < 5.0, f"the interrupt took {elapsed:.1f} s to land"
    deadline = time.monotonic() + 5
    while multiprocessing.active_children() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not multiprocessing.active_children()
