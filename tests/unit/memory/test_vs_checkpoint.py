"""Replay-only TapeSAC against torch's full checkpointing (early stop on and off), same model, same
batch: it recomputes fewer ops, no more FLOPs or bytes, and its MemTracker peak is no higher."""

import pytest

from steptune.memory.compare import compare, compare_table
from steptune.memory.measure import POLICIES

pytestmark = pytest.mark.timeout(180)


@pytest.fixture(scope="module", params=["qwen3-tiny", "qwen3-moe-tiny"])
def result(request):
    return compare(request.param, timed=False)


def test_every_policy_matches_no_checkpointing_gradients(result):
    assert [r["policy"] for r in result["rows"]] == list(POLICIES)
    assert all(r["grad_max_abs_diff"] == 0.0 for r in result["rows"])


@pytest.mark.parametrize("anchor", ["full_ac", "full_ac_no_early_stop"])
def test_tapesac_recomputes_less_and_peaks_no_higher(result, anchor):
    rows = {r["policy"]: r for r in result["rows"]}
    tape, ac = rows["tapesac_replay"], rows[anchor]
    assert 0 < tape["recompute_ops"] < ac["recompute_ops"]
    assert tape["recompute_flops"] <= ac["recompute_flops"]
    assert tape["recompute_bytes"] <= ac["recompute_bytes"]
    assert tape["peak_bytes"] <= ac["peak_bytes"]
    assert tape["activation_peak_bytes"] < rows["no_ac"]["activation_peak_bytes"]


def test_dense_block_skips_the_dead_tail_that_torchtitan_recomputes():
    # early_stop=False reruns the down projection and residual add no backward node reads.
    rows = {
        r["policy"]: r
        for r in compare(
            "qwen3-tiny", timed=False, policies=("no_ac", "full_ac_no_early_stop", "tapesac_replay")
        )["rows"]
    }
    assert rows["tapesac_replay"]["recompute_flops"] < 0.85 * rows["full_ac_no_early_stop"]["recompute_flops"]


def test_table_labels_its_measurements(result):
    table = compare_table(result)
    assert len(table.rows) == len(POLICIES)
    assert any("MEASURED" in note for note in table.notes)
