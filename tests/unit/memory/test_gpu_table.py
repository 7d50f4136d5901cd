"""The renderer of benchmarks/gpu/memory.py's JSON reproduces the figures RESULTS.md quotes."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]


def _renderer():  # type: ignore[no-untyped-def]
    spec = importlib.util.spec_from_file_location(
        "memory_gpu_table", ROOT / "benchmarks" / "memory_gpu_table.py"
    )
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod
    spec.loader.exec_module(mod)
    return mod


def test_tables_of_the_h200_runs_carry_the_quoted_ratios_and_prediction_errors(capsys) -> None:
    mod = _renderer()
    results = ROOT / "benchmarks" / "results"
    assert mod.main([str(results / "memory_plan_gpu_h200_fixed.json")]) == 0
    before = capsys.readouterr().out
    # The 2026-12-04 run before the head term: 7.4% low on the dense model, the halfway ratios as quoted.
    assert "full_ac 0.840, full_ac_no_early_stop 0.809, torchtitan_sac 0.909" in before
    assert "-7.4% to +1.9%" in before
    assert mod.main([str(results / "memory_plan_gpu_h200_head.json")]) == 0
    after = capsys.readouterr().out
    assert "-0.0% to +1.9%" in after and "-0.0% to +0.7%" in after
    assert after.count("planned rows over their limit: none") == 2
    for line in after.splitlines():  # every anchor row names a planned row that dominates it
        cells = [c.strip() for c in line.split("|")]
        if len(cells) > 5 and cells[1] and not cells[1].startswith(("tapesac", "no_ac", "row", "---")):
            assert cells[5].startswith("tapesac_plan@"), line
