"""`steptune kernels` end to end: eval's printout, JSON and exit status; one replayed LLM iteration whose
drafts are evaluated while the stream still runs."""

import asyncio
import json
import subprocess
import sys
from pathlib import Path

import pytest

from steptune.kernels.demo import _iteration
from steptune.kernels.pool import EvalPool, PoolConfig

pytestmark = [pytest.mark.timeout(240), pytest.mark.slow]

EXAMPLES = Path(__file__).resolve().parents[2] / "src/steptune/kernels/examples"


def _cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "steptune", "kernels", *args], capture_output=True, text=True, timeout=200
    )


def test_eval_prints_verdict_and_writes_json(tmp_path, capsys):
    from steptune.cli import main

    out = tmp_path / "r.json"
    proc = _cli(
        "eval", "--problem", "rmsnorm", "--candidate", str(EXAMPLES / "rmsnorm/c_fast.py"), "--json", str(out)
    )
    assert proc.returncode == 0, proc.stderr
    assert "verdict    correct" in proc.stdout and "speedup" in proc.stdout
    res = json.loads(out.read_text())
    assert {"verdict", "reason", "speedup", "ref_time_s", "candidate_time_s"} <= set(res)
    assert res["verdict"] == "correct" and res["speedup"] > 1.0
    # the unseen draws' speedup is printed, and the JSON says how many trials validated it (a session-48
    # sweep read the profiling job's 1 as --trials ignored)
    assert "unseen " in proc.stdout and "draws not timed before" in proc.stdout
    assert res["validation_trials"] == 5
    capsys.readouterr()

    def in_process(*args: str):  # `python -m steptune` exits with main's return value, as above
        return main(["kernels", *args]), capsys.readouterr()

    # The rest in-process: a subprocess spent 2-3 s importing torch for each.
    code, bad = in_process(
        "eval", "--problem", "softmax", "--candidate", str(EXAMPLES / "adversarial/wrong_shape.py")
    )
    assert code == 1 and "verdict    incorrect" in bad.out and "shape" in bad.out, bad
    code, missing = in_process(
        "eval", "--problem", "nope", "--candidate", str(EXAMPLES / "rmsnorm/c_fast.py")
    )
    assert code == 2 and "unknown problem 'nope'" in missing.err, missing
    code, listing = in_process("problems")
    assert code == 0 and "softmax" in listing.out and "rmsnorm" in listing.out, listing
    # bench --problems takes commas as the other verbs' list flags do ("softmax,nope" was one unknown name)
    code, listed = in_process("bench", "--problems", "softmax,nope", "--repeats", "1")
    assert code == 2 and "--problems nope: no fast and slow C examples" in listed.err, listed


def test_replayed_llm_iteration_feeds_the_pool(tmp_path):
    with EvalPool(PoolConfig(num_workers=2, timeout_s=30)) as pool:
        rows = asyncio.run(_iteration(pool, tmp_path))
    origins = [r["origin"] for r in rows]
    assert origins == ["draft in reasoning", "fork from reasoning prefix", "final answer"]
    assert all(r["verdict"] == "correct" for r in rows)
    assert rows[0]["submitted_at_s"] < rows[0]["stream_s"] - 0.5  # evaluated while the stream still ran
    assert rows[2]["speedup"] > 1.0 > rows[0]["speedup"]  # final C kernel fast, first draft slow
    assert (tmp_path / "recorded_trace.jsonl").stat().st_size > 0


@pytest.mark.parametrize("sig", ["SIGINT", "SIGTERM"])
def test_an_interrupted_eval_ends_its_running_candidate_at_once_and_leaves_nothing(sig, tmp_path):
    # Found in review: Ctrl-C waited for the candidate's timeout (26.9 s of 30) and SIGTERM left the pool's
    # scratch folder behind. The eval gets a temp folder of its own (TMPDIR): a job folder of any other
    # process in the shared one ended the wait for "the candidate started" early.
    import glob
    import os
    import signal
    import time

    pattern = str(tmp_path / "steptune-eval-*")
    cmd = [sys.executable, "-m", "steptune", "kernels", "eval", "--problem", "relu",
           "--candidate", str(EXAMPLES / "adversarial/infinite_loop.py"), "--timeout", "60"]  # fmt: skip
    env = {**os.environ, "TMPDIR": str(tmp_path)}

    def as_from_a_shell() -> None:
        # In the full serial pass (3 of 3 runs on 2026-12-05, never alone) the eval never saw Ctrl-C, as when
        # it inherits SIGINT blocked or ignored; the cause is not found. A shell starts a command with both
        # reset, as here.
        signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT, signal.SIGTERM})
        signal.signal(signal.SIGINT, signal.SIG_DFL)

    proc = subprocess.Popen(
        cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env=env, preexec_fn=as_from_a_shell
    )
    try:
        deadline = time.monotonic() + 60
        while not glob.glob(pattern + "/job-*"):
            assert proc.poll() is None and time.monotonic() < deadline, "the candidate never started"
            time.sleep(0.2)
        time.sleep(1.0)  # the candidate is looping now
        t0 = time.monotonic()
        proc.send_signal(getattr(signal, sig))
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            err = proc.communicate()[1][-3000:]
            raise AssertionError(f"{sig} did not end the eval in 30 s: {err}") from None
    finally:
        if proc.poll() is None:
            proc.kill()
    assert time.monotonic() - t0 < 10, "waited for the candidate instead of ending it"
    assert proc.returncode == (130 if sig == "SIGINT" else 143), proc.stderr.read() if proc.stderr else ""
    time.sleep(0.5)
    assert not glob.glob(pattern), "a scratch folder was left behind"
