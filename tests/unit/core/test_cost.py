import math

import pytest
from hypothesis import given
from hypothesis import strategies as st

from steptune.core.cost import (
    Collective,
    all_gather_time,
    all_reduce_time,
    compute_time,
    group_collective_time,
    p2p_time,
    reduce_scatter_time,
)
from steptune.core.specs import LinkSpec, cluster_preset

LINK = LinkSpec(name="test", bandwidth=100e9, latency=10e-6)


def test_p2p_and_compute():
    assert p2p_time(1e9, LINK) == pytest.approx(10e-6 + 0.01)
    dev = cluster_preset("dgx-h100").device
    assert compute_time(989e12, dev, efficiency=0.5) == pytest.approx(2.0)
    with pytest.raises(ValueError):
        compute_time(1.0, dev, efficiency=0.0)


def test_ring_all_gather_formula():
    s = 8e9
    assert all_gather_time(s, 8, LINK, "ring") == pytest.approx(7 * 10e-6 + 7 / 8 * s / 100e9)
    assert reduce_scatter_time(s, 8, LINK) == all_gather_time(s, 8, LINK)
    assert all_gather_time(s, 1, LINK) == 0.0


def test_recursive_doubling_vs_ring():
    # Same bytes on the wire, log2(W) instead of W-1 latency steps.
    small, big = 1e3, 1e11
    ring_s, rd_s = all_gather_time(small, 64, LINK, "ring"), all_gather_time(small, 64, LINK, "recursive")
    assert rd_s == pytest.approx(6 * 10e-6 + 63 / 64 * small / 100e9)
    assert rd_s < ring_s / 5  # latency-bound: 6 steps instead of 63
    ring_b, rd_b = all_gather_time(big, 64, LINK, "ring"), all_gather_time(big, 64, LINK, "recursive")
    assert rd_b < ring_b and rd_b / ring_b > 0.999  # bandwidth-bound: the same
    with pytest.raises(ValueError, match="power-of-two"):
        all_gather_time(small, 6, LINK, "recursive")


def test_all_reduce_variants():
    s, w = 4e9, 16
    ring = all_reduce_time(s, w, LINK, "ring")
    assert ring == pytest.approx(2 * all_gather_time(s, w, LINK, "ring"))
    rab = all_reduce_time(s, w, LINK, "rabenseifner")
    assert rab == pytest.approx(2 * all_gather_time(s, w, LINK, "recursive"))
    rd = all_reduce_time(s, w, LINK, "recursive")
    assert rd == pytest.approx(4 * 10e-6 + 4 * s / 100e9)  # full vector every step
    assert rd > 2 * ring  # recursive doubling is a poor choice for large messages
    tree = all_reduce_time(s, w, LINK, "tree")
    assert tree == pytest.approx(2 * 4 * 10e-6 + 2 * s / 100e9)
    with pytest.raises(ValueError, match="ring or recursive"):
        all_gather_time(s, w, LINK, "tree")


def test_hierarchical_group_collective():
    c = cluster_preset("dgx-h100")
    s = 2e9
    within = group_collective_time(Collective.ALL_GATHER, s, 8, c)
    assert within == pytest.approx(all_gather_time(s, 8, c.intra))
    across = group_collective_time(Collective.ALL_GATHER, s, 64, c)
    assert across == pytest.approx(all_gather_time(s, 8, c.intra) + all_gather_time(s / 8, 8, c.inter))
    assert across > within
    ar = group_collective_time(Collective.ALL_REDUCE, s, 16, c)
    assert ar == pytest.approx(2 * reduce_scatter_time(s, 8, c.intra) + all_reduce_time(s / 8, 2, c.inter))
    with pytest.raises(ValueError, match="multiple of gpus_per_node"):
        group_collective_time(Collective.ALL_GATHER, s, 12, c)
    with pytest.raises(ValueError, match="does not fit"):
        group_collective_time(Collective.ALL_GATHER, s, 1024, c)


@given(st.floats(1.0, 1e11), st.sampled_from([2, 4, 8, 16, 32, 64]))
def test_collectives_monotone_and_bounded(nbytes, world):
    for algo in ("ring", "recursive"):
        t = all_gather_time(nbytes, world, LINK, algo)
        assert t >= nbytes / LINK.bandwidth * (world - 1) / world
        assert all_gather_time(nbytes * 2, world, LINK, algo) > t
    assert all_reduce_time(nbytes, world, LINK, "ring") <= 2 * (world - 1) * LINK.latency + 2 * nbytes / 100e9
    assert math.isfinite(all_reduce_time(nbytes, world, LINK, "tree"))
