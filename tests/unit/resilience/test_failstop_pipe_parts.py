"""The DP x PP fail-stop planning: who keeps what, where lost layers come from, when only a checkpoint can."""

import itertools

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from steptune.resilience.failstop_pipe import initial_pipes, restore_moves, survivor_pipes


def test_initial_split_gives_blocks_evenly_with_embedding_and_head_at_the_ends():
    assert initial_pipes(2, 2, 8) == [[(0, 0, 4), (1, 4, 8)], [(2, 0, 4), (3, 4, 8)]]
    assert initial_pipes(1, 3, 9) == [[(0, 0, 4), (1, 4, 6), (2, 6, 9)]]
    with pytest.raises(ValueError, match="blocks"):
        initial_pipes(1, 7, 8)


def test_orphans_of_broken_pipelines_form_one_pipeline_and_copy_from_peers():
    old = initial_pipes(2, 2, 8)
    new = survivor_pipes(old, [0, 1, 2], 8)
    assert new == [[(0, 0, 4), (1, 4, 8)], [(2, 0, 8)]]
    assert restore_moves(old, new, [0, 1, 2]) == [(i, 1, 2) for i in range(4, 8)]
    # the first stage dies instead: rank 3 takes the embedding and first blocks from rank 0
    new = survivor_pipes(old, [0, 1, 3], 8)
    assert new == [[(0, 0, 4), (1, 4, 8)], [(3, 0, 8)]]
    assert restore_moves(old, new, [0, 1, 3]) == [(i, 0, 3) for i in range(4)]


def test_a_layer_no_survivor_holds_needs_the_checkpoint():
    old = initial_pipes(2, 2, 8)
    new = survivor_pipes(old, [0, 2], 8)  # both copies of stage 1 gone
    assert new == [[(0, 0, 4), (2, 4, 8)]]  # orphans in old stage order, blocks split evenly
    with pytest.raises(LookupError, match=r"layers \[4, 5, 6, 7\]"):
        restore_moves(old, new, [0, 2])


@settings(max_examples=60, deadline=None)
@given(
    dp=st.integers(1, 4),
    pp=st.integers(1, 4),
    dead=st.sets(st.integers(0, 15), max_size=3),
)
def test_every_layer_is_held_once_per_pipeline_and_copies_come_from_survivors(dp, pp, dead):
    num_layers = 10
    old = initial_pipes(dp, pp, num_layers)
    alive = [r for r in range(dp * pp) if r not in dead]
    if not alive:
        with pytest.raises(ValueError):
            survivor_pipes(old, alive, num_layers)
        return
    new = survivor_pipes(old, alive, num_layers)
    for pipe in new:
        assert pipe[0][1] == 0 and pipe[-1][2] == num_layers
        assert all(a[2] == b[1] for a, b in itertools.pairwise(pipe))  # contiguous, in order
        assert all(r in alive for r, _, _ in pipe)
    try:
        moves = restore_moves(old, new, alive)
    except LookupError:
        held = {i for p in old for r, a, b in p if r in alive for i in range(a, b)}
        assert held != set(range(num_layers))
        return
    holds = {r: range(a, b) for p in old for r, a, b in p}
    for idx, src, dst in moves:
        assert src in alive and idx in holds[src] and idx not in holds.get(dst, range(0))
