"""trace, report, plot, config helper and the FSDP step simulator."""

import argparse
import json
from dataclasses import dataclass

import pytest

from steptune.core.config import add_config_args, config_from_args, field_docs
from steptune.core.plot import bars, gantt, pareto
from steptune.core.report import Table
from steptune.core.specs import cluster_preset, model_preset
from steptune.core.stepsim import FSDPStepConfig, simulate_fsdp_step
from steptune.core.trace import Trace, load_trace


def test_trace_roundtrip(tmp_path):
    t = Trace()
    t.add("F0", 0.0, 0.001, rank=0, stream="compute", mb=0)
    t.add("AG", 0.0005, 0.002, rank=1, stream="comm")
    t.name_rank(1, "stage 1")
    path = t.write(tmp_path / "t.json")
    data = json.loads(path.read_text())
    xs = [e for e in data["traceEvents"] if e["ph"] == "X"]
    assert {e["name"]: e["dur"] for e in xs} == {"F0": pytest.approx(1000.0), "AG": pytest.approx(2000.0)}
    assert any(e["ph"] == "M" and e["args"]["name"] == "stage 1" for e in data["traceEvents"])
    back = load_trace(path)
    assert sorted((s.name, s.rank, s.stream) for s in back.spans) == [("AG", 1, "comm"), ("F0", 0, "compute")]
    with pytest.raises(ValueError, match="negative"):
        t.add("bad", 0.0, -1.0)


def test_table_outputs(tmp_path, capsys):
    tab = Table(title="T", columns=["a", "b"])
    tab.add("x", 1.23456)
    tab.notes.append("simulated")
    js, md = tab.write(tmp_path / "t")
    assert json.loads(js.read_text())["rows"] == [{"a": "x", "b": 1.23456}]
    assert "| x | 1.235 |" in md.read_text() and "- simulated" in md.read_text()
    tab.print()
    assert "1.235" in capsys.readouterr().out
    with pytest.raises(ValueError, match="2 columns"):
        tab.add(1)


def test_plots_write_png(tmp_path):
    t = Trace()
    t.add("F", 0.0, 1.0, category="forward")
    t.add("B", 1.0, 2.0, category="backward")
    for path in (
        gantt(t.spans, tmp_path / "g.png"),
        pareto([(1, 3, "a"), (2, 1, "b"), (3, 2, "c")], tmp_path / "p.png", xlabel="x", ylabel="y"),
        bars(["a", "b"], [1.0, 2.0], tmp_path / "b.png", ylabel="r", reference=1.0),
    ):
        assert path.read_bytes()[:4] == b"\x89PNG"
    with pytest.raises(ValueError):
        bars(["a"], [1.0, 2.0], tmp_path / "x.png", ylabel="r")


@dataclass(kw_only=True, slots=True)
class _Cfg:
    num_gpus: int = 8
    """Ranks in the group."""
    name: str = "x"
    fast: bool = False
    """Go fast."""


def test_config_flags_from_docstrings():
    assert field_docs(_Cfg) == {"num_gpus": "Ranks in the group.", "fast": "Go fast."}
    p = argparse.ArgumentParser()
    add_config_args(p, _Cfg)
    assert "Ranks in the group." in p.format_help()
    cfg = config_from_args(_Cfg, p.parse_args(["--num-gpus", "4", "--fast"]))
    assert cfg == _Cfg(num_gpus=4, name="x", fast=True)


def test_fsdp_step_single_gpu_is_pure_compute():
    m, c = model_preset("llama2-7b"), cluster_preset("dgx-h100")
    r = simulate_fsdp_step(m, c, FSDPStepConfig(num_gpus=1, tokens_per_gpu=4096, efficiency=0.5))
    assert r.comm_time == 0.0
    assert r.step_time == pytest.approx(m.flops() / (0.5 * 989e12))
    assert r.mfu == pytest.approx(0.5)


def test_fsdp_step_overlap_and_prefetch():
    m, c = model_preset("qwen3-30b-a3b"), cluster_preset("dgx-h100")
    one = simulate_fsdp_step(m, c, FSDPStepConfig(num_gpus=64, prefetch=1))
    none = simulate_fsdp_step(m, c, FSDPStepConfig(num_gpus=64, prefetch=0))
    assert one.step_time < none.step_time  # prefetching hides communication
    assert one.compute_time <= one.step_time <= one.compute_time + one.comm_time + 1e-9
    assert len([s for s in one.spans if s.category == "reduce-scatter"]) == m.num_layers
    with pytest.raises(ValueError, match="exceeds"):
        simulate_fsdp_step(m, c, FSDPStepConfig(num_gpus=1000))


def test_a_piped_table_keeps_long_row_names_whole_and_shows_missing_values_as_a_dash(capsys, monkeypatch):
    """Piped output got rich's 80 columns: 'strengthened-recycle' and 'strengthened-oobleck' were both cut to
    'strengthene…' beside wide columns. A None printed as 'None'."""
    monkeypatch.delenv("COLUMNS", raising=False)
    tab = Table(title="T", columns=["policy", "home kinds", "max"])
    for name in ("strengthened-recycle", "strengthened-oobleck"):
        tab.add(name, "fail-slow-weak, fail-slow-medium, fail-slow-strong, fail-slow-link, mixed", None)
    tab.print()  # capsys: not a terminal
    out = capsys.readouterr().out
    assert "strengthened-recycle" in out and "strengthened-oobleck" in out
    assert "None" not in out and "│ -" in out
    assert "| strengthened-recycle | fail-slow-weak" in tab.to_markdown() and "None" not in tab.to_markdown()
