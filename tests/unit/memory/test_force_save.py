"""Each force-save reason: the value is held from forward, never replayed. Every test pairs with a
negative control that disables the reason and shows the replay would be wrong (or would run the
sync / collective / side effect again)."""

import pytest
import torch

import steptune.memory.record as record
from steptune.core.patching import SharedPatch
from steptune.memory import TapeSACConfig, apply_tapesac_
from steptune.memory.measure import OpCounter, max_abs_diff
from steptune.testing import run_threads
from steptune.testing.memory_blocks import (
    BatchNormBlock,
    Chain,
    CollectiveBlock,
    GeneratorNoiseBlock,
    OpaqueBlock,
    SyncBlock,
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


def _collective_rank(rank, group, functional, disable):
    torch.manual_seed(0)
    model = Chain(lambda w: CollectiveBlock(w, group, functional))
    x = torch.randn(8, 32) + rank
    reference, _, _ = _step(model, x)
    original = record.Recorder._opaque_write
    if disable:  # negative control: forget that eager c10d calls write their tensors
        record.Recorder._opaque_write = lambda self, name, flat: None
    try:
        got, ops, handle = _step(model, x, CollectiveBlock)
    finally:
        record.Recorder._opaque_write = original
    functional_in_backward = sum(n for op, n in ops.items() if op.startswith("_c10d_functional.all_reduce"))
    return max_abs_diff(reference, got), functional_in_backward, dict(handle.stats.force_saved)


def test_collectives_are_not_replayed():
    for diff, replayed, reasons in run_threads(_collective_rank, 2, False, False, timeout=30):
        assert diff == 0.0
        assert replayed == 0
        assert reasons.get("collective") == 2


def test_an_unrecorded_eager_collective_would_corrupt_gradients():
    for diff, _, _ in run_threads(_collective_rank, 2, False, True, timeout=30):
        assert diff > 0.0


def test_functional_collectives_are_classified_as_collectives():
    # Functional collectives are aten-level ops the recorder sees (torchtitan's TP/EP use them).
    t = torch.ones(4)
    op = torch.ops._c10d_functional.all_reduce.default
    assert record.force_save_reason(op, (t, "sum", "0"), {}, t) == "collective"
