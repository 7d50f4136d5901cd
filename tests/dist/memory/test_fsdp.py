"""TapeSAC inside FSDP2 (2 spawned gloo ranks): exact shards, one tape, torch checkpointing's peak."""

import pytest

from steptune.testing.memory_fsdp import fsdp_rank
from steptune.testing.spawn import SpawnPool

pytestmark = [pytest.mark.dist, pytest.mark.timeout(300)]


def test_tapesac_under_fsdp2_trains_exactly_like_fsdp2_without_checkpointing():
    with SpawnPool(2, timeout=200, default_group=True) as pool:
        per_rank = pool.run(fsdp_rank)
    for r in per_rank:
        no_ac, full_ac = r["no_ac"], r["full_ac_no_early_stop"]
        for order in ("tapesac_after_shard", "tapesac_before_shard"):
            got = r[order]
            # the replay runs after FSDP2's pre-backward all-gather: bitwise the same training
            assert got["max_shard_diff"] == 0.0, order
            assert got["losses"] == no_ac["losses"], order
            # three identical layers over three steps: each recorded on its first call (and sharing one
            # tape), replayed on every backward
            assert (got["recorded"], got["forwards"], got["replays"]) == (3, 9, 9), order
            # activations are dropped as with torch's checkpointing, not held by the tape
            assert got["peak"] <= full_ac["peak"] < no_ac["peak"], order
