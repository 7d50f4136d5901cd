"""A block that calls torch's checkpoint inside its own forward (reentrant or not). By default TapeSAC
runs the region as plain code (``inner_checkpoint="flatten"``): one recomputation in backward instead
of two. Kept (``"keep"``), gradients stay exact too, the tape is still reused, the peak stays at plain
TapeSAC's, and it warns once that the region is recomputed twice."""

import contextlib
import copy
import warnings

import pytest
import torch
from torch.distributed._tools.mem_tracker import MemTracker

from steptune.memory import TapeSACConfig, apply_tapesac_
from steptune.memory.measure import max_abs_diff
from steptune.testing.memory_blocks import Chain, DenseBlock, InnerCheckpointBlock

pytestmark = pytest.mark.timeout(60)


def _block(reentrant: bool, p: float = 0.0, opaque: bool = False) -> type[InnerCheckpointBlock]:
    return type("Inner", (InnerCheckpointBlock,), {"reentrant": reentrant, "p": p, "opaque": opaque})


def _grads(model):
    out = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)
    return out


def _train(block, steps=3, rows=16, mode="keep"):
    """Gradients of ``steps`` steps with and without TapeSAC, the handle and the warnings."""
    torch.manual_seed(0)
    plain = Chain(block, num=3)
    wrapped = copy.deepcopy(plain)
    xs = [torch.randn(rows, 32) for _ in range(steps)]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        handle = apply_tapesac_(wrapped, TapeSACConfig(blocks=(block,), inner_checkpoint=mode))
        diffs = []
        for x in xs:
            torch.manual_seed(1)
            plain(x).backward()
            torch.manual_seed(1)
            wrapped(x).backward()
            diffs.append(max_abs_diff(_grads(plain), _grads(wrapped)))
    return diffs, handle, [str(w.message) for w in caught if "TapeSAC block" in str(w.message)]


@pytest.mark.parametrize("mode", ["flatten", "keep"])
@pytest.mark.parametrize("reentrant", [False, True], ids=["non_reentrant", "reentrant"])
@pytest.mark.parametrize("p", [0.0, 0.3], ids=["no_dropout", "dropout"])
def test_gradients_are_exact_and_it_warns_once(reentrant, p, mode):
    diffs, handle, warned = _train(_block(reentrant, p), mode=mode)
    assert diffs == [0.0, 0.0, 0.0]
    assert handle.stats.replays == 9
    assert not handle.stats.force_saved  # the reentrant checkpoint's ops replay like any others
    if mode == "keep":
        kind = "reentrant" if reentrant else "non-reentrant"
        assert len(warned) == 1 and f"torch's {kind} checkpoint inside its forward" in warned[0]
    else:
        assert len(warned) == 1 and "runs that region as plain code" in warned[0], warned
    if p == 0.0:
        # three layers, three steps: each layer's first call recorded, one shared tape
        assert handle.stats.recorded == 3 and len(handle.templates) == 1


