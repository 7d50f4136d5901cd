"""Custom ops TapeSAC may replay: those the user declares pure (``TapeSACConfig.pure_ops``), and those that
return no tensor (``record_function``'s profiler ops), which backward can never need."""

import pytest
import torch

from steptune.memory import TapeSACConfig, apply_tapesac_
from steptune.memory.measure import max_abs_diff
from steptune.memory.record import force_save_reason
from steptune.testing.memory_blocks import Chain

pytestmark = pytest.mark.timeout(60)

_calls = [0]


@torch.library.custom_op("steptune_test::scaled_tanh", mutates_args=())
def _scaled_tanh(x: torch.Tensor) -> torch.Tensor:
    _calls[0] += 1
    return torch.tanh(x) * 1.5


@_scaled_tanh.register_fake
def _(x):
    return torch.empty_like(x)


def _setup(ctx, inputs, output):
    ctx.save_for_backward(output)


def _backward(ctx, grad):
    (y,) = ctx.saved_tensors
    return grad * (1.5 - y * y / 1.5)


_scaled_tanh.register_autograd(_backward, setup_context=_setup)


@torch.library.custom_op("steptune_test::bump_", mutates_args=("x",))
def _bump_(x: torch.Tensor) -> None:
    x.add_(1.0)


@torch.library.custom_op("steptune_test::inv_amax", mutates_args=())
def _inv_amax(x: torch.Tensor) -> float:
    return float(1.0 / x.abs().max())


@torch.library.custom_op("steptune_test::numpy_tanh", mutates_args=())
def _numpy_tanh(x: torch.Tensor) -> torch.Tensor:
    return torch.tanh(x)


@_numpy_tanh.register_fake
def _(x):
    return torch.empty_like(x)


def _numpy_setup(ctx, inputs, output):
    slope = torch.empty_like(output)  # filled outside the dispatcher: replaying it gives garbage
    slope.numpy()[:] = 1 - output.detach().numpy() ** 2
    ctx.save_for_backward(slope)


_numpy_tanh.register_autograd(lambda ctx, g: g * ctx.saved_tensors[0], setup_context=_numpy_setup)


class _ScaledBlock(torch.nn.Module):
    """An fp8-style scale: a custom op returns a number read from the activation's data."""

    def __init__(self, width):
        super().__init__()
        self.a = torch.nn.Linear(width, width)

    def forward(self, x):
        h = self.a(x)
        return torch.add(h, h, alpha=_inv_amax(h)).tanh()


class _NumpySetupBlock(torch.nn.Module):
    """A custom op whose registered autograd saves a tensor it fills with numpy."""

    def __init__(self, width):
        super().__init__()
        self.a = torch.nn.Linear(width, width)

    def forward(self, x):
        return x + _numpy_tanh(self.a(x))


class _FusedBlock(torch.nn.Module):
    """A block whose activation is a fused custom op with its own autograd (torch.library)."""

    def __init__(self, width):
        super().__init__()
        self.a, self.b = torch.nn.Linear(width, width), torch.nn.Linear(width, width)

    def forward(self, x):
        return x + self.b(_scaled_tanh(self.a(x)))


class _RangedBlock(torch.nn.Module):
    """A block that names its forward for the profiler."""

    def __init__(self, width):
        super().__init__()
        self.a, self.b = torch.nn.Linear(width, width), torch.nn.Linear(width, width)

    def forward(self, x):
        with torch.autograd.profiler.record_function("steptune_test_range"):
            return x + self.b(torch.tanh(self.a(x)))


def _train(block_cls, config=None, steps=3):
    """Each step's gradients (a new batch each step), the kernel calls made by backward, and the handle."""
    torch.manual_seed(0)
    model = Chain(block_cls)
    handle = apply_tapesac_(model, config) if config is not None else None
    grads, backward_calls = [], 0
    for step in range(steps):
        model.zero_grad(set_to_none=True)
        loss = model(torch.randn(8, 32, generator=torch.Generator().manual_seed(step)))
        before = _calls[0]
        loss.backward()
        backward_calls += _calls[0] - before
        grads.append({n: p.grad.clone() for n, p in model.named_parameters()})
    return grads, backward_calls, handle


