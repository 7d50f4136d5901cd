"""`steptune pipeline run` on spawned gloo ranks: our executor, torch's runtime, the gradient check."""

import json

import pytest

from steptune.cli import main
from steptune.pipeline import anchors
from steptune.pipeline.costs import uniform_partition

pytestmark = [pytest.mark.dist, pytest.mark.slow, pytest.mark.timeout(300)]


def test_run_tiny_decoder_on_two_ranks_checks_gradients_and_torch(tmp_path, capsys):
    from dataclasses import replace

    sched = anchors.zb_v(2, 4)
    sched = replace(sched, partition=uniform_partition(6, sched.num_stages)).validate()
    path = sched.save(tmp_path / "zbv.json")
    out = tmp_path / "run.json"
    assert (
        main(
            [
                "pipeline",
                "run",
                "--schedule",
                str(path),
                "--model",
                "tiny-decoder",
                "--ranks",
                "2",
                "--repeats",
                "1",
                "--check",
                "--json",
                str(out),
            ]
        )
        == 0
    )
    report = json.loads(out.read_text())
    assert report["grad_max_rel_diff"] <= 1e-6
    assert report["measured_step_s"] > 0 and report["torch_runtime_step_s"] > 0
    printed = capsys.readouterr().out
    assert "our executor, step time (median of 1)" in printed and "torch.distributed.pipelining" in printed
    assert "x ours" in printed and "MEASURED" in printed


def test_run_refuses_a_rank_count_mismatch_and_missing_partition(tmp_path, capsys):
    path = anchors.one_f_one_b(2, 2).save(tmp_path / "nopart.json")
    assert main(["pipeline", "run", "--schedule", str(path), "--ranks", "2"]) == 2
    assert "no partition" in capsys.readouterr().err
    from dataclasses import replace

    with_part = replace(anchors.one_f_one_b(2, 2), partition=(2, 2)).save(tmp_path / "p.json")
    assert (
        main(["pipeline", "run", "--schedule", str(with_part), "--model", "tiny-decoder", "--ranks", "3"])
        == 2
    )
    assert "--ranks 3" in capsys.readouterr().err


def test_run_tiny_decoder_with_a_vocab_sharded_head_checks_gradients(tmp_path):
    # The tuner's head split, for real: the head's cross-entropy in 2 chained vocabulary shards on
    # different ranks (online softmax), gradients equal to the same layers in one process.
    from dataclasses import replace

    sched = anchors.one_f_one_b(2, 4)
    sched = replace(sched, partition=(3, 2), meta={**sched.meta, "head_split": 2}).validate()
    path = sched.save(tmp_path / "split.json")
    out = tmp_path / "run.json"
    args = ["pipeline", "run", "--schedule", str(path), "--model", "tiny-decoder", "--ranks", "2"]
    assert main([*args, "--repeats", "1", "--check", "--json", str(out)]) == 0
    report = json.loads(out.read_text())
    assert report["grad_max_rel_diff"] <= 1e-6
