import json

import pytest

from steptune.cli import main

pytestmark = pytest.mark.timeout(180)


def test_detect_scores_detectors(tmp_path, capsys):
    out = tmp_path / "d.json"
    assert main(["resilience", "detect", "--runs", "4", "--steps", "50", "--json", str(out)]) == 0
    scores = json.loads(out.read_text())["detector"]
    assert scores["resihp"]["detection_rate"] == 1.0
    assert scores["fixed-threshold"]["false_alarms_per_run"] > scores["resihp"]["false_alarms_per_run"]
    assert "SIMULATED" in capsys.readouterr().out


def test_trace_replay_and_unbuilt_verbs(capsys):
    from steptune.resilience.trace import default_trace_path

    if default_trace_path().exists():
        assert main(["resilience", "trace"]) == 0
        assert "fixed-threshold" in capsys.readouterr().out
    assert main(["resilience", "bench"]) == 2
    assert "not built yet" in capsys.readouterr().err
