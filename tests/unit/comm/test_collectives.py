"""TIDE's all-gather and reduce-scatter on in-process loopback worlds (W up to 8, threads)."""

import threading

import pytest
import torch

from steptune.comm.ag import all_gather_into
from steptune.comm.layout import GroupLayout, ParamSpec
from steptune.comm.rs import reduce_scatter_into, staging_numel
from steptune.comm.transport import LoopbackHub

pytestmark = pytest.mark.timeout(120)

SHAPES = [(33, 4), (7,), (5, 3), (1, 2), (16, 8)]


def run_world(w, fn, timeout=20):
    hub = LoopbackHub(w, timeout=timeout)
    out, errors = [None] * w, []

    def body(r):
        try:
            out[r] = fn(r, hub.rank(r))
        except BaseException as exc:  # reported below
            errors.append((r, exc))

    threads = [threading.Thread(target=body, args=(r,)) for r in range(w)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout + 5)
    if errors:
        raise errors[0][1]
    return out


def full_params(seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(s, generator=g) for s in SHAPES]


def grads_of(rank):
    g = torch.Generator().manual_seed(100 + rank)
    return [torch.randn(s, generator=g).to(torch.bfloat16) for s in SHAPES]


def shard_of(lay, full, p, rank):
    first, rows = lay.owner_rows(p, rank)
    padded = torch.zeros(lay.shard_numel(p))
    padded[: rows * lay.params[p].row_numel] = full[p][first : first + rows].reshape(-1)
    return padded


@pytest.mark.parametrize("w", [1, 2, 3, 4, 5, 7, 8])
@pytest.mark.parametrize("algorithm", ["direct", "rd"])
@pytest.mark.parametrize("pace", [None, 64])
def test_all_gather_lands_every_row_in_parameter_storage(w, algorithm, pace):
    lay = GroupLayout(tuple(ParamSpec(s) for s in SHAPES), w)
    full = full_params()

    def rank_fn(r, t):
        slot = torch.full((lay.slot_numel,), float("nan"), dtype=torch.bfloat16)
        shards = [shard_of(lay, full, p, r) for p in range(len(SHAPES))]
        cast_bytes = all_gather_into(lay, slot, shards, t, algorithm=algorithm, max_inflight_bytes=pace)
        for p, f in enumerate(full):
            view = slot.narrow(0, lay.slot_offset(p), f.numel()).view(f.shape)
            assert torch.equal(view, f.to(torch.bfloat16)), (r, p)
        return cast_bytes, t.stats

    results = run_world(w, rank_fn)
    for r, (cast_bytes, stats) in enumerate(results):
        assert cast_bytes == 2 * sum(lay.real_numel(p, r) for p in range(len(SHAPES)))  # only the cast
        assert set(stats.bytes_by_dtype) <= {"bfloat16"}
    # no padding on the wire: every rank receives exactly the others' real rows
    total_real = 2 * sum(lay.params[p].numel for p in range(len(SHAPES)))
    if algorithm == "direct":
        assert sum(s.total_bytes for _, s in results) == (w - 1) * total_real


