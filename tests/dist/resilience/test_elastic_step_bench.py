"""The elastic benchmarks' quick runs: elastic_step.py (every variant times real steps on 2 ranks and
trains the same) and elastic_recovery.py (a split sync recovered with peer state and with snapshots)."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.dist, pytest.mark.timeout(180)]

SCRIPT = Path(__file__).resolve().parents[3] / "benchmarks" / "elastic_step.py"


def test_quick_run_times_every_variant_and_they_train_the_same(tmp_path):
    out = tmp_path / "es.json"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(SCRIPT.parents[1] / "src")}
    r = subprocess.run([sys.executable, str(SCRIPT), "--quick", "--json", str(out)],
                       capture_output=True, text=True, timeout=150, env=env)  # fmt: skip
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    res = json.loads(out.read_text())
    assert set(res["median_step_s"]) == {"ddp", "packed", "ctx.ddp", "ctx.sync", "ctx.ddp/snapshot",
                                         "ctx.sync/snapshot"}  # fmt: skip
    held = res["held_bytes"]  # two deep copies of model + AdamW state against nothing but buffers (none)
    assert held["ctx.sync/snapshot"] >= 2 * 3 * 4 * res["config"]["params"] and held["ctx.sync"] == 0
    assert all(len(xs) == 2 and all(x > 0 for x in xs) for xs in res["step_s"].values())
    assert res["ratio_to_ddp"]["ddp"] == 1.0
    assert res["max_param_diff_ddp_vs_ctx_sync"] < 1e-6  # DDP's mean x world is ctx.sync's sum
    assert "of ddp" in r.stdout


def test_recovery_benchmark_quick_run_recovers_in_both_modes_on_the_failure_free_losses(tmp_path):
    out = tmp_path / "rec.json"
    script = SCRIPT.with_name("elastic_recovery.py")
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(SCRIPT.parents[1] / "src")}
    r = subprocess.run([sys.executable, str(script), "--quick", "--ranks", "3", "--json", str(out)],
                       capture_output=True, text=True, timeout=150, env=env)  # fmt: skip
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    res = json.loads(out.read_text())
    (peer,), (snap,) = res["runs"]["peer"], res["runs"]["snapshot"]
    assert peer["survivors"] == snap["survivors"] == [0, 2], res
    assert (peer["resume_steps"], peer["state_from"]) == ([3], [0]), peer  # rank 2 took rank 0's state
    assert (snap["resume_steps"], snap["state_from"]) == ([2], [None]), snap  # rank 0 rolled back
    assert max(res["max_loss_rel_diff"].values()) <= 1e-5 and peer["recovery_s"] > 0, res
