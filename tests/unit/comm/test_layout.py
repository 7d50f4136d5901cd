"""TIDE's placement plan against FSDP2's own chunking, and its invariants for arbitrary shapes."""

import itertools

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from steptune.comm.layout import GroupLayout, ParamSpec, bruck_steps, xor_steps

shapes = st.lists(
    st.tuples(st.integers(0, 40), st.integers(1, 5)).map(lambda t: t if t[1] > 1 else (t[0],)),
    min_size=1,
    max_size=6,
)


@settings(max_examples=150, deadline=None)
@given(shapes=shapes, w=st.integers(1, 9))
def test_sharding_matches_torch_chunk_as_fsdp2_pads_it(shapes, w):
    lay = GroupLayout(tuple(ParamSpec(s) for s in shapes), w)
    for p, s in enumerate(shapes):
        chunks = torch.chunk(torch.empty(s), w, dim=0) if s[0] else ()
        rows = [c.shape[0] for c in chunks] + [0] * (w - len(chunks))
        assert [lay.rows_on(p, r) for r in range(w)] == rows
        # FSDP2 pads every shard to chunk 0's size
        padded = (chunks[0].numel() if chunks else 0) if s[0] else 0
        assert lay.shard_numel(p) == padded


@settings(max_examples=150, deadline=None)
@given(shapes=shapes, w=st.integers(1, 9), align=st.sampled_from([2, 16, 4096]))
def test_slots_are_aligned_disjoint_and_hold_every_rank(shapes, w, align):
    lay = GroupLayout(tuple(ParamSpec(s) for s in shapes), w, itemsize=2, align_bytes=align)
    ends = []
    for p in range(len(shapes)):
        off = lay.slot_offset(p)
        assert (off * 2) % align == 0
        ends.append((off, off + w * lay.shard_numel(p)))
        # the real rows of any block of ranks are one segment at the right place
        for first in range(w):
            for count in range(1, w - first + 1):
                seg = lay.block_segment(p, first, count)
                assert seg.start == first * lay.shard_numel(p)
                assert seg.numel == sum(lay.real_numel(p, r) for r in range(first, first + count))
    for (_, a1), (b0, _) in itertools.pairwise(ends):
        assert a1 <= b0
    assert ends[-1][1] <= lay.slot_numel


@settings(max_examples=150, deadline=None)
@given(shapes=shapes, w=st.integers(1, 9), chunk=st.integers(1, 50))
def test_rs_chunks_cover_the_owner_rows_exactly_once(shapes, w, chunk):
    lay = GroupLayout(tuple(ParamSpec(s) for s in shapes), w)
    for owner in range(w):
        covered = {}
        for pieces in lay.rs_chunks(owner, chunk):
            assert 0 < sum(pc.numel for pc in pieces) <= chunk
            slot_end = 0
            for pc in pieces:
                assert pc.slot == slot_end  # pieces pack a slot without gaps
                slot_end += pc.numel
                for i in range(pc.numel):
                    key = (pc.param, pc.src + i)
                    assert key not in covered
                    covered[key] = pc.dst + i
        assert len(covered) == lay.rs_numel(owner)
        for (p, i), dst in covered.items():
            assert dst == lay.out_offset(p) + i
            assert i < lay.real_numel(p, owner)


@pytest.mark.parametrize("w", range(1, 17))
def test_bruck_rounds_cover_every_rank_in_ceil_log2_rounds(w):
    steps = bruck_steps(w)
    assert len(steps) == (w - 1).bit_length()
    assert 1 + sum(c for _, c in steps) == w
    if w & (w - 1) == 0:
        assert [d for d, _ in xor_steps(w)] == [d for d, _ in steps]


def test_bad_plans_say_what_to_change():
    with pytest.raises(ValueError, match="0-d"):
        ParamSpec(())
    with pytest.raises(ValueError, match="world_size"):
        GroupLayout((ParamSpec((3,)),), 0)
    with pytest.raises(ValueError, match="power-of-two"):
        xor_steps(6)
    with pytest.raises(ValueError, match="chunk_numel"):
        GroupLayout((ParamSpec((3,)),), 2).rs_chunks(0, 0)
