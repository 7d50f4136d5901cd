"""The DP x TP fail-stop planning: a group that lost a member re-splits; lost units come from DP peers."""

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from steptune.resilience.failstop_tp import restore_moves, survivor_owners
from steptune.resilience.tensorpar import equal_owners, members


def _owners(dp, tp, per=4):
    return equal_owners([tuple(range(r * tp, (r + 1) * tp)) for r in range(dp)], tp * per)


def test_the_survivor_of_a_pair_takes_every_unit_from_its_dp_peer():
    old = _owners(2, 2)
    new = survivor_owners(old, [0, 1, 2])
    assert new == ((0, 0, 0, 0, 1, 1, 1, 1), (2,) * 8)
    assert restore_moves(old, new, [0, 1, 2]) == [(u, 1, 2) for u in range(4, 8)]
    # the group leader dies: the other member takes units 0-3 from rank 0, the other replica's leader
    new = survivor_owners(old, [0, 1, 3])
    assert restore_moves(old, new, [0, 1, 3]) == [(u, 0, 3) for u in range(4)]


def test_inside_a_group_of_four_units_move_within_the_group_first():
    old = _owners(2, 4, per=1)  # ((0,1,2,3), (4,5,6,7))
    alive = [r for r in range(8) if r != 1]
    new = survivor_owners(old, alive)
    assert members(new[0]) == (0, 2, 3) and new[1] == old[1]
    for u, src, dst in restore_moves(old, new, alive):
        assert src in alive and (old[0][u] == src or old[1][u] == src) and new[0][u] == dst
        if old[0][u] != 1:
            assert src == old[0][u]  # a unit whose holder lived comes from inside the group


def test_a_unit_nobody_holds_any_more_is_reported():
    old = _owners(2, 2)
    new = survivor_owners(old, [0, 2])  # both holders of units 4-7 are gone
    with pytest.raises(LookupError, match=r"units \[4, 5, 6, 7\]"):
        restore_moves(old, new, [0, 2])
    with pytest.raises(ValueError, match="no rank survived"):
        survivor_owners(old, [])


@settings(max_examples=60, deadline=None)
@given(dp=st.integers(1, 4), tp=st.sampled_from([1, 2, 4]), dead=st.sets(st.integers(0, 15), max_size=3))
def test_after_restore_every_unit_of_every_group_has_one_live_holder(dp, tp, dead):
    old = _owners(dp, tp)
    alive = [r for r in range(dp * tp) if r not in dead]
    if not alive:
        return
    new = survivor_owners(old, alive)
    assert all(d in alive for row in new for d in row)
    try:
        moves = restore_moves(old, new, alive)
    except LookupError:
        assert any(all(row[u] not in alive for row in old) for u in range(len(old[0])))
        return
    have = {(d, u) for row in old for u, d in enumerate(row) if d in alive}
    have |= {(d, u) for u, _, d in moves}
    assert all((d, u) in have for row in new for u, d in enumerate(row))
