"""Fail-stop survival: SIGKILL one rank mid-step; the survivors continue without a restart.

Both jobs are checked against ``live.reference_losses``: the same training in one process, no failure.
"""

import pytest

from steptune.resilience.failstop import compare_failstop
from steptune.resilience.failstop_pipe import compare_failstop_pipe, reference_model
from steptune.resilience.failstop_tp import compare_failstop_tp
from steptune.resilience.failstop_tp import reference_model as reference_model_tp
from steptune.resilience.live import proxy_model, reference_losses

pytestmark = [pytest.mark.dist, pytest.mark.timeout(400)]


def test_dp_survivors_continue_in_place_and_match_the_failure_free_run():
    spec = {"ranks": 4, "steps": 12, "seed": 0, "kill_rank": 2, "kill_step": 7, "checkpoint_every": 4,
            "time_scale": 0.005}  # fmt: skip
    res = compare_failstop(spec, reference=reference_losses(spec, proxy_model(0)))
    summary = {k: v for k, v in res.items() if k != "losses"}
    assert res["survivors"] == [0, 1, 3], summary
    assert res["steps_completed"] == {"reference": 12, "survive": 12, "restart": 12}, summary
    # same data in the same order: the trajectory equals the failure-free one up to fp32 summation order
    assert res["max_loss_rel_diff"]["survive"] <= 1e-5, summary
    assert res["max_loss_rel_diff"]["restart"] <= 1e-5, summary
    assert res["wall_s"]["survive"] < res["wall_s"]["restart"], summary


def test_pp_dead_stage_comes_back_from_its_dp_peer():
    # dp=2 x pp=2; rank 3 (pipeline 1, stage 1) dies mid-1F1B in step 7. Rank 2 is left without a
    # partner: it takes stage 1's layers (weights and momentum) from rank 1 and runs the whole model.
    spec = {"dp": 2, "pp": 2, "steps": 12, "seed": 0, "kill_rank": 3, "kill_step": 7,
            "checkpoint_every": 4, "time_scale": 0.005}  # fmt: skip
    res = compare_failstop_pipe(spec, reference=reference_losses(spec, reference_model(spec)))
    summary = {k: v for k, v in res.items() if k != "losses"}
    assert res["survivors"] == [0, 1, 2], summary
    assert res["steps_completed"] == {"reference": 12, "survive": 12, "restart": 12}, summary
    (rec,) = res["recovery"]["survive"]["recoveries"]
    assert rec["from"] == "peers" and rec["step"] == 7, summary
    assert rec["pipes"] == [[(0, 0, 4), (1, 4, 8)], [(2, 0, 8)]], summary
    assert sorted(rec["moves"]) == [(i, 1, 2) for i in range(4, 8)], summary
    (back,) = res["recovery"]["restart"]["recoveries"]
    assert back == {"from": "checkpoint", "step": 4, "pipes": rec["pipes"]}, summary
    assert res["max_loss_rel_diff"]["survive"] <= 1e-5, summary
    assert res["max_loss_rel_diff"]["restart"] <= 1e-5, summary
    assert res["wall_s"]["survive"] < res["wall_s"]["restart"], summary


def test_tp_dead_member_shard_comes_back_from_its_dp_peer():
    # dp=2 x tp=2; rank 3 (replica 1's second member) dies mid-step 7 while rank 2 waits on its partial
    # sums. Rank 2 becomes a TP-1 replica: units 4-7 (weights and momentum) come from rank 1.
    spec = {"dp": 2, "tp": 2, "steps": 12, "seed": 0, "kill_rank": 3, "kill_step": 7, "time_scale": 0.005}
    model, forward = reference_model_tp(spec)
    res = compare_failstop_tp(spec, reference=reference_losses(spec, model, forward))
    summary = {k: v for k, v in res.items() if k != "losses"}
    assert res["survivors"] == [0, 1, 2], summary
    assert res["steps_completed"] == {"reference": 12, "survive": 12}, summary
    (rec,) = res["recovery"]["survive"]["recoveries"]
    assert rec["from"] == "peers" and rec["step"] == 7, summary
    assert rec["owners"] == ((0, 0, 0, 0, 1, 1, 1, 1), (2,) * 8), summary
    assert sorted(rec["moves"]) == [(u, 1, 2) for u in range(4, 8)], summary
    assert res["max_loss_rel_diff"]["survive"] <= 1e-5, summary
