"""steptune schedules load into torch 2.13's ``_PipelineScheduleRuntime`` unchanged.

Everything goes through torch's own CSV reader and lowering passes, on stand-in stages and without
a process group, so these are exact, single-process checks: torch's compute-only order equals ours
action for action, the stage -> rank map torch infers equals our placement, lowering adds
communication without reordering compute, and torch's rejections surface as ``ScheduleError``.
"""

from __future__ import annotations

import functools
import re

import pytest

from steptune.pipeline import anchors
from steptune.pipeline.costs import LayerCosts, balanced_partition, layer_costs, stage_costs
from steptune.pipeline.listsched import ListPolicy, list_schedule
from steptune.pipeline.schedule import Action, Schedule, ScheduleError
from steptune.pipeline.torch_compat import (
    load_into_torch_runtime,
    torch_lowered_order,
    torch_pipeline_order,
    torch_stage_to_rank,
)
from steptune.pipeline.tune import TuneConfig, tune

pytest.importorskip("torch.distributed.pipelining")

P, M = 4, 8
COMPUTE = re.compile(r"^\d+[FIWB]\d+$")
COMM = re.compile(r"^(\d+)(SEND|RECV)_([FB])(\d+)$")


def _ours(schedule: Schedule) -> dict[int, list[str]]:
    return {d: [str(a) for a in order] for d, order in enumerate(schedule.orders)}


def _placement_map(schedule: Schedule) -> dict[int, int]:
    return dict(enumerate(schedule.placement))


def _schedule(text: str, *, num_stages: int, num_microbatches: int, placement: tuple[int, ...]) -> Schedule:
    """A schedule from ``"0F0,0B0 | 1F0,1B0"`` (devices separated by ``|``), not validated."""
    orders = tuple(tuple(Action.parse(a) for a in row.split(",") if a.strip()) for row in text.split("|"))
    return Schedule(
        name="fixture",
        num_stages=num_stages,
        num_microbatches=num_microbatches,
        placement=placement,
        orders=orders,
    )


@functools.cache
def _gemma() -> LayerCosts:
    from steptune.core.specs import cluster_preset, model_preset

    return layer_costs(model_preset("gemma-2b"), cluster_preset("dgx-h100").device)


ANCHOR_SCHEDULES = {
    "gpipe": lambda: anchors.gpipe(P, M),
    "1f1b": lambda: anchors.one_f_one_b(P, M),
    "interleaved_1f1b": lambda: anchors.interleaved_1f1b(P, M, num_chunks=2),
    "zb_h1": lambda: anchors.zb_h1(P, M),
    "zb_v": lambda: anchors.zb_v(P, M),
    "dualpipe_v": lambda: anchors.dualpipe_v(P, M),
}

PLACEMENTS = {
    "seq": (0, 1, 2, 3),
    "v": (0, 1, 2, 3, 3, 2, 1, 0),
    "loop2": (0, 1, 2, 3, 0, 1, 2, 3),
    # Neither loop nor V, uneven stages per device (the research brief's 3-rank case).
    "irregular": (0, 1, 1, 2, 0),
}


def _list_scheduled(placement_name: str, split_backward: bool) -> Schedule:
    layers = _gemma()
    placement = PLACEMENTS[placement_name]
    weights = [layers.f[k] + layers.i[k] + layers.w[k] for k in range(layers.num_layers)]
    partition = balanced_partition(weights, len(placement), placement)
    policy = ListPolicy(extra_inflight=1, split_backward=split_backward)
    return list_schedule(stage_costs(layers, partition), placement, M, policy, partition=partition)


def _assert_torch_agrees(schedule: Schedule) -> None:
    schedule.validate()
    assert torch_pipeline_order(schedule) == _ours(schedule)
    assert torch_stage_to_rank(schedule) == _placement_map(schedule)
    # Lowering only inserts comm/FSDP/grad-reduce actions; the compute order stays ours.
    lowered = torch_lowered_order(schedule)
    assert {r: [a for a in acts if COMPUTE.match(a)] for r, acts in lowered.items()} == _ours(schedule)


