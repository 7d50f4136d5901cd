"""Bad schedules, files and settings get errors that name what to change (the 2026-12-04 audit's findings),
and torch's own CSV dumps load."""

from __future__ import annotations

import csv
import io
import json
from pathlib import Path

import pytest
import torch

from steptune.cli import main
from steptune.core.specs import cluster_preset, model_preset
from steptune.pipeline import Action, Schedule, StageCosts, simulate
from steptune.pipeline.anchors import anchor
from steptune.pipeline.costs import layer_costs
from steptune.pipeline.executor import PipelineExecutor
from steptune.pipeline.listsched import ListPolicy
from steptune.pipeline.schedule import ScheduleError
from steptune.pipeline.tune import TuneConfig

A = Action.parse


def test_simulate_refuses_a_schedule_with_missing_actions_or_a_contradicting_placement() -> None:
    half = Schedule(name="x", num_stages=2, num_microbatches=2, placement=(0, 1),
                    orders=((A("0F0"),), (A("1F0"), A("1B0"))))  # fmt: skip
    with pytest.raises(ScheduleError, match="needs exactly one backward"):
        simulate(half, StageCosts.uniform(2))  # priced as 4.0 before
    good = anchor("1f1b", 2, 2)
    swapped = Schedule(name="y", num_stages=2, num_microbatches=2, placement=(1, 0), orders=good.orders)
    with pytest.raises(ScheduleError, match="placed on device"):
        simulate(swapped, StageCosts.uniform(2))
    assert simulate(good, StageCosts.uniform(2)).makespan > 0


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"meta": [1]}, "meta must be an object"),
        ({"partition": 5}, "partition must be a list of whole numbers"),
        ({"placement": ["0", "1"]}, "placement must be a list of whole numbers"),
        ({"placement": None}, "placement must be a list of whole numbers"),
        ({"orders": 5}, "orders must be a list per device of action strings"),
        ({"orders": [[1, 2]]}, "orders must be a list per device of action strings"),
        ({"meta": {"head_split": "two"}}, "meta.head_split must be a whole number >= 1"),
        ({"meta": {"head_split": 0}}, "meta.head_split must be a whole number >= 1"),
    ],
)
def test_a_malformed_schedule_json_names_its_field(
    tmp_path: Path, change: dict, message: str, capsys
) -> None:
    data = anchor("1f1b", 2, 2).to_json()
    data.update(change)
    path = tmp_path / "s.json"
    path.write_text(json.dumps(data))
    with pytest.raises(ScheduleError, match=message):
        Schedule.load(path)
    assert main(["pipeline", "simulate", "--schedule", str(path), "--out", str(tmp_path / "o")]) == 2
    assert message in capsys.readouterr().err


def test_torch_csv_dumps_load_with_fsdp_comm_and_overlapped_actions() -> None:
    vis = pytest.importorskip("torch.distributed.pipelining._schedule_visualizer")
    from torch.distributed.pipelining.schedules import _ComputationType as T

    # (not 1F1B: torch 2.13 dumps its last rank with forwards numbered 1..M, see test_anchors.py)
    for name, per_rank in (("GPipe", None), ("DualPipeV", 2)):
        ops = vis.get_schedule_ops(name, 4, 8, num_stages_per_rank=per_rank)
        buf = io.StringIO()
        csv.writer(buf).writerows([["" if a is None else str(a) for a in row] for row in ops])
        text = buf.getvalue()
        # the dump really holds what used to be refused
        assert ("REDUCE_GRAD" if name == "GPipe" else "OVERLAP_F_B") in text, name
        sched = Schedule.from_csv(text + "\n\n", name=name)  # trailing blank lines are not ranks
        assert sched.num_devices == 4
        want = []
        for row in ops:
            out = []
            for a in row:
                if a is None:
                    continue
                if a.computation_type == T.OVERLAP_F_B:
                    out += [str(sub) for sub in a.sub_actions]
                elif a.computation_type in (T.FORWARD, T.BACKWARD_INPUT, T.BACKWARD_WEIGHT, T.FULL_BACKWARD):
                    out.append(str(a))
            want.append(out)
        assert [[str(a) for a in order] for order in sched.orders] == want
        assert simulate(sched, StageCosts.uniform(sched.num_stages)).makespan > 0
    with pytest.raises(ScheduleError, match="bad action '0X0'"):
        Schedule.from_csv("0F0,0X0\n")


def test_an_upper_case_csv_suffix_is_csv(tmp_path: Path) -> None:
    sched = anchor("1f1b", 2, 2)
    path = sched.save(tmp_path / "S.CSV")
    assert path.read_text().startswith("0F0")
    assert Schedule.load(path).orders == sched.orders


def test_simulating_a_csv_with_a_model_says_which_partition_it_used(tmp_path: Path, capsys) -> None:
    sched = anchor("1f1b", 4, 8)
    csv_path = sched.save(tmp_path / "s.csv")
    assert main(["pipeline", "simulate", "--schedule", str(csv_path), "--model", "gemma-2b",
                 "--out", str(tmp_path / "o")]) == 0  # fmt: skip
    out = " ".join(capsys.readouterr().out.split())
    assert "carries no layer partition" in out and "uniform partition [" in out and "head unsplit" in out


