"""Fail-stop survival: SIGKILL one rank mid-step; the survivors continue without a restart.

Both jobs are checked against ``live.reference_losses``: the same training in one process, no failure.
"""

import pytest

from steptune.resilience.failstop import compare_failstop, run_failstop
from steptune.resilience.failstop_pipe import compare_failstop_pipe, reference_model, run_failstop_pipe
from steptune.resilience.failstop_tp import _tp_worker, compare_failstop_tp
from steptune.resilience.failstop_tp import reference_model as reference_model_tp
from steptune.resilience.live import proxy_model, reference_losses

pytestmark = [pytest.mark.dist, pytest.mark.timeout(400)]


def test_dp_survivors_continue_in_place_and_match_the_failure_free_run():
    spec = {"ranks": 4, "steps": 10, "seed": 0, "kill_rank": 2, "kill_step": 6, "checkpoint_every": 4,
            "time_scale": 0.005}  # fmt: skip
    res = compare_failstop(spec, reference=reference_losses(spec, proxy_model(0)))
    summary = {k: v for k, v in res.items() if k != "losses"}
    assert res["survivors"] == [0, 1, 3], summary
    assert res["steps_completed"] == {"reference": 10, "survive": 10, "restart": 10}, summary
    # same data in the same order: the trajectory equals the failure-free one up to fp32 summation order
    assert res["max_loss_rel_diff"]["survive"] <= 1e-5, summary
    assert res["max_loss_rel_diff"]["restart"] <= 1e-5, summary
    assert res["wall_s"]["survive"] < res["wall_s"]["restart"], summary


def test_a_second_death_during_recovery_is_survived_too():
    # Rank 1 dies in step 3; rank 2 dies as it rejoins, once the launcher has listed it among the survivors
    # (generation 1): ranks 0 and 3 wait for its announcement until the launcher's next list supersedes it.
    spec = {"ranks": 4, "steps": 6, "seed": 0, "kill_rank": 1, "kill_step": 3, "recovery_kills": [[2, 1]],
            "time_scale": 0.005, "mode": "survive", "timeout_s": 120}  # fmt: skip
    res = run_failstop(spec)
    ref = reference_losses(spec, proxy_model(0))
    assert res["survivors"] == [0, 3], res
    assert res["info"]["generation"] == 2, res  # generation 1 listed rank 2 and was superseded
    assert sorted(res["losses"]) == list(range(6)), res
    assert max(abs(res["losses"][k] - ref[k]) / abs(ref[k]) for k in range(6)) <= 1e-5, res


def test_pp_dead_stages_come_back_from_dp_peers_twice():
    # dp=2 x pp=2. Step 5: rank 3 (pipeline 1, stage 1) dies mid-1F1B; rank 2 takes stage 1's layers
    # (weights and momentum) from rank 1 and runs the whole model. Step 9: rank 1 dies; rank 0 takes
    # them from rank 2. The restart baseline restarts twice from the checkpoints of steps 4 and 8.
    spec = {"dp": 2, "pp": 2, "steps": 12, "seed": 0, "kills": [[3, 5], [1, 9]],
            "checkpoint_every": 4, "time_scale": 0.005}  # fmt: skip
    res = compare_failstop_pipe(spec, reference=reference_losses(spec, reference_model(spec)))
    summary = {k: v for k, v in res.items() if k != "losses"}
    assert res["survivors"] == [0, 2], summary
    assert res["steps_completed"] == {"reference": 12, "survive": 12, "restart": 12}, summary
    first, second = res["recovery"]["survive"]["recoveries"]
    assert first["from"] == "peers" and first["step"] == 5, summary
    assert first["pipes"] == [[(0, 0, 4), (1, 4, 8)], [(2, 0, 8)]], summary
    assert sorted(first["moves"]) == [(i, 1, 2) for i in range(4, 8)], summary
    assert second["from"] == "peers" and second["step"] == 9, summary
    assert second["pipes"] == [[(2, 0, 8)], [(0, 0, 8)]], summary
    assert sorted(second["moves"]) == [(i, 2, 0) for i in range(4, 8)], summary
    assert [(r["from"], r["step"]) for r in res["recovery"]["restart"]["recoveries"]] == [
        ("checkpoint", 8)
    ], summary  # the info of the last (second) restart
    assert res["max_loss_rel_diff"]["survive"] <= 1e-5, summary
    assert res["max_loss_rel_diff"]["restart"] <= 1e-5, summary
    assert res["wall_s"]["survive"] < res["wall_s"]["restart"], summary


