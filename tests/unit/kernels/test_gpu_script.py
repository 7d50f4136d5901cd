"""The kernels GPU script's CPU dry run: the same pool code path, with C candidates for CUDA/Triton ones."""

import importlib.util
import json
import sys
from pathlib import Path
from typing import Any

import pytest

SCRIPT = Path(__file__).resolve().parents[3] / "benchmarks" / "gpu" / "kernels.py"


@pytest.mark.timeout(240)
@pytest.mark.slow
def test_dry_run_gets_every_expected_verdict_and_profiles(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, cpu_lane_report: dict[str, Any]
) -> None:
    from steptune.kernels import lanes

    spec = importlib.util.spec_from_file_location("gpu_kernels", SCRIPT)
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod
    spec.loader.exec_module(mod)
    # The search part's lane is the suite's one real cpu lane (tests/conftest.py; test_kernels_search.py
    # checks what it measured): a second one here, 2 s per policy, spent 15-20 s on pool start-ups.
    walls: list[float] = []

    def lane(*, wall_s: float) -> dict[str, Any]:
        walls.append(wall_s)
        return cpu_lane_report

    monkeypatch.setattr(lanes, "run_cpu_lane", lane)
    out = tmp_path / "k.json"
    assert mod.main(["--dry-run", "--repeats", "2", "--json", str(out)]) == 0
    res = json.loads(out.read_text())
    assert res["dry_run"] is True
    assert res["all_expected"], [v for v in res["verdicts"] if not v["ok"]]
    assert len(res["verdicts"]) >= 12
    assert "softmax/c_fast" in res["profiles"]
    assert walls == [2.0]  # the dry run checks the path, not the ratio
    assert res["search"]["server"] == "replay"
    assert set(res["search"]["policies"]) == {"sequential", "specgen"}
    for name, row in res["search"]["policies"].items():
        measured = cpu_lane_report["policies"][name]
        assert row == {
            k: measured[k] for k in ("feedback_count", "feedback_per_min", "early_stops", "server")
        }
    for prof in res["profiles"].values():
        assert len(prof["speedups"]) == 2 and not prof["failed"]
