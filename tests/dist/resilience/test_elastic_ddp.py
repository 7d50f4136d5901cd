"""``Elastic.ddp``: torch's DistributedDataParallel over the survivors. A rank SIGKILLed before its
backward makes the others' backward all-reduce fail inside DDP; they rejoin, rebuild DDP on the new group
and redo the step, on the losses of a failure-free single-process run."""

import pytest
from torch import nn

from steptune.core.dist import master_store
from steptune.resilience.elastic import Elastic, launch, toy_train

pytestmark = [pytest.mark.dist, pytest.mark.timeout(240)]

NO_FAULTS = (None, 0, None, None, None, None, None)  # toy_train's errors .. agent_kills


def _max_rel(losses, ref):
    return max(abs(losses[k] - ref[k]) / abs(ref[k]) for k in ref)


def _reference(steps):
    return toy_train(Elastic(master_store(), 0, [0], timeout_s=5), steps)


@pytest.mark.parametrize("mode", ["sum", "mean"])
def test_a_death_inside_ddps_backward_is_survived_on_the_failure_free_losses(mode):
    ref = _reference(8)
    res = launch(toy_train, 4, 8, [[2, 3]], *NO_FAULTS, mode, timeout_s=180)
    assert res["survivors"] == [0, 1, 3] and res["lost"] == {2: -9}, res
    for rank in (0, 1, 3):
        assert sorted(res["results"][rank]) == list(range(8)), res
        assert _max_rel(res["results"][rank], ref) <= 1e-5, res
        (rec,) = res["recoveries"][rank]
        assert rec == {"generation": 1, "failed_at_step": 3, "resume_step": 3, "members": [0, 1, 3]}, rec


def test_a_death_before_the_forward_breaks_ddps_buffer_broadcast_and_is_survived():
    # DDP broadcasts the model's buffers at the start of each forward: rank 1's death before its forward
    # makes that broadcast fail on the others, outside the gradient hook.
    ref = _reference(6)
    res = launch(toy_train, 3, 6, None, *NO_FAULTS, "sum", [[1, 2]], timeout_s=180)
    assert res["survivors"] == [0, 2] and res["lost"] == {1: -9}, res
    assert _max_rel(res["results"][0], ref) <= 1e-5, res
    assert [r["members"] for r in res["recoveries"][0]] == [[0, 2]], res


def test_an_error_of_the_users_code_under_ddp_still_stops_the_job():
    # A RuntimeError with no failed all-reduce behind it is not a death: the job stops with it.
    with pytest.raises(RuntimeError, match=r"rank 1 raised(.|\n)*injected: a bug in rank 1's step 2"):
        launch(toy_train, 3, 6, None, [[1, 2]], 0, None, None, None, None, None, "sum", timeout_s=120)


def test_ddp_on_one_rank_trains_as_the_plain_loop_and_refuses_a_group_of_its_own():
    ref = _reference(4)
    losses = toy_train(Elastic(master_store(), 0, [0], timeout_s=5), 4, None, *NO_FAULTS, "sum")
    assert _max_rel(losses, ref) <= 1e-6
    ctx = Elastic(master_store(), 0, [0], timeout_s=5)
    with pytest.raises(ValueError, match=r"\['process_group'\] cannot be given"):
        ctx.ddp(nn.Linear(2, 2), process_group=None)
