"""What a user audit of steptune.core found: outputs that overwrote each other or were not valid JSON,
and inputs that gave silently wrong numbers. Each test fails on the code before the fix."""

import argparse
import json
import math
from dataclasses import dataclass, field

import numpy as np
import pytest

from steptune.core.config import add_config_args, config_from_args, field_docs
from steptune.core.cost import all_gather_time, compute_time, p2p_time
from steptune.core.events import Environment, SimulationError
from steptune.core.plot import gantt
from steptune.core.report import Table
from steptune.core.specs import cluster_preset, model_preset
from steptune.core.stepsim import FSDPStepConfig, simulate_fsdp_step
from steptune.core.trace import Trace, load_trace


def test_table_stems_with_dots_keep_their_names(tmp_path):
    paths = []
    for name in ("llama3.1-8b", "llama3.1-70b"):
        t = Table(title=name, columns=["m"])
        t.add(name)
        paths += t.write(tmp_path / name)
    assert [p.name for p in paths] == [
        "llama3.1-8b.json",
        "llama3.1-8b.md",
        "llama3.1-70b.json",
        "llama3.1-70b.md",
    ]
    assert json.loads(paths[0].read_text())["rows"] == [{"m": "llama3.1-8b"}]  # not overwritten by the second


def test_table_json_is_valid_and_markdown_cells_stay_cells(tmp_path):
    t = Table(title="T", columns=["name", "ratio"])
    t.add("a|b", math.inf)
    t.add("c\nd", math.nan)
    js, md = t.write(tmp_path / "t")
    assert json.loads(js.read_text())["rows"] == [
        {"name": "a|b", "ratio": None},
        {"name": "c\nd", "ratio": None},
    ]
    assert "| a\\|b | inf |" in md.read_text() and "| c d | nan |" in md.read_text()
    with pytest.raises(ValueError, match="repeated"):
        Table(title="T", columns=["a", "a"])


def test_trace_refuses_non_finite_times_and_writes_numpy_args(tmp_path):
    t = Trace()
    with pytest.raises(ValueError, match="finite"):
        t.add("n", math.nan, 1.0)
    with pytest.raises(ValueError, match="finite"):
        t.add("n", 0.0, math.inf)
    t.add("k", 0.0, 1e-3, layer=np.int64(3), scale=np.float32(0.5), where=tmp_path, loss=math.nan,
          hist=[1.0, math.inf], grid=np.arange(3))  # fmt: skip
    data = json.loads(t.write(tmp_path / "t.json").read_text())  # was a TypeError at write
    args = next(e["args"] for e in data["traceEvents"] if e["ph"] == "X")
    assert args == {"layer": 3, "scale": 0.5, "where": str(tmp_path), "loss": None, "hist": [1.0, None],
                    "grid": "[0 1 2]"}  # fmt: skip


def test_load_trace_reads_args_named_like_span_fields_and_rank_names(tmp_path):
    # PyTorch profiler kernel events carry "stream" in their args: load_trace raised a TypeError
    events = [
        {"name": "process_name", "ph": "M", "pid": 0, "args": {"name": "stage 0"}},
        {"name": "thread_name", "ph": "M", "pid": 0, "tid": 7, "args": {"name": "compute"}},
        {
            "name": "gemm",
            "ph": "X",
            "pid": 0,
            "tid": 7,
            "ts": 10.0,
            "dur": 5.0,
            "args": {"stream": 7, "name": "x"},
        },
    ]
    path = tmp_path / "prof.json"
    path.write_text(json.dumps({"traceEvents": events}))
    back = load_trace(path)
    (span,) = back.spans
    assert (span.name, span.stream, span.args) == ("gemm", "compute", {"stream": 7, "name": "x"})
    assert span.start == pytest.approx(10e-6) and span.duration == pytest.approx(5e-6)
    rewritten = json.loads(back.write(tmp_path / "again.json").read_text())
    assert any(e["ph"] == "M" and e["args"]["name"] == "stage 0" for e in rewritten["traceEvents"])


def test_gantt_returns_the_file_it_wrote_and_says_what_is_wrong(tmp_path):
    t = Trace()
    t.add("F", 0.0, 1.0)
    out = gantt(t.spans, tmp_path / "step")
    assert out == tmp_path / "step.png" and out.read_bytes()[:4] == b"\x89PNG"
    assert gantt(t.spans, tmp_path / "run.v2") == tmp_path / "run.v2.png"
    assert gantt(t.spans, tmp_path / "g.svg").read_text().lstrip().startswith("<?xml")
    with pytest.raises(ValueError, match="no spans"):
        gantt([], tmp_path / "empty.png")
    with pytest.raises(ValueError, match="choose one of s, ms, us, units"):
        gantt(t.spans, tmp_path / "x.png", time_unit="sec")


