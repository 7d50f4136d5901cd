"""Each force-save reason: the value is held from forward, never replayed. Every test pairs with a
negative control that disables the reason and shows the replay would be wrong (or would run the
sync / collective / side effect again)."""

import pytest
import torch

import steptune.memory.record as record
from steptune.core.dist import as_process_group
from steptune.core.patching import SharedPatch
from steptune.memory import TapeSACConfig, apply_tapesac_
from steptune.memory.measure import OpCounter, max_abs_diff
from steptune.memory.tape import TapeSACError
from steptune.testing import run_threads
from steptune.testing.memory_blocks import (
    BatchNormBlock,
    Chain,
    CollectiveBlock,
    DenseBlock,
    GeneratorNoiseBlock,
    OpaqueBlock,
    SyncBlock,
    SyncedBufferBlock,
)

pytestmark = pytest.mark.timeout(60)


def _step(model, x, block=None, reuse=True):
    """Gradients, backward op counts and the TapeSAC handle (None without TapeSAC)."""
    model.zero_grad(set_to_none=True)
    handle = apply_tapesac_(model, TapeSACConfig(blocks=(block,), reuse_tapes=reuse)) if block else None
    loss = model(x)
    counter = OpCounter()
    with counter:
        loss.backward()
    if handle is not None:
        handle.remove()
    return {n: p.grad.clone() for n, p in model.named_parameters()}, counter.ops, handle


def _no_reason(monkeypatch):
    monkeypatch.setattr(record, "force_save_reason", lambda *a, **k: None)


def test_custom_function_outputs_are_saved_not_replayed(monkeypatch):
    torch.manual_seed(0)
    model, x = Chain(OpaqueBlock), torch.randn(8, 32)
    reference, _, _ = _step(model, x)
    got, _, handle = _step(model, x, OpaqueBlock)
    assert max_abs_diff(reference, got) == 0.0
    assert handle.stats.force_saved["kernel outside the dispatcher (inside a custom autograd.Function)"] > 0
    # Negative control: without Function interception the NaN-filled allocation is replayed.
    monkeypatch.setattr(record, "_patch", SharedPatch(lambda: []))
    bad, _, _ = _step(model, x, OpaqueBlock)
    assert any(torch.isnan(g).any() for g in bad.values())


def test_host_syncs_and_data_dependent_shapes_are_not_replayed(monkeypatch):
    torch.manual_seed(0)
    model, x = Chain(SyncBlock), torch.randn(16, 32)
    reference, ops_ref, _ = _step(model, x)
    got, ops, handle = _step(model, x, SyncBlock)
    assert max_abs_diff(reference, got) == 0.0
    assert handle.stats.force_saved["host sync or data-dependent shape"] >= 4
    syncs = ("aten.nonzero.default", "aten._local_scalar_dense.default")
    assert all(ops.get(op, 0) == ops_ref.get(op, 0) for op in syncs)
    assert handle.stats.recorded == 2  # a data-dependent tape is never reused
    _no_reason(monkeypatch)
    _, ops_bad, _ = _step(model, x, SyncBlock, reuse=False)
    assert any(ops_bad.get(op, 0) > ops_ref.get(op, 0) for op in syncs)


def test_running_statistics_are_updated_once(monkeypatch):
    torch.manual_seed(0)
    model, x = Chain(BatchNormBlock).train(), torch.randn(16, 32)
    _step(model, x)
    stats_ref = [layer.norm.running_mean.clone() for layer in model.layers]
    count_ref = [int(layer.norm.num_batches_tracked) for layer in model.layers]
    for layer in model.layers:
        layer.norm.reset_running_stats()
    _, _, handle = _step(model, x, BatchNormBlock)
    assert [int(layer.norm.num_batches_tracked) for layer in model.layers] == count_ref
    assert all(
        torch.equal(a, layer.norm.running_mean) for a, layer in zip(stats_ref, model.layers, strict=True)
    )
    assert handle.stats.force_saved["side effect (running statistics)"] == 2
    assert handle.stats.force_saved["side effect (writes a tensor the block did not produce)"] == 2
    _no_reason(monkeypatch)
    for layer in model.layers:
        layer.norm.reset_running_stats()
    _step(model, x, BatchNormBlock)
    assert not all(
        torch.equal(a, layer.norm.running_mean) for a, layer in zip(stats_ref, model.layers, strict=True)
    )


