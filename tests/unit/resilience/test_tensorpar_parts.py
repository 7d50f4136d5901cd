"""Pieces of the live TP job: who holds which unit, what moves when a group shrinks or grows."""

import pytest

from steptune.resilience.tensorpar import _moves, _units_of


def test_units_follow_group_position():
    assert list(_units_of(3, [(0, 1, 2, 3)], 4)) == [3]
    assert list(_units_of(1, [(0, 1)], 4)) == [2, 3]
    assert list(_units_of(5, [(0, 1), (4, 5)], 2)) == [1]
    assert list(_units_of(3, [(0, 1), (2,)], 2)) == []  # excluded: holds nothing


def test_moves_when_excluding_and_readmitting():
    # 4 -> 2: the survivors take the excluded members' units; the excluded lose the replicated state.
    out = _moves([(0, 1, 2, 3)], [(0, 1)], 4)
    assert out == [(1, 1, 0), (2, 2, 1), (3, 3, 1)]
    # 2 -> 1 in replica 1 only; replica 0 unchanged.
    assert _moves([(0, 1), (2, 3)], [(0, 1), (2,)], 2) == [(1, 3, 2)]
    # Readmission is the reverse, plus the replicated tensors from the group's leader.
    assert _moves([(0, 1), (2,)], [(0, 1), (2, 3)], 2) == [(1, 2, 3), (None, 2, 3)]
    # A new leader: the excluded first member's units go to the survivor.
    assert _moves([(0, 1)], [(1,)], 2) == [(0, 0, 1)]


def test_timed_fraction_must_be_a_share():
    import torch.distributed as dist  # noqa: F401  (Runtime needs only a group-like object here)

    from steptune.resilience.live import stage_model
    from steptune.resilience.runtime import Runtime

    class _Solo:
        def rank(self) -> int:
            return 0

        def size(self) -> int:
            return 1

    rt = Runtime(_Solo(), stage_model())
    with pytest.raises(ValueError, match="fraction"), rt.timed([1024], fraction=0.0):
        pass
