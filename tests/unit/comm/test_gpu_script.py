"""The comm GPU script's CPU dry run, and calibration of the model from its JSON."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest

from steptune.cli import main as cli_main
from steptune.comm.constants import CommConstants, calibrated, gamma_unresolved

SCRIPT = Path(__file__).resolve().parents[3] / "benchmarks" / "gpu" / "comm.py"


@pytest.mark.timeout(240)
def test_dry_run_measures_every_rate_and_calibrates_the_model(tmp_path: Path, capsys) -> None:
    spec = importlib.util.spec_from_file_location("gpu_comm", SCRIPT)
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod
    spec.loader.exec_module(mod)
    out = tmp_path / "comm.json"
    assert mod.main(["--dry-run", "--json", str(out)]) == 0
    res = json.loads(out.read_text())
    assert res["dry_run"] is True and res["interference"] is None
    for key in ("copy_out", "chunk_cat_bf16_fp32", "chunk_cat_bf16", "cast", "accumulate"):
        assert len(res["rates"][key]) == 2 and all(row["s"] > 0 for row in res["rates"][key])
    fit = res["fit"]
    assert set(fit) == {
        "copy_out_bytes_per_s",
        "chunk_cat_elems_per_s",
        "pack_elems_per_s",
        "cast_elems_per_s",
        "accumulate_elems_per_s",
    }
    consts = calibrated(out)
    assert (
        consts.calibrated_from.startswith(str(out))
        and consts.copy_out_bytes_per_s == fit["copy_out_bytes_per_s"]
    )
    assert consts.for_device(None) is consts  # all rates measured (on the CPU here): none rescaled  # type: ignore[arg-type]
    assert cli_main(["comm", "calibrate", str(out), "--gpus", "16"]) == 0
    assert "(measured)" in capsys.readouterr().out


def test_calibration_refuses_bad_files(tmp_path: Path) -> None:
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"rates": {}}))
    with pytest.raises(ValueError, match="no 'fit' section"):
        calibrated(bad)
    bad.write_text(json.dumps({"fit": {"copy_out_bytes_per_s": -1}}))
    with pytest.raises(ValueError, match="not a positive number"):
        calibrated(bad)
    bad.write_text(json.dumps({"fit": {"warp_speed": 9}}))
    with pytest.raises(ValueError, match="unknown fitted constants"):
        calibrated(bad)
    assert CommConstants().calibrated_from == ""


def test_gamma_is_fitted_against_the_same_method_baseline_and_reports_its_noise_floor() -> None:
    spec = importlib.util.spec_from_file_location("gpu_comm_fit", SCRIPT)
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod
    spec.loader.exec_module(mod)
    rates = {k: [{"bytes_per_s": 1.0, "elems_per_s": 1.0}] for k in
             ("copy_out", "chunk_cat_bf16_fp32", "chunk_cat_bf16", "cast", "accumulate")}  # fmt: skip
    # A 48 GB/s copy on a 4.8 TB/s device (u = 1%), GEMM 100 us synced, 102 us beside the copy, and the
    # back-to-back figure (90 us) must not be the baseline: gamma = 2% / 1% = 2.
    inter = {
        "gemm": {"alone_s": 100e-6, "alone_back_to_back_s": 90e-6},
        "alone_again_s": 100.5e-6,
        "with_ce_copy_s": 102e-6,
        "ce_copy_alone_s": 1e-3,
        "ce_copy_bytes": 48e6,
    }
    f = mod.fit(rates, inter, 4.8e12)
    assert f["hbm_contention"] == pytest.approx(2.0) and inter["hbm_contention_resolved"] is True
    assert inter["ce_copy_hbm_fraction"] == pytest.approx(0.01)
    assert inter["hbm_contention_noise_floor"] == pytest.approx(0.5)
    inter["with_ce_copy_s"] = 99e-6  # faster beside the copy: unresolved, never a negative gamma
    assert "hbm_contention" not in mod.fit(rates, inter, 4.8e12) and inter["hbm_contention_estimate"] == 0
    # The H200 figures of 2026-12-04: a 2.1% slowdown where the same baseline twice differed by 5.6%.
    inter.update({"gemm": {"alone_s": 103.6e-6}, "alone_again_s": 109.5e-6, "with_ce_copy_s": 105.8e-6})
    f = mod.fit(rates, inter, 4.8e12)
    assert "hbm_contention" not in f and inter["hbm_contention_resolved"] is False
    assert inter["hbm_contention_estimate"] < inter["hbm_contention_noise_floor"]


def test_calibration_scales_what_it_did_not_fit_and_what_was_measured_on_another_device(
    tmp_path: Path,
) -> None:
    from steptune.core.specs import cluster_preset

    h100, h200, b200 = (cluster_preset(c).device for c in ("dgx-h100", "dgx-h200", "gb200-nvl72"))
    cited = CommConstants()
    same = tmp_path / "same.json"  # the H200 value the model already uses, fitted alone
    same.write_text(
        json.dumps({"fit": {"copy_out_bytes_per_s": 650e9 * 4.8 / 3.35}, "device": "NVIDIA H200"})
    )
    part = calibrated(same)
    for k in (
        "chunk_cat_elems_per_s",
        "cast_elems_per_s",
    ):  # not fitted: still scaled by HBM (dropped before)
        assert getattr(part.for_device(h200), k) == getattr(cited.for_device(h200), k)
    assert part.for_device(h200).copy_out_bytes_per_s == pytest.approx(
        cited.for_device(h200).copy_out_bytes_per_s
    )
    assert part.device_note(h200) is None
    # measured on an H200, simulated on a B200: scaled from the H200 by HBM bandwidth, and said
    on_b200 = part.for_device(b200).copy_out_bytes_per_s
    assert on_b200 == pytest.approx(part.copy_out_bytes_per_s * b200.memory_bandwidth / h200.memory_bandwidth)
    assert "scaled to B200" in (part.device_note(b200) or "")
    assert part.for_device(h100).copy_out_bytes_per_s < part.copy_out_bytes_per_s


def test_an_unresolved_gamma_in_a_results_file_is_not_applied() -> None:
    results = Path(__file__).resolve().parents[3] / "benchmarks" / "results"
    for run in ("run3", "run4", "run5"):  # 9.7 (method mismatch), 1.8 and 3.4 inside their noise floors
        data = json.loads((results / f"comm_gpu_h200_{run}.json").read_text())
        assert data["fit"]["hbm_contention"] > 1
        consts = calibrated(results / f"comm_gpu_h200_{run}.json")
        assert consts.hbm_contention == 0.0 and "hbm_contention" not in consts.fitted
        assert "copy_out_bytes_per_s" in consts.fitted
        # and `comm calibrate` says which: run3 has no repeated baseline (it said "inside its noise floor")
        says = "no repeated baseline" if run == "run3" else "inside twice the baseline's own spread"
        assert says in (gamma_unresolved(data["interference"]) or "")
        assert dict(consts.unfitted)["hbm_contention"] == gamma_unresolved(data["interference"])
