"""torch.compile'd blocks: TapeSAC warns that they run eagerly, keeps gradients exact, and Dynamo never
traces into the recorder (which would break its graph many times per block)."""

import warnings

import pytest
import torch
from torch._dynamo.utils import counters

from steptune.memory import TapeSACConfig, apply_tapesac_
from steptune.testing.memory_blocks import Chain, DenseBlock

pytestmark = pytest.mark.timeout(120)


def _grads(model, x):
    model.zero_grad(set_to_none=True)
    model(x).backward()
    return {n.removeprefix("_orig_mod."): p.grad.clone() for n, p in model.named_parameters()}


@pytest.mark.parametrize("where", ["blocks", "whole_model", "blocks_after_apply"])
def test_compiled_blocks_warn_keep_exact_gradients_and_trace_no_recorder_code(where):
    torch.manual_seed(0)
    eager = Chain(DenseBlock, num=2, width=16)
    x = torch.randn(4, 16)
    reference = _grads(eager, x)
    torch._dynamo.reset()
    counters.clear()
    model, pattern = eager, "layers.*"
    if where == "whole_model":
        model, pattern = torch.compile(eager, backend="aot_eager"), "_orig_mod.layers.*"
    elif where == "blocks":
        for layer in eager.layers:
            layer.compile(backend="aot_eager")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        handle = apply_tapesac_(model, TapeSACConfig(blocks=pattern))
    if where == "blocks_after_apply":  # compiled later: nothing to warn about at apply time
        for layer in eager.layers:
            layer.compile(backend="aot_eager")
    warned = [w for w in caught if "torch.compile" in str(w.message)]
    assert len(warned) == (0 if where == "blocks_after_apply" else 1)
    for _ in range(2):
        got = _grads(model, x)
        assert all(torch.equal(reference[n], got[n]) for n in reference)
    assert handle.stats.replays == 4 and handle.stats.recorded == 2  # each block's first call
    # Dynamo traced the model's own frame at most, and stopped at each block wrapper; tracing into
    # the recorder instead costs ~50 frames and a dozen unsupported constructs per block (measured)
    assert counters["frames"]["total"] <= (1 if where == "whole_model" else 0)
    assert all("disable()" in reason for reason in counters["unimplemented"]), list(counters["unimplemented"])
    handle.remove()
    for layer in eager.layers:
        layer._compiled_call_impl = None
