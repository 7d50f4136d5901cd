"""TapeSAC's contracts fail loudly: a second backward, an external mutated between forward and
backward, a tape that no longer matches the forward, bad configuration."""

import pytest
import torch

from steptune.memory import TapeSACConfig, TapeSACError, apply_tapesac_
from steptune.memory.measure import max_abs_diff
from steptune.testing.memory_blocks import Chain, DenseBlock, ToggleBlock

pytestmark = pytest.mark.timeout(60)


def _model(block=DenseBlock):
    torch.manual_seed(0)
    return Chain(block)


def test_second_backward_through_the_same_graph_raises():
    model = _model()
    apply_tapesac_(model, TapeSACConfig(blocks=(DenseBlock,)))
    loss = model(torch.randn(4, 32))
    loss.backward(retain_graph=True)
    with pytest.raises(TapeSACError, match="second backward"):
        loss.backward()


def test_parameter_mutated_between_forward_and_backward_raises():
    model = _model()
    apply_tapesac_(model, TapeSACConfig(blocks=(DenseBlock,)))
    loss = model(torch.randn(4, 32))
    with torch.no_grad():
        model.layers[1].a.weight.add_(1.0)  # an optimizer step before backward, say
    with pytest.raises(TapeSACError, match=r"a\.weight .*modified in place between forward and backward"):
        loss.backward()


def test_input_mutated_between_forward_and_backward_raises():
    model = _model()
    apply_tapesac_(model, TapeSACConfig(blocks=(DenseBlock,)))
    x = torch.randn(4, 32, requires_grad=True)
    h = x * 1.0
    loss = model.layers[0](h).sum()
    with torch.no_grad():
        h.mul_(2.0)
    with pytest.raises(TapeSACError, match=r"argument 0 .*modified in place"):
        loss.backward()


class _WriteAfterSave(torch.nn.Module):
    def __init__(self, width):
        super().__init__()
        self.a, self.w = torch.nn.Linear(width, width), torch.nn.Parameter(torch.randn(width))

    def forward(self, x):
        y = torch.sigmoid(self.a(x))  # sigmoid saves its output ...
        y.mul_(3.0)  # ... which this writes in place
        return x + y * self.w


@pytest.mark.parametrize("reuse", [False, True])
def test_a_value_written_in_place_after_autograd_saved_it_raises_as_without_tapesac(reuse):
    # Found in a sweep (2026-12-05): training without TapeSAC raises; TapeSAC replayed the written value
    # and gave wrong gradients (torch's own checkpoint does too).
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        _model(_WriteAfterSave)(torch.randn(4, 32)).backward()
    model = _model(_WriteAfterSave)
    apply_tapesac_(model, TapeSACConfig(blocks=(_WriteAfterSave,), reuse_tapes=reuse))
    for _ in range(2):  # the second forward reuses the tape
        with pytest.raises(RuntimeError, match="modified by an inplace operation: a value of TapeSAC block"):
            model(torch.randn(4, 32)).backward()


class _DataWrite(_WriteAfterSave):
    def forward(self, x):
        y = torch.sigmoid(self.a(x))
        y.data.clamp_(0.2, 0.8)  # through .data: autograd's version does not move, and it trains
        return x + y * self.w


def test_a_write_through_data_after_autograd_saved_the_value_trains_as_without_tapesac():
    # Found in review (2026-12-05): the first version of the check above compared storage versions and
    # raised here, where training without TapeSAC does not
    reference, model = _model(_DataWrite), _model(_DataWrite)
    apply_tapesac_(model, TapeSACConfig(blocks=(_DataWrite,)))
    x = torch.randn(4, 32)
    for net in (reference, model):
        for _ in range(2):  # recorded, then reused
            net.zero_grad()
            net(x).backward()
    got = {n: p.grad for n, p in model.named_parameters()}
    assert max_abs_diff({n: p.grad for n, p in reference.named_parameters()}, got) == 0.0


def test_a_new_shape_records_a_new_tape():
    model = _model()
    handle = apply_tapesac_(model, TapeSACConfig(blocks=(DenseBlock,)))
    for rows in (4, 6, 4):
        x = torch.randn(rows, 32)
        model(x).backward()
        got = {n: p.grad.clone() for n, p in model.named_parameters()}
        model.zero_grad(set_to_none=True)
        handle.remove()
        model(x).backward()
        want = {n: p.grad.clone() for n, p in model.named_parameters()}
        model.zero_grad(set_to_none=True)
        handle = apply_tapesac_(model, TapeSACConfig(blocks=(DenseBlock,)))
        assert max_abs_diff(want, got) == 0.0
    handle.remove()


