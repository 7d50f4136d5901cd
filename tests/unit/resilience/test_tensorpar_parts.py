"""Pieces of the live TP job: who holds which unit, what moves when a group shrinks, grows or re-splits."""

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from steptune.resilience.tensorpar import (
    _moves,
    equal_owners,
    held,
    members,
    replica_speed,
    uneven_owners,
)


def test_equal_owners_follow_group_position():
    assert equal_owners([(0, 1), (2, 3)], 8) == ((0,) * 4 + (1,) * 4, (2,) * 4 + (3,) * 4)
    assert equal_owners([(0, 1), (2,)], 8)[1] == (2,) * 8
    o = equal_owners([(0, 1, 2, 3)], 16)
    assert held(2, o) == range(8, 12) and held(5, o) == range(0)
    assert members(o[0]) == (0, 1, 2, 3)


def test_moves_when_excluding_readmitting_and_resplitting():
    pair, alone = equal_owners([(0, 1), (2, 3)], 4), equal_owners([(0, 1), (2,)], 4)
    # Exclusion: rank 3's units go to rank 2; replica 0 is untouched.
    assert _moves(pair, alone) == [(2, 3, 2), (3, 3, 2)]
    # Readmission is the reverse, plus the replicated tensors from the group's leader.
    assert _moves(alone, pair) == [(2, 2, 3), (3, 2, 3), (None, 2, 3)]
    # Uneven re-split: rank 3 at 1/3 speed keeps 1 of 4 units; one unit moves.
    resplit = uneven_owners([(0, 1), (2, 3)], [1.0, 1.0, 1.0, 1 / 3], 4)
    assert resplit[1] == (2, 2, 2, 3)
    assert _moves(pair, resplit) == [(2, 3, 2)]


def test_uneven_shares_pace_the_group_by_speed():
    speeds = [1.0, 1.0, 1.0, 1 / 3]
    o = uneven_owners([(0, 1), (2, 3)], speeds, 8)
    assert o[0].count(0) == 4 and o[1].count(2) == 6 and o[1].count(3) == 2
    assert replica_speed(o[1], speeds) == pytest.approx(4 / 3)  # vs 1 excluded, 2/3 equal pair
    assert replica_speed(equal_owners([(2, 3)], 8)[0], speeds) == pytest.approx(2 / 3)
    # A member too slow for even one unit is out of the group.
    assert members(uneven_owners([(0, 1)], [1.0, 0.05], 4)[0]) == (0,)
    with pytest.raises(ValueError, match="no live member"):
        uneven_owners([(0, 1)], [0.0, 0.0], 4)


@settings(max_examples=200, deadline=None)
@given(st.lists(st.floats(0.05, 1.0), min_size=2, max_size=4), st.sampled_from([4, 8, 16]))
def test_uneven_shares_are_min_max_optimal(speeds, units):
    group = tuple(range(len(speeds)))
    row = uneven_owners([group], speeds, units)[0]
    assert len(row) == units and sorted(row) == list(row)  # contiguous, member order
    got = max(row.count(d) / speeds[d] for d in group)

    def best(k, left):  # exhaustive: every way to give `left` units to members k..
        if k == len(speeds) - 1:
            return left / speeds[k]
        return min(max(c / speeds[k], best(k + 1, left - c)) for c in range(left + 1))

    assert got == pytest.approx(best(0, units))
    assert replica_speed(row, speeds) >= replica_speed(equal_owners([group], units)[0], speeds) - 1e-12
