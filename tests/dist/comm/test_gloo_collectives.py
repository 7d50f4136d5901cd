"""TIDE's collectives and self-test on real gloo groups, ranks as threads (W up to 8)."""

import pytest
import torch

import steptune.comm.selftest as selftest_mod
from steptune.comm.bench import rs_staging_bench
from steptune.comm.config import TideConfig
from steptune.comm.selftest import self_test
from steptune.testing import run_threads

pytestmark = [pytest.mark.dist, pytest.mark.timeout(300)]


@pytest.mark.parametrize("w", [2, 3, 5, 8])
def test_self_test_passes_on_gloo(w):
    for algorithm in ("rd", "direct"):
        cfg = TideConfig(ag_algorithm=algorithm)
        results = run_threads(lambda r, g, cfg=cfg: self_test(g, torch.device("cpu"), cfg), w, timeout=60)
        assert results == [None] * w


def test_a_broken_collective_fails_the_self_test_on_every_rank(monkeypatch):
    real = selftest_mod.all_gather_into

    def broken(layout, slot, shards, transport, **kw):
        real(layout, slot, shards, transport, **kw)
        if transport.rank == 1:
            slot[layout.slot_offset(0)] += 1  # one wrong element on one rank

    monkeypatch.setattr(selftest_mod, "all_gather_into", broken)
    verdicts = run_threads(lambda r, g: self_test(g, torch.device("cpu"), TideConfig()), 3, timeout=60)
    assert "all-gather of parameter 0" in verdicts[1]
    assert verdicts[0] == verdicts[2] == "another rank's self-test failed"


def test_rs_staging_is_flat_in_w_where_stock_grows_linearly():
    res = rs_staging_bench((2, 4, 8), rows_per_rank=64, cols=64, chunk_numel=2048, reps=1)["by_world_size"]
    tide = {int(w): row["tide_bytes"] for w, row in res.items()}
    stock = {int(w): row["stock_bytes"] for w, row in res.items()}
    assert len(set(tide.values())) == 1
    assert stock[8] > 3.9 * stock[2] and stock[4] > 1.9 * stock[2]
    assert all(row["max_rel_diff"] <= 1e-6 for row in res.values())