def test_a_tape_that_no_longer_matches_the_forward_raises():
    model = _model(ToggleBlock)
    apply_tapesac_(model, TapeSACConfig(blocks=(ToggleBlock,)))
    model(torch.randn(4, 32)).backward()
    for layer in model.layers:
        layer.extra = True  # the ops change, the input shapes do not
    with pytest.raises(TapeSACError, match=r"reuse_tapes=False"):
        model(torch.randn(4, 32)).backward()


def test_recording_every_call_follows_python_level_changes():
    model = _model(ToggleBlock)
    handle = apply_tapesac_(model, TapeSACConfig(blocks=(ToggleBlock,), reuse_tapes=False))
    model(torch.randn(4, 32)).backward()
    for layer in model.layers:
        layer.extra = True
    model(torch.randn(4, 32)).backward()
    assert handle.stats.recorded == 4


def test_bad_configuration_says_what_to_change():
    model = _model()
    with pytest.raises(ValueError, match="selected no module"):
        apply_tapesac_(model, TapeSACConfig(blocks="decoder.*"))
    handle = apply_tapesac_(model, TapeSACConfig(blocks=(DenseBlock,)))
    with pytest.raises(ValueError, match="already applied"):
        apply_tapesac_(model, TapeSACConfig(blocks=(DenseBlock,)))
    handle.remove()
    with pytest.raises(TypeError, match="give an FQN pattern"):  # it wrapped the whole model (a sweep)
        apply_tapesac_(model, TapeSACConfig(blocks=""))


def test_profiling_and_measuring_keep_the_gradients_a_loop_has_accumulated():
    # Found in a sweep (2026-12-05): planning in the middle of gradient accumulation wiped .grad
    from steptune.memory.measure import measure_peak
    from steptune.memory.models import build_model, make_batch
    from steptune.memory.profile import profile_model

    model = build_model("qwen3-tiny")
    batch = make_batch("qwen3-tiny", batch=1, seq=16)
    model(**batch).loss.backward()
    before = {n: p.grad.clone() for n, p in model.named_parameters()}
    profile_model(model, batch, repeats=1, warmup=0)
    measure_peak(model, batch, "tapesac_replay")
    assert max_abs_diff(before, {n: p.grad for n, p in model.named_parameters()}) == 0.0


def test_no_grad_forward_runs_untouched():
    model = _model()
    handle = apply_tapesac_(model, TapeSACConfig(blocks=(DenseBlock,)))
    with torch.no_grad():
        model(torch.randn(4, 32))
    assert handle.stats.forwards == 0
    handle.remove()


def test_nothing_from_a_step_outlives_it():
    import gc
    import weakref

    model = _model()
    handle = apply_tapesac_(model, TapeSACConfig(blocks=(DenseBlock,)))
    for _ in range(2):  # the first step records the template, the second reuses it
        x = torch.randn(4, 32)
        h = model.inp(x)
        inputs = weakref.ref(h)
        loss = model.out(model.layers[1](model.layers[0](h))).sum()
        del h
        loss.backward()
        del loss
        gc.collect()
        assert inputs() is None  # neither the template nor a frame holds a block input
    assert len(handle.templates) == 1
    handle.remove()


def test_checkpointing_already_on_a_block_is_refused_with_what_to_call():
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

    from steptune.memory.models import build_model, make_batch

    model = build_model("qwen3-tiny")
    model.activation_checkpointing_enable({"use_reentrant": False})  # transformers 5's name
    with pytest.raises(ValueError, match=r"activation_checkpointing_disable\(\)"):
        apply_tapesac_(model)
    model.activation_checkpointing_disable()
    handle = apply_tapesac_(model)
    model.activation_checkpointing_enable({"use_reentrant": False})
    with pytest.raises(TapeSACError, match="after apply_tapesac_"):  # enabled later: refused at the call
        model(**make_batch("qwen3-tiny")).loss.backward()
    handle.remove()
    model.activation_checkpointing_disable()
    model.model.layers[0] = checkpoint_wrapper(model.model.layers[0])  # torchtitan's wrapper
    with pytest.raises(ValueError, match="checkpoint_wrapper"):
        apply_tapesac_(model, TapeSACConfig(blocks="Qwen3DecoderLayer"))