class _CountMM(torch.utils._python_dispatch.TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.mm = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.overloadpacket in (torch.ops.aten.mm, torch.ops.aten.addmm):
            self.mm += 1
        return func(*args, **(kwargs or {}))


def _backward_matmuls(model, x, flat=False):
    """Matmuls run in the second step's backward (the first records the tapes)."""
    from steptune.memory.inner import flattened_checkpoints

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model(x).backward()
        with flattened_checkpoints() if flat else contextlib.nullcontext():
            out = model(x)
        counter = _CountMM()
        with counter:
            out.sum().backward()
    return counter.mm


@pytest.mark.parametrize("reentrant", [False, True], ids=["non_reentrant", "reentrant"])
def test_flattening_removes_exactly_torchs_own_recomputation(reentrant):
    x = torch.randn(16, 32)

    def model(mode=None):
        torch.manual_seed(0)
        m = Chain(_block(reentrant), num=3)
        if mode is not None:
            apply_tapesac_(m, TapeSACConfig(blocks=(InnerCheckpointBlock,), inner_checkpoint=mode))
        return m

    # torch's own recomputation of the region: its checkpoint alone, against the region run plainly
    torch_recompute = _backward_matmuls(model(), x) - _backward_matmuls(model(), x, flat=True)
    keep, flatten = _backward_matmuls(model("keep"), x), _backward_matmuls(model("flatten"), x)
    assert torch_recompute == 3 * (2 if reentrant else 1)  # the reentrant variant has no early stop
    assert keep - flatten == torch_recompute, (keep, flatten)


def test_a_bad_inner_checkpoint_setting_is_refused():
    with pytest.raises(ValueError, match="use 'flatten' \\(default\\) or 'keep'"):
        apply_tapesac_(Chain(DenseBlock, num=1), TapeSACConfig(blocks=(DenseBlock,), inner_checkpoint="drop"))


def test_torchs_checkpoint_outside_a_block_is_untouched_while_a_block_runs():
    """The patches are process-wide: a checkpoint call outside any block (here: after a block's
    forward, in the same thread) keeps torch's behaviour."""
    from steptune.memory.inner import flattened_checkpoints

    lin = torch.nn.Linear(8, 8)
    with flattened_checkpoints() as seen:
        pass
    y = torch.utils.checkpoint.checkpoint(lin, torch.randn(2, 8, requires_grad=True), use_reentrant=False)
    assert seen.count == 0 and y.grad_fn is not None
    assert "apply" not in torch.utils.checkpoint.CheckpointFunction.__dict__  # patch removed


def test_a_raw_kernel_inside_the_reentrant_region_is_still_force_saved():
    diffs, handle, _ = _train(_block(True, opaque=True))  # kept: the recorder sees the Function
    assert diffs == [0.0, 0.0, 0.0]  # a replayed NaN allocation would show here
    assert handle.stats.force_saved["kernel outside the dispatcher (inside a custom autograd.Function)"] > 0


def _peak(model, x):
    model(x).backward()  # records the tapes; gradients allocated as in training
    tracker = MemTracker()
    tracker.track_external(model, x)
    with tracker:
        model(x).backward()
    return max(int(d["Total"]) for d in tracker.get_tracker_snapshot("peak").values())


@pytest.mark.parametrize("mode", ["flatten", "keep"])
@pytest.mark.parametrize("reentrant", [False, True], ids=["non_reentrant", "reentrant"])
def test_the_peak_stays_at_plain_tapesacs(reentrant, mode):
    """Before reentrant checkpoint's Function was made transparent to the recorder, every op in it
    was force-saved: the region's activations were held from forward, above no checkpointing."""
    x = torch.randn(1024, 32)
    torch.manual_seed(0)
    inner = Chain(_block(reentrant), num=4)
    none_peak = _peak(copy.deepcopy(inner), x)
    apply_tapesac_(inner, TapeSACConfig(blocks=(InnerCheckpointBlock,), inner_checkpoint=mode))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        inner_peak = _peak(inner, x)
    torch.manual_seed(0)
    dense = Chain(DenseBlock, num=4)
    apply_tapesac_(dense, TapeSACConfig(blocks=(DenseBlock,)))
    dense_peak = _peak(dense, x)
    activation = 1024 * 32 * 4
    assert inner_peak < none_peak
    assert inner_peak <= dense_peak + 2 * activation, (inner_peak, dense_peak, none_peak)


def test_other_saved_tensor_hooks_inside_a_block_are_named():
    class OffloadBlock(DenseBlock):
        def forward(self, x):
            with torch.autograd.graph.save_on_cpu():
                return super().forward(x)

    diffs, _, warned = _train(OffloadBlock)
    assert diffs == [0.0, 0.0, 0.0]
    assert len(warned) == 1 and "save_on_cpu" in warned[0] and "recomputed twice" not in warned[0]