def test_tp_dead_members_shards_come_back_from_dp_peers_twice():
    # dp=2 x tp=2. Step 5: rank 3 (replica 1's second member) dies while rank 2 waits on its partial sums;
    # rank 2 becomes a TP-1 replica with units 4-7 from rank 1. Step 9: rank 1 dies; rank 0 takes units
    # 4-7 from rank 2, the only copy left.
    spec = {"dp": 2, "tp": 2, "steps": 12, "seed": 0, "kills": [[3, 5], [1, 9]], "time_scale": 0.005}
    model, forward = reference_model_tp(spec)
    res = compare_failstop_tp(spec, reference=reference_losses(spec, model, forward))
    summary = {k: v for k, v in res.items() if k != "losses"}
    assert res["survivors"] == [0, 2], summary
    assert res["steps_completed"] == {"reference": 12, "survive": 12}, summary
    first, second = res["recovery"]["survive"]["recoveries"]
    assert first["step"] == 5 and first["owners"] == ((0, 0, 0, 0, 1, 1, 1, 1), (2,) * 8), summary
    assert sorted(first["moves"]) == [(u, 1, 2) for u in range(4, 8)], summary
    assert second["step"] == 9 and second["owners"] == ((0,) * 8, (2,) * 8), summary
    assert sorted(second["moves"]) == [(u, 2, 0) for u in range(4, 8)], summary
    assert res["max_loss_rel_diff"]["survive"] <= 1e-5, summary


def test_a_death_during_the_pp_state_copy_falls_back_to_the_checkpoint_on_every_survivor(tmp_path):
    # Step 5: rank 3 dies; rank 1 is to copy stage 1's layers to rank 2 and dies instead. Rank 0 takes no
    # part in the copy: only the commit all-reduce tells it that the copy failed. Stage 1's layers are then
    # lost in both pipelines, so ranks 0 and 2 both go back to the checkpoint of step 4.
    spec = {"dp": 2, "pp": 2, "steps": 8, "seed": 0, "kills": [[3, 5]], "copy_kills": [[1, 1]],
            "checkpoint": str(tmp_path / "ckpt"), "checkpoint_every": 4, "time_scale": 0.005,
            "mode": "survive", "timeout_s": 150}  # fmt: skip
    res = run_failstop_pipe(spec)
    ref = reference_losses(spec, reference_model(spec))
    assert res["survivors"] == [0, 2], res
    assert [(r["from"], r["step"]) for r in res["info"]["recoveries"]] == [("aborted", 5), ("checkpoint", 4)]
    assert sorted(res["losses"]) == list(range(8)), res
    assert max(abs(res["losses"][k] - ref[k]) / abs(ref[k]) for k in range(8)) <= 1e-5, res