def test_explicit_generator_draws_are_saved(monkeypatch):
    def run(block_cls):
        torch.manual_seed(0)
        model, x = Chain(GeneratorNoiseBlock), torch.randn(8, 32)
        return _step(model, x, block_cls)[0]

    reference = run(None)
    assert max_abs_diff(reference, run(GeneratorNoiseBlock)) == 0.0
    _no_reason(monkeypatch)
    assert max_abs_diff(reference, run(GeneratorNoiseBlock)) > 0.0  # replay draws the next numbers


@torch.library.custom_op("steptune_test::rand_mask", mutates_args=())
def _rand_mask(x: torch.Tensor, p: float) -> torch.Tensor:
    return (torch.rand_like(x) >= p).to(x.dtype) / (1 - p)


@_rand_mask.register_fake
def _(x, p):
    return torch.empty_like(x)


class _CustomMaskBlock(torch.nn.Module):
    """A dropout-style mask from a torch.library op without autograd (a fused mask kernel)."""

    def __init__(self, width):
        super().__init__()
        self.a, self.b = torch.nn.Linear(width, width), torch.nn.Linear(width, width)

    def forward(self, x):
        h = torch.tanh(self.a(x))
        return x + self.b(h * _rand_mask(h.detach(), 0.5))


def test_a_custom_ops_outputs_are_saved_not_replayed(monkeypatch):
    # Found in a sweep (2026-12-05): the op carries none of aten's tags, so it was taken for deterministic
    # and replayed, drawing a new mask (gradients off by 25, the RNG stream advanced).
    def run(block_cls):
        torch.manual_seed(0)
        model, x = Chain(_CustomMaskBlock), torch.randn(8, 32)
        torch.manual_seed(1)
        grads, _, handle = _step(model, x, block_cls)
        return grads, torch.rand(1), handle

    reference, rng_ref, _ = run(None)
    got, rng, handle = run(_CustomMaskBlock)
    assert max_abs_diff(reference, got) == 0.0 and torch.equal(rng, rng_ref)
    assert any(k.startswith("custom op") and n > 0 for k, n in handle.stats.force_saved.items())
    _no_reason(monkeypatch)
    bad, rng_bad, _ = run(_CustomMaskBlock)
    assert max_abs_diff(reference, bad) > 0.0 and not torch.equal(rng_bad, rng_ref)


def _as_kind(group, rank, kind):
    """The thread rank's bare gloo backend, or (``process_group``) the ProcessGroup that init_process_group
    and new_group give, whose collectives reach the dispatcher."""
    if kind == "process_group":
        return as_process_group(group, torch.distributed.HashStore(), rank, 2, prefix="pg")
    return group


def _collective_rank(rank, group, functional, kind="backend", how="dist"):
    group = _as_kind(group, rank, kind)
    torch.manual_seed(0)
    model = Chain(lambda w: CollectiveBlock(w, group, functional, how))
    x = torch.randn(8, 32) + rank
    reference, _, _ = _step(model, x)
    got, ops, handle = _step(model, x, CollectiveBlock)
    functional_in_backward = sum(n for op, n in ops.items() if op.startswith("_c10d_functional.all_reduce"))
    return max_abs_diff(reference, got), functional_in_backward, dict(handle.stats.force_saved)