def test_sizes_and_counts_that_gave_silently_wrong_numbers_are_refused():
    m = model_preset("llama2-7b")
    for bad in (0, -1, math.nan):
        with pytest.raises(ValueError, match="seq_len"):
            m.flops(bad)  # 0 gave the default seq_len's FLOPs, -1 negative FLOPs
    for bad in (0, 2.5, True):
        with pytest.raises(ValueError, match="num_nodes"):
            cluster_preset("dgx-h100", num_nodes=bad)  # 0 gave the preset's 64 GPUs, 2.5 gave 20.0
    for bad in (2.5, math.nan):
        with pytest.raises(ValueError, match="seq_len"):
            model_preset("llama2-7b", seq_len=bad)
    cases = [
        ({"num_hidden_layers": -1}, "num_hidden_layers=-1"),
        ({"vocab_size": -5}, "vocab_size=-5"),
        ({"hidden_size": 4097}, "not a multiple of num_attention_heads"),
    ]
    for overrides, says in cases:
        with pytest.raises(ValueError, match=says):
            model_preset("llama2-7b", overrides=overrides)
    moe = [
        ({"num_experts_per_tok": 200}, "num_experts_per_tok 200 > n_routed_experts"),
        ({"first_k_dense_replace": 2}, "need intermediate_size"),  # made attention-only layers
    ]
    for overrides, says in moe:
        with pytest.raises(ValueError, match=says):
            model_preset("qwen3-30b-a3b", overrides=overrides)
    assert model_preset("llama2-7b", seq_len=np.int64(2048)).seq_len == 2048


def test_cost_formulas_refuse_nan_and_negative_amounts():
    c = cluster_preset("dgx-h100")
    for call in (
        lambda: compute_time(-1e12, c.device),
        lambda: p2p_time(-1e9, c.intra),
        lambda: all_gather_time(math.nan, 8, c.intra),
    ):
        with pytest.raises(ValueError, match="finite and >= 0"):
            call()


def test_the_event_clock_never_goes_nan_or_backwards():
    env = Environment()
    with pytest.raises(ValueError, match="finite"):
        env.timeout(math.nan)
    with pytest.raises(ValueError, match="finite"):
        env.call_at(math.nan, lambda: None)
    with pytest.raises(ValueError, match="finite"):
        Environment(start=math.nan)
    env.timeout(10.0)
    env.run(until=5)
    with pytest.raises(ValueError, match="does not run backwards"):
        env.run(until=3)
    assert env.now == 5
    with pytest.raises(SimulationError, match="finite"):
        env._schedule(math.inf, 0, lambda: None)


def test_fsdp_step_charges_attention_for_the_sequence_actually_run():
    m, c = model_preset("llama3.1-8b"), cluster_preset("dgx-h100")  # seq_len 8192
    assert m.seq_len == 8192
    r = simulate_fsdp_step(m, c, FSDPStepConfig(num_gpus=1, tokens_per_gpu=4096, efficiency=0.5))
    assert r.compute_time == pytest.approx(m.flops(4096) / (0.5 * c.device.peak_flops))  # was 6.7% more
    assert r.mfu == pytest.approx(0.5)  # one GPU: pure compute at the set efficiency
    q = model_preset("qwen2.5-7b")  # seq_len 32768 > the default 8192 tokens per GPU
    assert 0 < simulate_fsdp_step(q, c, FSDPStepConfig(num_gpus=8)).mfu <= 0.5  # was 2.6
    with pytest.raises(ValueError, match="not a multiple of its gpus_per_node=8: pick 8 or 16"):
        simulate_fsdp_step(m, c, FSDPStepConfig(num_gpus=12))


@dataclass(kw_only=True, slots=True)
class _Base:
    steps: int = 4
    """Training steps."""


@dataclass(kw_only=True, slots=True)
class _Derived(_Base):
    sizes: list = field(default_factory=list)
    ranks: int = 2
    """Ranks."""


@dataclass(kw_only=True, slots=True)
class _WithFactory:
    steps: int = field(default_factory=lambda: 7)
    """Steps."""


def test_config_flags_keep_factory_defaults_and_inherited_docs():
    p = argparse.ArgumentParser()
    add_config_args(p, _WithFactory)
    assert config_from_args(_WithFactory, p.parse_args([])).steps == 7  # was a required flag
    assert field_docs(_Derived) == {"steps": "Training steps.", "ranks": "Ranks."}


def test_a_recursive_collective_across_an_odd_node_count_names_the_ranks_not_the_nodes():
    from steptune.core.cost import group_collective_time

    c = cluster_preset("dgx-h100")
    with pytest.raises(
        ValueError, match="24 ranks span 3 nodes of 8 on dgx-h100: use ring, or 16 or 32 ranks"
    ):
        group_collective_time("all_gather", 1e6, 24, c, "recursive")  # said "got 3"
    assert group_collective_time("all_gather", 1e6, 32, c, "recursive") > 0
    assert group_collective_time("all_reduce", 1e6, 24, c, "tree") > 0