def test_a_death_during_the_tp_shard_copy_is_retried_among_the_rest():
    # Step 5: rank 3 dies; rank 0 dies as rank 1 copies units 4-7 to rank 2. The commit fails on both, they
    # keep the old owners, rejoin, and each becomes a TP-1 replica holding all eight units.
    spec = {"dp": 2, "tp": 2, "ranks": 4, "steps": 7, "seed": 0, "kills": [[3, 5]], "copy_kills": [[0, 1]],
            "time_scale": 0.005, "mode": "survive", "timeout_s": 150}  # fmt: skip
    res = run_failstop(spec, _tp_worker)
    model, forward = reference_model_tp(spec)
    ref = reference_losses(spec, model, forward)
    assert res["survivors"] == [1, 2], res
    recoveries = res["info"]["recoveries"]
    assert [(r["from"], r["step"]) for r in recoveries] == [("aborted", 5), ("peers", 5)], res
    assert recoveries[1]["owners"] == ((1,) * 8, (2,) * 8), res
    assert max(abs(res["losses"][k] - ref[k]) / abs(ref[k]) for k in range(7)) <= 1e-5, res


def test_a_commit_that_completes_on_some_survivors_only_is_adopted_by_the_rest():
    # Step 5: rank 3 dies; rank 1 copies stage 1's layers to rank 2, and the commit all-reduce that ends
    # the copy splits as a death inside it can split it: it completes on rank 1, rank 0 dies right after,
    # and rank 2 sees it fail. Rank 2 must adopt the layout rank 1 committed (its copy was whole: rank 1's
    # all-reduce could only complete once rank 2 had contributed), then both recover rank 0's stage.
    spec = {"dp": 2, "pp": 2, "steps": 8, "seed": 0, "kills": [[3, 5]], "commit_kills": [[0, 1]],
            "commit_misses": [[2, 1]], "time_scale": 0.005, "mode": "survive", "timeout_s": 150}  # fmt: skip
    res = run_failstop_pipe(spec)
    ref = reference_losses(spec, reference_model(spec))
    assert res["survivors"] == [1, 2], res
    committed = [(r["from"], r["step"]) for r in res["infos"][1]["recoveries"]]
    adopted = [(r["from"], r["step"]) for r in res["infos"][2]["recoveries"]]
    assert committed == [("peers", 5), ("peers", 5)], res
    assert adopted == [("aborted", 5), ("committed by peers", 5), ("peers", 5)], res
    assert res["infos"][1]["pipes"] == res["infos"][2]["pipes"] == [[(2, 0, 8)], [(1, 0, 8)]], res
    assert sorted(res["losses"]) == list(range(8)), res
    assert max(abs(res["losses"][k] - ref[k]) / abs(ref[k]) for k in range(8)) <= 1e-5, res


def test_a_split_tp_commit_is_adopted_by_the_survivor_that_saw_it_fail():
    # As above with dp=2 x tp=2: rank 1 copies units 4-7 to rank 2; the commit completes on rank 1,
    # rank 0 dies right after, rank 2 sees it fail and adopts rank 1's owners; then rank 1 takes units 0-3.
    spec = {"dp": 2, "tp": 2, "ranks": 4, "steps": 7, "seed": 0, "kills": [[3, 5]],
            "commit_kills": [[0, 1]], "commit_misses": [[2, 1]], "time_scale": 0.005, "mode": "survive",
            "timeout_s": 150}  # fmt: skip
    res = run_failstop(spec, _tp_worker)
    model, forward = reference_model_tp(spec)
    ref = reference_losses(spec, model, forward)
    assert res["survivors"] == [1, 2], res
    adopted = res["infos"][2]["recoveries"]
    froms = [(r["from"], r["step"]) for r in adopted]
    assert froms == [("aborted", 5), ("committed by peers", 5), ("peers", 5)], res
    assert adopted[1]["owners"] == ((0, 0, 0, 0, 1, 1, 1, 1), (2,) * 8), res
    assert res["infos"][1]["owners"] == res["infos"][2]["owners"] == ((1,) * 8, (2,) * 8), res
    assert max(abs(res["losses"][k] - ref[k]) / abs(ref[k]) for k in range(7)) <= 1e-5, res