# A bare gloo backend runs torch.distributed's collectives below the dispatcher (its patched Backend methods
# see them); a ProcessGroup's go through it as c10d ops. Both are seen under any name: one bound before
# TapeSAC was applied, or the group's own method (on a bare backend, both were missed before 2026-12-05,
# when torch.distributed's functions were patched instead). An all-to-all returns no tensor: only the
# recorded write says that its output was filled (before 2026-12-03 replay re-ran the `empty` that
# allocated it). In `exchange` both ranks post a receive before their send: recording must not wait in it.
HOWS = ("dist", "imported", "method", "all_to_all", "all_to_all_method", "all_gather_views", "exchange")
# (torch.distributed.all_to_all_single refuses a bare backend, TapeSAC or not)
CASES = [
    (kind, how)
    for kind in ("backend", "process_group")
    for how in HOWS
    if (kind, how) != ("backend", "all_to_all")
]


@pytest.mark.parametrize(("kind", "how"), CASES)
def test_collectives_are_not_replayed(kind, how):
    for diff, replayed, reasons in run_threads(_collective_rank, 2, False, kind, how, timeout=30):
        assert diff == 0.0
        assert replayed == 0
        # one collective per block (two blocks); a ProcessGroup's send is a c10d op node too, while a bare
        # backend's send writes nothing and is not recorded
        assert reasons.get("collective") == (4 if (kind, how) == ("process_group", "exchange") else 2)


@pytest.mark.parametrize(("kind", "how"), CASES)
def test_an_unrecorded_eager_collective_would_corrupt_gradients(monkeypatch, kind, how):
    # negative control: forget that eager c10d calls write their tensors (patched once, for both rank threads)
    monkeypatch.setattr(record.Recorder, "_opaque_write", lambda self, name, flat: None)
    for diff, _, _ in run_threads(_collective_rank, 2, False, kind, how, timeout=30):
        assert diff != 0.0  # NaN too: the all-to-all's output replayed as the uninitialized `empty`


def _synced_buffer_rank(rank, group, kind):
    group = _as_kind(group, rank, kind)
    torch.manual_seed(rank)
    x = torch.randn(8, 32)
    grads = []
    for block in (None, SyncedBufferBlock):
        torch.manual_seed(0)  # the same weights, and fresh buffers: each run all-reduces them
        model = Chain(lambda w: SyncedBufferBlock(w, group))
        try:
            grads.append(_step(model, x, block)[0])
        except TapeSACError as err:
            return str(err)
    return max_abs_diff(*grads)


@pytest.mark.parametrize("kind", ["backend", "process_group"])
def test_a_value_read_before_a_collective_writes_the_buffer_is_a_clear_error(monkeypatch, kind):
    # exp(buffer) is saved by autograd, then the buffer is all-reduced in place: replay would compute exp
    # of the new value, and the recorder learns of the write only after exp's output was packed without
    # being held. The first forward says so.
    for got in run_threads(_synced_buffer_rank, 2, kind, timeout=30):
        assert isinstance(got, str) and "aten.exp" in got and "exclude this block" in got, got
    # negative control: without marking the buffer written, the gradients are silently wrong
    original = record.Recorder._opaque_write

    def forget(self, name, flat):
        original(self, name, flat)
        for slot in self.slots:
            if slot.external is not None:
                slot.external.written = False

    monkeypatch.setattr(record.Recorder, "_opaque_write", forget)
    for got in run_threads(_synced_buffer_rank, 2, kind, timeout=30):
        assert not isinstance(got, str) and got != 0.0, got


# Every eager c10d op of this torch and the arguments it writes, by hand from what each collective does (an
# op that torch adds, or an argument it renames, makes the test below fail until it is classified here).
C10D_WRITES = {
    "_allgather_base_": {"output_tensor"},
    "_reduce_scatter_base_": {"output_tensor"},
    "allgather_": {"output_tensors"},
    "allgather_coalesced_": {"output_lists"},
    "allgather_into_tensor_coalesced_": {"outputs"},
    "allreduce_": {"tensors"},
    "allreduce_coalesced_": {"tensors"},
    "alltoall_": {"output_tensors"},
    "alltoall_base_": {"output"},
    "barrier": set(),
    "broadcast_": {"tensors"},
    "check_for_nan": set(),
    "gather_": {"output_tensors"},
    "monitored_barrier_": set(),
    "recv_": {"tensors"},
    "recv_any_source_": {"tensors"},
    "reduce_": {"tensors"},
    "reduce_scatter_": {"output_tensors"},
    "reduce_scatter_tensor_coalesced_": {"outputs"},
    "scatter_": {"output_tensors"},
    "send": set(),
}