def test_a_csv_with_more_stages_than_the_models_layers_is_refused_naming_the_file(
    tmp_path: Path, capsys
) -> None:
    csv_path = anchor("1f1b", 40, 4).save(tmp_path / "s40.csv")  # gemma-2b has 20 units
    assert main(["pipeline", "simulate", "--schedule", str(csv_path), "--model", "gemma-2b",
                 "--out", str(tmp_path / "o")]) == 2  # fmt: skip
    err = " ".join(capsys.readouterr().err.split())
    assert f"{csv_path}: its 40 stages need at least one layer each" in err and "at most 20 stages" in err


def test_unit_cost_simulation_refuses_a_byte_cap_and_warns_of_ignored_options(tmp_path: Path, capsys) -> None:
    csv_path = anchor("1f1b", 2, 2).save(tmp_path / "s.csv")
    base = ["pipeline", "simulate", "--schedule", str(csv_path), "--out", str(tmp_path / "o")]
    assert main([*base, "--memory-cap", "1"]) == 2
    assert "--memory-cap is in bytes and needs --model" in capsys.readouterr().err
    assert main([*base, "--cluster", "nope", "--efficiency", "0.9"]) == 0
    captured = capsys.readouterr()
    assert "--cluster has no effect without --model" in captured.err
    assert "--efficiency has no effect without --model" in captured.err
    assert "memory within cap" not in captured.out and "unit costs" in captured.out


def test_tuner_scheduler_and_cost_settings_out_of_range_are_refused() -> None:
    L = layer_costs(model_preset("llama2-7b"), cluster_preset("dgx-h100").device)
    with pytest.raises(ValueError, match="microbatch_size must be >= 1"):
        layer_costs(model_preset("llama2-7b"), cluster_preset("dgx-h100").device, microbatch_size=-2)
    with pytest.raises(ValueError, match="seq_len must be >= 1"):
        layer_costs(model_preset("llama2-7b"), cluster_preset("dgx-h100").device, seq_len=-5)
    for kw, message in (
        ({"overhead": -1.0}, "overhead must be a finite number >= 0"),
        ({"time_budget": -1.0}, "time_budget must be a finite number >= 0"),
        ({"families": ()}, "families is empty"),
        ({"families": ("loop0",)}, "loop<v> with v >= 1"),
        ({"families": ("ring",)}, "unknown placement family"),
        ({"num_microbatches": 0}, "num_microbatches must be >= 1"),
    ):
        with pytest.raises(ValueError, match=message):
            TuneConfig(**{"num_devices": 4, "num_microbatches": 8, **kw})
    with pytest.raises(ValueError, match="extra_inflight"):
        ListPolicy(extra_inflight=-4)
    assert L.num_layers > 0


class _Group:
    def __init__(self, size: int) -> None:
        self._size = size

    def size(self) -> int:
        return self._size


def test_the_executor_refuses_a_group_of_the_wrong_size_and_plain_modules_before_any_communication() -> None:
    from steptune.pipeline.stages import split_layers

    sched = anchor("1f1b", 2, 2)
    meta = [((1, 4), torch.float32)]
    stage = {0: split_layers([torch.nn.Linear(4, 4), torch.nn.Linear(4, 4)], (1, 1))[0]}
    kw = {"rank": 0, "boundary": meta, "loss_fn": lambda y, t: y.sum()}
    with pytest.raises(ValueError, match=r"the group has 1 rank.*on 2 devices"):  # hung in irecv before
        PipelineExecutor(sched, stage, group=_Group(1), **kw)
    with pytest.raises(TypeError, match=r"plain modules.*split_layers"):
        PipelineExecutor(sched, {0: torch.nn.Linear(4, 4)}, group=_Group(2), **kw)
    with pytest.raises(ValueError, match="rank 5 is not one of"):
        PipelineExecutor(sched, stage, group=_Group(2), **{**kw, "rank": 5})
    PipelineExecutor(sched, stage, group=_Group(2), **kw)  # the right group builds


def test_the_last_stage_without_its_targets_is_refused_before_any_work() -> None:
    # a review (2026-12-05) found this check dropped with the ragged-input one (an AssertionError mid-step)
    from steptune.pipeline.stages import split_layers

    sched = anchor("1f1b", 1, 2)
    stage = {0: split_layers([torch.nn.Linear(4, 4)], (1,))[0]}
    ex = PipelineExecutor(sched, stage, rank=0, group=_Group(1), boundary=[], loss_fn=lambda y, t: y.sum())
    xs = [torch.randn(1, 4) for _ in range(2)]
    for targets in (None, [torch.zeros(1)]):
        with pytest.raises(ValueError, match="rank 0 holds the last stage: pass 2 targets"):
            ex.step(xs, targets)


