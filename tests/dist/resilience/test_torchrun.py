"""The runtime in a plain torchrun loop (examples/resilience_torchrun.py): the default process group,
torchrun's own rendezvous, a slow rank detected and its share of microbatches cut."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.dist, pytest.mark.timeout(180)]

EXAMPLE = Path(__file__).resolve().parents[3] / "examples" / "resilience_torchrun.py"


def test_runtime_under_torchrun(tmp_path):
    out = tmp_path / "torchrun.json"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
           str(EXAMPLE), "--steps", "18", "--slow-rank", "1", "--factor", "2", "--at", "12",
           "--json", str(out)]  # fmt: skip
    env = {**os.environ, "GLOO_SOCKET_IFNAME": "lo", "OMP_NUM_THREADS": "1"}
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=150, env=env)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    steps = json.loads(out.read_text())["steps"]
    alarms = [(s["step"], a) for s in steps for a in s["alarms"]]
    assert alarms and all(unit == 1 for _, (unit, _) in alarms), steps
    step, (_, slowdown) = alarms[0]
    assert 12 <= step <= 14 and abs(slowdown / 2.0 - 1) < 0.15, alarms
    assert steps[-1]["speeds"][1] < 0.6, steps[-1]  # the next plans give rank 1 about half the work
    assert "detected" in r.stdout


@pytest.mark.parametrize(
    ("argv", "env", "says"),
    [(["--steps", "0"], {"RANK": "0", "WORLD_SIZE": "2"}, "--steps: must be >= 1"),
     (["--slow-rank", "7"], {"RANK": "0", "WORLD_SIZE": "2"}, "--slow-rank 7: the ranks are 0..1"),
     (["--slow-rank", "1", "--factor", "0.5"], {"RANK": "0", "WORLD_SIZE": "2"}, "--factor=0.5: a slowdown"),
     (["--json", "/"], {"RANK": "0", "WORLD_SIZE": "2"}, "is a directory"),
     ([], {}, "run it under torchrun")],
)  # fmt: skip
def test_the_example_refuses_bad_arguments_before_it_starts(argv, env, says, monkeypatch, capsys):
    # Found in review: --steps 0 was a ZeroDivisionError, --json DIR an IsADirectoryError after the whole
    # run, --slow-rank 7 a traceback from every rank, and a plain `python` run a KeyError-like traceback.
    # In-process (a subprocess spent 2 s importing torch): a traceback is an exception other than
    # SystemExit here, and forming the process group fails the test.
    import runpy

    import torch.distributed

    def no_group(*args, **kwargs):
        raise AssertionError("the example formed its process group before refusing its arguments")

    monkeypatch.setattr(torch.distributed, "init_process_group", no_group)
    for name in ("RANK", "WORLD_SIZE"):
        monkeypatch.delenv(name, raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    monkeypatch.setattr(sys, "argv", [str(EXAMPLE), *argv])
    with pytest.raises(SystemExit) as stop:
        runpy.run_path(str(EXAMPLE), run_name="__main__")
    err = capsys.readouterr().err
    assert stop.value.code == 2 and says in err and "Traceback" not in err, err[-2000:]