def test_a_step_whose_all_reduce_completes_on_some_survivors_only_is_rolled_back_there():
    # Step 3's gradient all-reduce splits as a death inside it can split it: it completes on ranks 0, 1
    # and 3, rank 1 dies right after, rank 2 sees it fail. Ranks 0 and 3 have stepped and fail in step 4;
    # the survivors resume from step 3, so those two go back to their snapshot of step 3's start.
    spec = {"ranks": 4, "steps": 6, "seed": 0, "sync_kills": [[1, 3]], "sync_misses": [[2, 3]],
            "time_scale": 0.005, "mode": "survive", "timeout_s": 120}  # fmt: skip
    res = run_failstop(spec)
    ref = reference_losses(spec, proxy_model(0))
    assert res["survivors"] == [0, 2, 3], res
    assert sorted(res["losses"]) == list(range(6)), res
    assert max(abs(res["losses"][k] - ref[k]) / abs(ref[k]) for k in range(6)) <= 1e-5, res


def test_a_split_last_step_is_redone_by_the_survivors_whose_all_reduce_failed():
    # The last step's all-reduce completes on ranks 0, 1 and 3, rank 1 dies right after, rank 2 sees it
    # fail. Ranks 0 and 3 are done and exit; before, rank 2 waited for them to rejoin and timed out
    # after 50 s, and the run still reported success with survivors [0, 3].
    spec = {"ranks": 4, "steps": 6, "seed": 0, "sync_kills": [[1, 5]], "sync_misses": [[2, 5]],
            "time_scale": 0.005, "mode": "survive", "timeout_s": 120}  # fmt: skip
    res = run_failstop(spec)
    ref = reference_losses(spec, proxy_model(0))
    assert res["survivors"] == [0, 2, 3], res
    assert res["infos"][2]["generation"] >= 1 and res["infos"][0]["generation"] == 0, (
        res
    )  # 1 to 3: see elastic
    assert res["wall_s"] < 40, res
    for r in (0, 2, 3):
        losses = res["losses_by_rank"][r]
        assert max(abs(losses[k] - ref[k]) / abs(ref[k]) for k in range(6)) <= 1e-5, res


def test_a_split_step_in_the_pipeline_job_rolls_back_then_copies_the_lost_stage():
    # dp=2 x pp=2: step 5's all-reduce completes on ranks 0, 1 and 3, rank 3 dies right after, rank 2
    # sees it fail. Ranks 0 and 1 roll back to step 5; rank 2 then takes stage 1's layers from rank 1.
    spec = {"dp": 2, "pp": 2, "steps": 8, "seed": 0, "sync_kills": [[3, 5]], "sync_misses": [[2, 5]],
            "time_scale": 0.005, "mode": "survive", "timeout_s": 150}  # fmt: skip
    res = run_failstop_pipe(spec)
    ref = reference_losses(spec, reference_model(spec))
    assert res["survivors"] == [0, 1, 2], res
    for r in (0, 1, 2):
        assert [(x["from"], x["step"]) for x in res["infos"][r]["recoveries"]] == [("peers", 5)], res
    assert sorted(res["losses"]) == list(range(8)), res
    assert max(abs(res["losses"][k] - ref[k]) / abs(ref[k]) for k in range(8)) <= 1e-5, res


def test_a_split_step_in_the_tp_job_rolls_back_then_copies_the_lost_shard():
    spec = {"dp": 2, "tp": 2, "ranks": 4, "steps": 7, "seed": 0, "sync_kills": [[3, 5]],
            "sync_misses": [[2, 5]], "time_scale": 0.005, "mode": "survive", "timeout_s": 150}  # fmt: skip
    res = run_failstop(spec, _tp_worker)
    model, forward = reference_model_tp(spec)
    ref = reference_losses(spec, model, forward)
    assert res["survivors"] == [0, 1, 2], res
    assert res["infos"][2]["owners"] == ((0, 0, 0, 0, 1, 1, 1, 1), (2,) * 8), res
    assert max(abs(res["losses"][k] - ref[k]) / abs(ref[k]) for k in range(7)) <= 1e-5, res
