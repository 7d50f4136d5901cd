"""`steptune demo --only`: the demos that run in one process (core, memory, pipeline), checked here in the
parallel pass; tests/integration/test_cli.py runs the ones that start processes."""

from __future__ import annotations

import pytest

from steptune.cli import main


@pytest.mark.timeout(240)
def test_the_in_process_demos_write_their_sections_and_artifacts(tmp_path) -> None:
    assert main(["demo", "--quick", "--only", "core,memory,pipeline", "--out", str(tmp_path)]) == 0
    report = (tmp_path / "report.md").read_text()
    assert "Simulated FSDP step" in report and "SIMULATED" in report
    for name in (
        "fsdp_step_llama3.1-70b_64gpu.png",
        "fsdp_step_llama3.1-70b_64gpu.trace.json",
        "presets.json",
    ):
        assert (tmp_path / "core" / name).stat().st_size > 0
    assert "TapeSAC vs torch checkpointing" in report
    assert "OctoPipe tuner vs anchors" in report
    for name in ("gemma-2b_P8_tuned.png", "gemma-2b_P8_anchor.trace.json", "pipeline.json"):
        assert (tmp_path / "pipeline" / name).stat().st_size > 0
    # only the areas asked for
    assert "Detectors on 2 simulated runs" not in report and not (tmp_path / "kernels").exists()


def test_an_unknown_area_is_a_usage_error_naming_the_areas(capsys) -> None:
    with pytest.raises(SystemExit) as exc:
        main(["demo", "--only", "memroy"])
    assert exc.value.code == 2
    assert "memroy: not an area with a demo; choose from core, memory" in capsys.readouterr().err