# --- (a) anchors, (b) list scheduler, (c) tuner ------------------------------------------------------


@pytest.mark.parametrize("name", ANCHOR_SCHEDULES)
def test_anchor_loads_unchanged(name):
    _assert_torch_agrees(ANCHOR_SCHEDULES[name]())


@pytest.mark.parametrize("split_backward", [True, False], ids=["IW", "B"])
@pytest.mark.parametrize("placement_name", PLACEMENTS)
def test_list_schedule_for_gemma_loads_unchanged(placement_name, split_backward):
    schedule = _list_scheduled(placement_name, split_backward)
    kinds = {a.kind.value for order in schedule.orders for a in order}
    assert kinds == ({"F", "I", "W"} if split_backward else {"F", "B"})
    _assert_torch_agrees(schedule)


def test_tuned_gemma_schedule_loads_unchanged():
    result = tune(_gemma(), TuneConfig(num_devices=P, num_microbatches=M, time_budget=2.0))
    _assert_torch_agrees(result.best.schedule)


# --- (e) stage -> rank map ---------------------------------------------------------------------------


@pytest.mark.parametrize("placement_name", ["seq", "v", "irregular"])
def test_torch_infers_our_placement(placement_name):
    schedule = _list_scheduled(placement_name, split_backward=True)
    assert torch_stage_to_rank(schedule) == _placement_map(schedule)
    assert torch_pipeline_order(schedule) == _ours(schedule)


def _comms(lowered: dict[int, list[str]], kind: str) -> list[tuple[int, str, int]]:
    """(stage, F|B, microbatch) of every SEND or RECV action."""
    return [
        (int(m[1]), m[3], int(m[4]))
        for acts in lowered.values()
        for a in acts
        if (m := COMM.match(a)) and m[2] == kind
    ]


def test_v_placement_keeps_the_turn_local():
    schedule = anchors.zb_v(P, M)
    sends = _comms(torch_lowered_order(schedule), "SEND")
    # On a V the two middle stages share the last device, so torch sends nothing between them;
    # every other boundary crosses devices: one SEND_F and one SEND_B per microbatch each.
    assert not [x for x in sends if x[:2] in ((P - 1, "F"), (P, "B"))]
    assert len(sends) == len(set(sends)) == 2 * (2 * P - 2) * M


@pytest.mark.parametrize("defer_pp_recv", [False, True], ids=["asap", "deferred"])
def test_lowering_pairs_every_send_with_a_recv(defer_pp_recv):
    lowered = torch_lowered_order(
        _list_scheduled("irregular", split_backward=True), defer_pp_recv=defer_pp_recv
    )
    sends, recvs = _comms(lowered, "SEND"), _comms(lowered, "RECV")
    # sSEND_Fm feeds (s+1)RECV_Fm; sSEND_Bm feeds (s-1)RECV_Bm.
    expected = sorted((s + 1 if d == "F" else s - 1, d, m) for s, d, m in sends)
    assert sorted(recvs) == expected
    # Device 1 holds stages 1 and 2, so that boundary is a local hand-off.
    assert (1, "F") not in {x[:2] for x in sends} and (2, "B") not in {x[:2] for x in sends}
    assert len(sends) == 2 * 3 * M  # boundaries 0|1, 2|3, 3|4, forward and backward


# --- (d) what torch rejects --------------------------------------------------------------------------


def test_cyclic_order_is_rejected_when_lowered():
    # Device 0 waits for 1B0 before 0F1; device 1 runs microbatch 1 first, which needs 0F1. Each
    # device's own order is valid (F before B), so only the cross-device lowering sees the cycle.
    cyclic = _schedule(
        "0F0,0B0,0F1,0B1 | 1F1,1B1,1F0,1B0", num_stages=2, num_microbatches=2, placement=(0, 1)
    )
    cyclic.validate()  # our validate does not look for deadlock
    with pytest.raises(ScheduleError, match="Malformed compute schedule, can't schedule sends/recvs"):
        load_into_torch_runtime(cyclic)


