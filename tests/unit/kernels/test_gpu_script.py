"""The kernels GPU script's CPU dry run: the same pool code path, with C candidates for CUDA/Triton ones."""

import importlib.util
import json
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[3] / "benchmarks" / "gpu" / "kernels.py"


@pytest.mark.timeout(240)
@pytest.mark.slow
def test_dry_run_gets_every_expected_verdict_and_profiles(tmp_path: Path) -> None:
    spec = importlib.util.spec_from_file_location("gpu_kernels", SCRIPT)
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod
    spec.loader.exec_module(mod)
    out = tmp_path / "k.json"
    assert mod.main(["--dry-run", "--repeats", "2", "--json", str(out)]) == 0
    res = json.loads(out.read_text())
    assert res["dry_run"] is True
    assert res["all_expected"], [v for v in res["verdicts"] if not v["ok"]]
    assert len(res["verdicts"]) >= 12
    assert "softmax/c_fast" in res["profiles"]
    assert res["search"]["server"] == "replay"
    assert set(res["search"]["policies"]) == {"sequential", "specgen"}
    for prof in res["profiles"].values():
        assert len(prof["speedups"]) == 2 and not prof["failed"]
