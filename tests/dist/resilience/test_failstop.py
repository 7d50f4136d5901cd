"""Fail-stop survival: SIGKILL one of 4 DP ranks mid-step; the survivors continue without a restart."""

import pytest

from steptune.resilience.failstop import compare_failstop

pytestmark = [pytest.mark.dist, pytest.mark.timeout(400)]


def test_survivors_continue_in_place_and_match_the_failure_free_run():
    res = compare_failstop(
        {"ranks": 4, "steps": 12, "kill_rank": 2, "kill_step": 7, "checkpoint_every": 4, "time_scale": 0.005}
    )
    summary = {k: v for k, v in res.items() if k != "losses"}
    assert res["survivors"] == [0, 1, 3], summary
    assert res["steps_completed"] == {"reference": 12, "survive": 12, "restart": 12}, summary
    # same data in the same order: the trajectory equals the failure-free one up to fp32 summation order
    assert res["max_loss_rel_diff"]["survive"] <= 1e-5, summary
    assert res["max_loss_rel_diff"]["restart"] <= 1e-5, summary
    assert res["wall_s"]["survive"] < res["wall_s"]["restart"], summary