def test_backward_before_forward_is_rejected_when_loaded():
    # The brief's example (device 0: 0B0,0F0) never reaches lowering: torch's _validate_schedule
    # already refuses a B that precedes its own F on the same stage.
    bad = _schedule("0B0,0F0 | 1F0,1B0", num_stages=2, num_microbatches=1, placement=(0, 1))
    with pytest.raises(
        ScheduleError, match="Full Backward for stage 0, microbatch 0 without first running Forward"
    ):
        load_into_torch_runtime(bad)


def test_idle_device_is_rejected():
    # Our IR allows a device with no stage; torch's _add_send_recv asserts every rank has actions.
    idle = _schedule("0F0,1F0,1B0,0B0 |", num_stages=2, num_microbatches=1, placement=(0, 0))
    idle.validate()
    with pytest.raises(ScheduleError, match=r"rank=1"):
        load_into_torch_runtime(idle)


def test_missing_backward_is_rejected():
    bad = _schedule("0F0,0I0 | 1F0,1B0", num_stages=2, num_microbatches=1, placement=(0, 1))
    with pytest.raises(ScheduleError, match="I and W must have equal counts"):
        load_into_torch_runtime(bad)


def test_missing_private_api_names_it(monkeypatch):
    from torch.distributed.pipelining import schedules

    monkeypatch.delattr(schedules._PipelineScheduleRuntime, "_prepare_schedule_with_comms")
    with pytest.raises(RuntimeError, match=r"_PipelineScheduleRuntime\._prepare_schedule_with_comms"):
        torch_pipeline_order(anchors.gpipe(2, 2))


def test_schedule_name_with_path_separators_loads():
    # Tuner recipes name schedules like "list(+1,IW)/v/searched"; the temp CSV must not use them.
    schedule = _list_scheduled("v", split_backward=True)
    renamed = Schedule(
        name="list(+1,IW)/v/searched",
        num_stages=schedule.num_stages,
        num_microbatches=schedule.num_microbatches,
        placement=schedule.placement,
        orders=schedule.orders,
    )
    assert torch_pipeline_order(renamed) == _ours(schedule)


# --- real stages ---------------------------------------------------------------------------------


@pytest.fixture
def fake_group():
    """A 4-rank "fake" process group seen from rank 1: PipelineStage needs one, nothing is sent."""
    import torch.distributed as dist

    fake_pg = pytest.importorskip("torch.testing._internal.distributed.fake_pg")
    dist.init_process_group("fake", store=fake_pg.FakeStore(), rank=1, world_size=P)
    try:
        yield dist.group.WORLD
    finally:
        dist.destroy_process_group()


def test_real_stages_get_the_inferred_v_map(fake_group):
    import torch
    from torch.distributed.pipelining import PipelineStage

    schedule = anchors.zb_v(P, M)
    stages = [
        PipelineStage(torch.nn.Linear(4, 4), s, schedule.num_stages, torch.device("cpu"), group=fake_group)
        for s in schedule.stages_of(1)
    ]
    runtime = load_into_torch_runtime(schedule, stages=stages, rank=1, loss_fn=torch.nn.MSELoss())
    # torch's constructor first gives the stages its default loop map (stage 4 -> rank 0); loading
    # replaces it with the V map read from the CSV.
    for stage in stages:
        assert stage.stage_index_to_group_rank == _placement_map(schedule)
    assert runtime.rank == 1


def test_stages_of_the_wrong_rank_are_refused():
    from types import SimpleNamespace

    wrong = [SimpleNamespace(stage_index=1, group_rank=0, group_size=P)]
    with pytest.raises(ValueError, match=r"must hold stages \[0\]"):
        load_into_torch_runtime(anchors.gpipe(P, M), stages=wrong, rank=0)
