import json

import pytest

from steptune.cli import main

pytestmark = pytest.mark.timeout(180)


def test_compare_writes_every_policy(tmp_path, capsys):
    out = tmp_path / "c.json"
    assert main(["memory", "compare", "--model", "llama-tiny", "--repeats", "2", "--json", str(out)]) == 0
    result = json.loads(out.read_text())
    rows = {r["policy"]: r for r in result["rows"]}
    assert set(rows) == {"no_ac", "full_ac", "full_ac_no_early_stop", "tapesac_replay"}
    assert all(len(r["step_times_s"]) == 2 and r["tapesac_over_this"] > 0 for r in rows.values())
    assert result["recording_overhead"]["forward_s"]["plain"] > 0
    text = capsys.readouterr().out
    assert "TapeSAC replay-only" in text and "recording costs" in text


def test_compare_rejects_an_unknown_model(capsys):
    assert main(["memory", "compare", "--model", "gpt-9", "--no-time"]) == 2
    assert "choose one of" in capsys.readouterr().err