@pytest.mark.parametrize("reuse", [True, False])
def test_a_recorded_step_frees_its_activations_without_the_cyclic_collector(reuse):
    """The recorder held its block inputs in a reference cycle (recorder -> pack closure -> recorder):
    after backward they stayed alive until gc ran (on an H200, 64-196 MiB above the planned peak)."""
    import gc
    import weakref

    model = _model()
    apply_tapesac_(model, TapeSACConfig(blocks=(DenseBlock,), reuse_tapes=reuse))
    inputs: list[weakref.ref] = []
    for layer in model.layers:
        layer.register_forward_pre_hook(lambda _m, args: inputs.append(weakref.ref(args[0])))
    gc.collect()
    gc.disable()
    try:
        for _ in range(2):  # the first step records; with reuse the second runs the stored template
            model(torch.randn(4, 32)).backward()
        alive = [r for r in inputs if r() is not None]
    finally:
        gc.enable()
    assert len(inputs) == 4 and alive == []


def test_blocks_takes_a_class_or_list_and_refuses_anything_else():
    model = _model()
    for blocks in (DenseBlock, [DenseBlock]):
        handle = apply_tapesac_(model, TapeSACConfig(blocks=blocks))
        assert len(handle.blocks) == 2
        handle.remove()
    with pytest.raises(TypeError, match=r"blocks=123\): give an FQN pattern"):  # was "int is not iterable"
        apply_tapesac_(model, TapeSACConfig(blocks=123))


class _ReshapedWeight(torch.nn.Module):
    def __init__(self, width):
        super().__init__()
        self.w = torch.nn.Parameter(torch.randn(width, width))

    def forward(self, x):  # reshape views a contiguous weight and copies a column-major one
        return torch.tanh(x @ (self.w.reshape(-1) + 1.0).reshape(self.w.shape))


def test_a_weight_with_other_strides_records_a_new_tape():
    # Found in a sweep (2026-12-05): load_state_dict(assign=True) with column-major weights reused the tape
    # recorded on contiguous ones, and backward failed ("view size is not compatible")
    reference, model = _model(_ReshapedWeight), _model(_ReshapedWeight)
    handle = apply_tapesac_(model, TapeSACConfig(blocks=(_ReshapedWeight,)))
    x = torch.randn(4, 32)
    model(x).backward()
    column_major = {k: v.detach().clone().t().contiguous().t() for k, v in reference.state_dict().items()}
    for net in (reference, model):
        net.load_state_dict(column_major, assign=True)
        net.zero_grad()
        net(x).backward()
    assert max_abs_diff(
        {n: p.grad for n, p in reference.named_parameters()}, {n: p.grad for n, p in model.named_parameters()}
    ) == 0.0 and handle.stats.recorded == 4  # fmt: skip


class _ForceField(torch.nn.Module):
    def __init__(self, width):
        super().__init__()
        self.a = torch.nn.Linear(width, 1)

    def forward(self, x):
        energy = self.a(torch.tanh(x)).sum()
        return torch.autograd.grad(-energy, x, create_graph=True)[0]  # forces: a gradient inside forward


def test_a_gradient_taken_inside_a_blocks_forward_is_a_clear_error_and_torch_func_runs_plainly():
    # Found in a sweep (2026-12-05): a bare AssertionError ("backward before forward finished"), and
    # torch.func's grad / vmap failed with "Cannot access storage of TensorWrapper"
    model = _model(_ForceField)
    apply_tapesac_(model, TapeSACConfig(blocks=(_ForceField,)))
    with pytest.raises(TapeSACError, match=r"ran backward before its forward finished .* block out"):
        model(torch.randn(4, 32, requires_grad=True)).backward()
    reference, model = _model(), _model()
    handle = apply_tapesac_(model, TapeSACConfig(blocks=(DenseBlock,)))
    x = torch.randn(4, 32)

    def loss(params, net):
        return torch.func.functional_call(net, params, (x,))

    want = torch.func.grad(loss)(dict(reference.named_parameters()), reference)
    got = torch.func.grad(loss)(dict(model.named_parameters()), model)
    detached = [{k: v.detach() for k, v in d.items()} for d in (want, got)]
    assert max_abs_diff(*detached) == 0.0 and handle.stats.forwards == 0