FIELDS = ("f", "i", "w", "act_bytes", "out_bytes", "static_bytes")


@pytest.mark.parametrize(
    ("field", "value", "match"),
    [
        ("f", (1.0, float("nan"), 1.0, 1.0), r"StageCosts.f\[1\] \(stage 1\) must be a finite .* got nan"),
        ("w", (1.0, 1.0, -5.0, 1.0), r"StageCosts.w\[2\] \(stage 2\) must be .* got -5.0"),
        ("i", (1.0, 1.0, 1.0), r"each field needs one value per stage .*'i': 3"),
    ],
)  # fmt: skip
def test_costs_that_are_nan_negative_or_ragged_are_refused(field, value, match):
    # Found in a sweep (2026-12-05): a NaN stage cost vanished from the makespan (27 where 1F1B gives 33),
    # a negative one shortened it, and the tuner returned a "best" schedule with a NaN bubble.
    good = StageCosts.uniform(4)
    with pytest.raises(ValueError, match=match):
        StageCosts(**{**{k: getattr(good, k) for k in FIELDS}, field: value})
    costs = layer_costs(model_preset("llama2-7b"), cluster_preset("dgx-h100").device)
    bad = (*costs.f[:3], float("inf"), *costs.f[4:])
    with pytest.raises(ValueError, match=r"LayerCosts.f\[3\] \(layer 3\)"):
        type(costs)(**{**{k: getattr(costs, k) for k in FIELDS}, "f": bad})


@pytest.mark.parametrize("seconds", [1.0, 0.0])
def test_activations_count_toward_the_peak_when_actions_take_no_time(seconds):
    # Found in a sweep (2026-12-05): at zero durations the frees sorted before the allocations at the same
    # instant and GPipe's peak read 0; device 0 holds all 4 microbatches' activations before any backward
    sched = anchor("gpipe", 2, 4)
    costs = StageCosts.uniform(2, f=seconds, i=seconds, w=seconds, act_bytes=1.0)
    assert simulate(sched, costs).peak_memory == (4.0, 4.0)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [({"recv_window": -1}, "recv_window must be a whole number >= 0"),
     ({"timeout": -1}, "timeout must be a finite number of seconds > 0"),
     ({"timeout": float("nan")}, "timeout must be"), ({"timeout": 0}, "timeout must be")],
)  # fmt: skip
def test_executor_settings_are_checked_where_made(kwargs, match):
    from steptune.pipeline.executor import ExecutorConfig

    with pytest.raises(ValueError, match=match):
        ExecutorConfig(**kwargs)


def test_links_durations_budgets_and_cost_lists_are_checked_where_made() -> None:
    # A session-47 sweep: a NaN bandwidth or a negative latency dropped every cross-device dependency
    # (1F1B P=2 M=2 at unit cost: 6 instead of 9), durations NaN or -1 gave 4.0 and -1.0, an infinite time
    # budget was accepted, and cost lists passed here to fail later in tune's split_layer
    from steptune.core.specs import LinkSpec
    from steptune.pipeline.costs import LayerCosts

    for bad in ({"bandwidth": float("nan"), "latency": 0.0}, {"bandwidth": 0, "latency": 0.0},
                {"bandwidth": 1e9, "latency": -5.0}, {"bandwidth": -1.0, "latency": 0.0}):  # fmt: skip
        with pytest.raises(ValueError, match=r"LinkSpec 'l': (bandwidth|latency) must be a finite number"):
            LinkSpec(name="l", **bad)
    sched = anchor("1f1b", 2, 2)
    assert simulate(sched, StageCosts.uniform(2), send_after_i=False).makespan == 9.0
    for value in (float("nan"), -1.0):
        with pytest.raises(ValueError, match=r"durations\(.*\) must be a finite number of seconds >= 0"):
            simulate(sched, StageCosts.uniform(2), durations=lambda a, v=value: v if a.stage == 1 else 1.0)
    with pytest.raises(ValueError, match="time_budget must be a finite number"):
        TuneConfig(num_devices=2, num_microbatches=2, time_budget=float("inf"))
    layers = LayerCosts(f=[1.0], i=[1.0], w=[1.0], act_bytes=[1.0], out_bytes=[1.0], static_bytes=[0.0])
    assert layers.f == (1.0,) and isinstance(layers.static_bytes, tuple)


def test_simulating_a_head_split_schedule_without_a_partition_says_so(tmp_path: Path, capsys) -> None:
    sched = anchor("1f1b", 2, 2)
    path = tmp_path / "s.json"
    from dataclasses import replace

    replace(sched, meta={"head_split": 4}).save(path)
    assert main(["pipeline", "simulate", "--schedule", str(path), "--model", "gemma-2b", "--out",
                 str(tmp_path / "out")]) == 0  # fmt: skip
    printed = " ".join(capsys.readouterr().out.split())
    assert "and the head split 4 ways (its meta.head_split)" in printed and "head unsplit" not in printed