def test_every_patched_backend_method_exists():
    # a name torch drops or renames would be skipped without a word by the patch's `if n in own`
    backend = vars(torch._C._distributed_c10d.Backend)
    assert [n for n in record._BACKEND_WRITES if n not in backend] == []


def test_every_c10d_op_is_classified():
    import torch.distributed  # registers the c10d ops

    names = sorted(n.split("::")[1] for n in torch._C._dispatch_get_all_op_names() if n.startswith("c10d::"))
    assert set(names) == set(C10D_WRITES), "classify the new or removed c10d ops in C10D_WRITES"
    for name in names:
        op = getattr(torch.ops.c10d, name).default
        args, by_id = [], {}
        for arg in op._schema.arguments:
            kind = str(arg.type)  # Tensor, Optional[Tensor], List[Tensor], List[List[Tensor]]
            if "Tensor" in kind:
                t = torch.zeros(1)
                by_id[id(t)] = arg.name
                depth = kind.count("List[")
                args.append([[t]] if depth == 2 else [t] if depth == 1 else t)
            else:
                args.append(None)
        written = {by_id[id(t)] for t in record._c10d_written(op, tuple(args), {})}
        assert written == C10D_WRITES[name], name


def test_which_arguments_an_eager_c10d_op_writes():
    import torch.distributed  # registers the c10d ops

    c10d = torch.ops.c10d
    a, b, c = torch.ones(2), torch.ones(4), torch.ones(2)
    pg = object()
    assert record._c10d_written(c10d.allreduce_.default, ([a, c], pg), {}) == [a, c]
    assert record._c10d_written(c10d._allgather_base_.default, (b, a, pg), {}) == [b]
    assert record._c10d_written(c10d.allgather_.default, ([[a, c]], [b], pg), {}) == [a, c]
    assert record._c10d_written(c10d.recv_.default, ([a], pg, 0, 0), {}) == [a]
    assert record._c10d_written(c10d.send.default, ([a], pg, 1, 0), {}) == []
    assert record._c10d_written(c10d.barrier.default, (a, pg, []), {}) == []


def test_functional_collectives_are_classified_as_collectives():
    # Functional collectives are aten-level ops the recorder sees (torchtitan's TP/EP use them).
    t = torch.ones(4)
    op = torch.ops._c10d_functional.all_reduce.default
    assert record.force_save_reason(op, (t, "sum", "0"), {}, t) == "collective"


def test_full_backward_hooks_force_save_nothing_and_see_the_same_gradients():
    # Found in a sweep (2026-12-05): the hooks' identity Function was taken for an opaque kernel, and every
    # value it touched was held from forward (peak 6.55 -> 8.42 MiB)
    def run(block_cls):
        torch.manual_seed(0)
        model, x = Chain(DenseBlock, num=3), torch.randn(8, 32)
        seen = []
        for layer in model.layers:
            layer.a.register_full_backward_hook(lambda m, gi, go: seen.append(go[0].clone()))
        grads, _, handle = _step(model, x, block_cls)
        return grads, seen, handle

    reference, seen_ref, _ = run(None)
    got, seen, handle = run(DenseBlock)
    assert max_abs_diff(reference, got) == 0.0 and len(seen) == len(seen_ref) == 3
    assert all(torch.equal(a, b) for a, b in zip(seen, seen_ref, strict=True))
    assert dict(handle.stats.force_saved) == {}