def test_a_declared_pure_custom_op_is_replayed_and_reused():
    reference, _, _ = _train(_FusedBlock)
    # undeclared: held from forward (its kernel is hidden), and every forward records
    held, held_calls, handle = _train(_FusedBlock, TapeSACConfig(blocks=(_FusedBlock,)))
    assert all(max_abs_diff(r, g) == 0.0 for r, g in zip(reference, held, strict=True))
    assert held_calls == 0 and handle.stats.recorded == handle.stats.forwards
    assert any(k.startswith("custom op") for k in handle.stats.force_saved)
    # declared pure: replayed in backward like an aten op, and later forwards reuse the tape
    for names in ({"steptune_test.scaled_tanh"}, {torch.ops.steptune_test.scaled_tanh.default}):
        got, calls, handle = _train(_FusedBlock, TapeSACConfig(blocks=(_FusedBlock,), pure_ops=names))
        assert all(max_abs_diff(r, g) == 0.0 for r, g in zip(reference, got, strict=True))
        assert calls == handle.stats.forwards > 0  # one replay per block call
        assert not handle.stats.force_saved
        assert handle.stats.recorded < handle.stats.forwards


def test_a_profiler_range_neither_holds_values_nor_stops_reuse():
    reference, _, _ = _train(_RangedBlock)
    got, _, handle = _train(_RangedBlock, TapeSACConfig(blocks=(_RangedBlock,)))
    assert all(max_abs_diff(r, g) == 0.0 for r, g in zip(reference, got, strict=True))
    assert not handle.stats.force_saved and handle.stats.recorded < handle.stats.forwards
    # the range is opened once per block forward, reused or recorded, and never by a replay
    torch.manual_seed(0)
    model, x = Chain(_RangedBlock), torch.randn(8, 32)
    handle = apply_tapesac_(model, TapeSACConfig(blocks=(_RangedBlock,)))
    with torch.autograd.profiler.profile() as prof:
        for _ in range(2):
            model(x).sum().backward()
    ranges = [e for e in prof.function_events if e.name == "steptune_test_range"]
    assert len(ranges) == handle.stats.forwards and handle.stats.replays > 0


@pytest.mark.parametrize("pure", [frozenset(), frozenset({"steptune_test.inv_amax"})])
def test_a_custom_op_that_returns_a_number_is_a_host_sync_even_when_declared_pure(pure):
    # Found in review: a number-returning op was taken for inert and the tape reused with the first
    # batch's scale (gradients 1.1 and 3.2 off at steps 2 and 3)
    reference, _, _ = _train(_ScaledBlock)
    got, _, handle = _train(_ScaledBlock, TapeSACConfig(blocks=(_ScaledBlock,), pure_ops=pure))
    assert all(max_abs_diff(r, g) == 0.0 for r, g in zip(reference, got, strict=True))
    assert handle.stats.recorded == handle.stats.forwards
    assert any("returned a number" in k for k in handle.stats.force_saved)


@pytest.mark.parametrize("pure", [frozenset(), frozenset({"steptune_test.numpy_tanh"})])
def test_what_a_registered_autograds_setup_context_computes_stays_opaque(pure):
    # Found in review: the generated Function was trusted whole, so the numpy-filled slope was replayed as
    # an empty_like (gradients 1.8e26, then NaN)
    reference, _, _ = _train(_NumpySetupBlock)
    got, _, handle = _train(_NumpySetupBlock, TapeSACConfig(blocks=(_NumpySetupBlock,), pure_ops=pure))
    assert all(max_abs_diff(r, g) == 0.0 for r, g in zip(reference, got, strict=True))
    assert handle.stats.force_saved["kernel outside the dispatcher (inside a custom autograd.Function)"] > 0


def test_a_custom_op_that_writes_is_not_taken_for_inert():
    x = torch.zeros(3)
    reason = force_save_reason(torch.ops.steptune_test.bump_.default, (x,), {}, None)
    assert reason is not None and reason.startswith("custom op")


@pytest.mark.parametrize(
    ("pure_ops", "error", "says"),
    [
        ({"aten.mm.default"}, ValueError, "torch op"),
        ("steptune_test.scaled_tanh", TypeError, "not one string"),
        ({"steptune_test.no_such_op"}, ValueError, "TapeSACConfig.pure_ops: no op"),
        ({"scaled_tanh"}, ValueError, "TapeSACConfig.pure_ops"),
    ],
)
def test_pure_ops_names_are_checked(pure_ops, error, says):
    model = Chain(_FusedBlock)
    with pytest.raises(error, match=says):
        apply_tapesac_(model, TapeSACConfig(blocks=(_FusedBlock,), pure_ops=pure_ops))
    assert "forward" not in model.layers[0].__dict__  # nothing was wrapped