@pytest.mark.parametrize("w", [1, 2, 3, 4, 6, 8])
@pytest.mark.parametrize(("chunk", "slots", "two_phase"), [(7, 2, False), (5, 3, True), (1 << 20, 1, False)])
def test_reduce_scatter_is_exact_fp32_of_bf16_gradients(w, chunk, slots, two_phase):
    lay = GroupLayout(tuple(ParamSpec(s) for s in SHAPES), w)

    def rank_fn(r, t):
        out = torch.full((lay.out_numel,), float("nan"))
        grads = [g.reshape(-1) for g in grads_of(r)]
        stats = reduce_scatter_into(
            lay, grads, out, t, chunk_numel=chunk, num_slots=slots, two_phase=two_phase, divide_by=w
        )
        return out, stats, t.stats

    results = run_world(w, rank_fn)
    every = [grads_of(q) for q in range(w)]
    for r, (out, stats, wire) in enumerate(results):
        for p in range(len(SHAPES)):
            first, rows = lay.owner_rows(p, r)
            ref = sum(e[p][first : first + rows].double() for e in every) / w
            got = out.narrow(0, lay.out_offset(p), ref.numel()).double().view(ref.shape)
            assert torch.allclose(got, ref, rtol=1e-6, atol=1e-7), (r, p)
            pad = out.narrow(0, lay.out_offset(p) + ref.numel(), lay.shard_numel(p) - ref.numel())
            assert torch.equal(pad, torch.zeros_like(pad))
        # bf16 on the wire, real rows only
        sent = sum(lay.rs_numel(q) for q in range(w) if q != r) * 2
        assert wire.bytes_by_dtype.get("bfloat16", 0) == sent and wire.total_bytes == sent
        assert stats.staging_bytes == 2 * staging_numel(
            lay, chunk_numel=chunk, num_slots=slots, two_phase=two_phase
        )


def test_staging_does_not_grow_with_world_size_at_fixed_output():
    sizes = {}
    for w in range(2, 9):
        lay = GroupLayout((ParamSpec((64 * w, 32)),), w)  # 64 rows per rank whatever W is
        sizes[w] = staging_numel(lay, chunk_numel=512, num_slots=2, two_phase=False)
        assert lay.stock_rs_input_numel() == w * lay.out_numel
    assert len(set(sizes.values())) == 1


def test_borrowed_staging_is_used_and_not_reported_as_allocated():
    lay = GroupLayout(tuple(ParamSpec(s) for s in SHAPES), 2)
    staging = torch.empty(1000, dtype=torch.bfloat16)

    def rank_fn(r, t):
        out = torch.empty(lay.out_numel)
        return reduce_scatter_into(
            lay, [g.reshape(-1) for g in grads_of(r)], out, t, chunk_numel=8, staging=staging.clone()
        )

    for stats in run_world(2, rank_fn):
        assert stats.staging_allocated_bytes == 0 and stats.staging_bytes == 2 * 2 * 8


def test_bad_arguments_are_refused_with_what_to_change():
    lay = GroupLayout(tuple(ParamSpec(s) for s in SHAPES), 1)
    t = LoopbackHub(1).rank(0)
    grads = [g.reshape(-1) for g in grads_of(0)]
    with pytest.raises(ValueError, match="out must be 1-D"):
        reduce_scatter_into(lay, grads, torch.empty(3), t)
    with pytest.raises(ValueError, match="share one dtype"):
        reduce_scatter_into(lay, [*grads[:-1], grads[-1].float()], torch.empty(lay.out_numel), t)
    with pytest.raises(ValueError, match="gradients for"):
        reduce_scatter_into(lay, grads[:2], torch.empty(lay.out_numel), t)
    with pytest.raises(ValueError, match="slot must be 1-D"):
        all_gather_into(lay, torch.empty(2, dtype=torch.bfloat16), [torch.empty(0)] * len(SHAPES), t)
    with pytest.raises(ValueError, match="unknown all-gather algorithm"):
        lay2 = GroupLayout(tuple(ParamSpec(s) for s in SHAPES), 2)
        all_gather_into(
            lay2,
            torch.empty(lay2.slot_numel),
            [torch.empty(99)] * 5,
            LoopbackHub(2).rank(0),
            algorithm="ring",
        )
    with pytest.raises(ValueError, match="contiguous"):
        t.isend(torch.empty(4, 4).t(), 0, 0)


def test_loopback_refuses_a_second_wait_like_gloo_would_hang():
    hub = LoopbackHub(2, timeout=2)
    a, b = hub.rank(0), hub.rank(1)
    work = a.isend(torch.ones(3), 1, 0)
    b.irecv(torch.empty(3), 0, 0).wait()
    work.wait()
    with pytest.raises(RuntimeError, match="waited twice"):
        work.wait()
    with pytest.raises(TimeoutError, match="never posted"):
        a.irecv(torch.empty(3), 1, 5).wait()
