"""benchmarks/elastic_step.py's quick run: every variant times real steps on 2 ranks and trains the same."""

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
