"""The memory GPU script's CPU dry run: the H200 code path on tiny bf16 configs."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[3] / "benchmarks" / "gpu" / "memory.py"


@pytest.mark.timeout(240)
def test_dry_run_measures_every_anchor_and_planned_point_on_both_models(tmp_path: Path) -> None:
    spec = importlib.util.spec_from_file_location("gpu_memory", SCRIPT)
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod
    spec.loader.exec_module(mod)
    out = tmp_path / "m.json"
    assert mod.main(["--dry-run", "--json", str(out)]) == 0
    res = json.loads(out.read_text())
    assert res["dry_run"] is True
    assert set(res["models"]) == {"qwen3-8b-like", "qwen3-30b-a3b-like"}
    for model in res["models"].values():
        rows = model["policies"]
        fixed = {
            "no_ac",
            "full_ac",
            "full_ac_no_early_stop",
            "torchtitan_sac",
            "hf_every_2",
            "megatron_core_attn",
        }
        assert fixed | {"tapesac_replay", "torch_auto_sac@0.10", "torch_auto_sac@0.50"} <= set(rows)
        planned = [r for name, r in rows.items() if name.startswith("tapesac_plan@")]
        assert planned and all(r["predicted_peak_bytes"] > 0 for r in planned)
        assert all(0 <= r["predicted_kept_bytes"] <= r["predicted_peak_bytes"] for r in planned)
        assert all(r["grad_max_abs_diff"] == 0.0 for r in rows.values())  # bf16, deterministic CPU kernels
        assert all(r["step_time_s"] > 0 for r in rows.values())
