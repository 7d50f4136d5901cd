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
