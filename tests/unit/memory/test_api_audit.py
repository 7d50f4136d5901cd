"""The public API under what users do to models (the 2026-12-04 audit's findings): deepcopy (EMA and
reference models), pickling, deleting, containers and the root as blocks, plans and save policies."""

from __future__ import annotations

import copy
import functools
import gc
import io
import warnings
import weakref

import pytest
import torch
from torch import nn
from torch.multiprocessing.reductions import StorageWeakRef

from steptune.memory import TapeSACConfig, apply_tapesac_
from steptune.memory.apply import find_blocks


def _stack(n: int = 2, d: int = 8) -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(*[nn.Sequential(nn.Linear(d, d), nn.Tanh()) for _ in range(n)])


def test_a_deepcopy_runs_its_own_weights_and_has_its_own_handle() -> None:
    model = _stack()
    handle = apply_tapesac_(model, TapeSACConfig(blocks="?"))
    ema = copy.deepcopy(model)
    with torch.no_grad():
        for p in ema.parameters():
            p.zero_()
    x = torch.randn(4, 8)
    out = ema(x)
    assert out.abs().max().item() == 0.0  # the original's weights ran before
    out.sum().backward()
    assert all(p.grad is not None for p in ema.parameters())
    assert all(p.grad is None for p in model.parameters())
    assert ema._tapesac is not handle and ema._tapesac.model is ema
    assert {id(b.forward.state) for b in ema} == {id(ema._tapesac)}  # one handle for every copied block
    assert ema._tapesac.stats.forwards == 2 and handle.stats.forwards == 0
    ema._tapesac.remove()
    assert not any("forward" in b.__dict__ for b in ema) and all("forward" in b.__dict__ for b in model)
    ref = _stack()
    ref_out = ref(x)
    assert torch.equal(model(x), ref_out)  # the original still runs its own


def test_pickling_a_whole_applied_model_is_a_clear_error_and_state_dict_works() -> None:
    model = _stack()
    handle = apply_tapesac_(model, TapeSACConfig(blocks="?"))
    with pytest.raises(TypeError, match=r"cannot be pickled whole.*state_dict"):
        torch.save(model, io.BytesIO())
    torch.save(model.state_dict(), io.BytesIO())
    handle.remove()
    torch.save(model, io.BytesIO())


def test_an_applied_model_is_freed_without_the_cyclic_collector() -> None:
    gc.collect()
    gc.disable()
    try:
        model = _stack(d=256)
        weight = weakref.ref(model[0][0].weight)
        handle = apply_tapesac_(model, TapeSACConfig(blocks="?"))
        model(torch.randn(4, 256)).sum().backward()
        del model, handle
        assert weight() is None, "applying TapeSAC made a reference cycle that keeps the model alive"
    finally:
        gc.enable()


def test_a_container_or_the_root_as_blocks() -> None:
    hf = _qwen3()
    with pytest.raises(
        ValueError, match=r"'model.layers', a ModuleList, which is never called.*'model.layers.\*'"
    ):
        apply_tapesac_(hf, TapeSACConfig(blocks="model.layers"))
    assert [n for n, _ in find_blocks(hf, "lm_head")] == ["lm_head"]  # a top-level FQN, not only a class
    model = _stack()
    assert [n for n, _ in find_blocks(model, (nn.Sequential,))] == [""]  # outermost only: the root
    assert [n for n, _ in find_blocks(model, "*")] == [""]


def test_a_refused_apply_leaves_no_block_wrapped() -> None:
    model = _stack(3)
    model[2].forward = functools.partial(type(model[2]).forward, model[2])  # another wrapper's
    with pytest.raises(ValueError, match=r"\['2'\] already have an instance-level forward.*leave those"):
        apply_tapesac_(model, TapeSACConfig(blocks="?"))
    assert not any("forward" in b.__dict__ for b in model[:2]) and not hasattr(model, "_tapesac")
    del model[2].forward
    apply_tapesac_(model, TapeSACConfig(blocks="?")).remove()


def _qwen3(layers: int = 2):  # type: ignore[no-untyped-def]
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = AutoConfig.for_model("qwen3", hidden_size=64, intermediate_size=128, num_hidden_layers=layers,
                               num_attention_heads=4, num_key_value_heads=2, head_dim=16, vocab_size=128,
                               use_cache=False)  # fmt: skip
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(cfg)


def _step(model: nn.Module, seq: int = 16) -> None:
    x = torch.randint(0, 128, (2, seq), generator=torch.Generator().manual_seed(seq))
    model(input_ids=x, labels=x).loss.backward()


def test_a_memory_plan_in_place_of_its_save_plan_and_a_shape_the_plan_lacks() -> None:
    from steptune.memory.measure import measure_peak
    from steptune.memory.plan import calibrate, plan_saves
    from steptune.memory.profile import profile_model

    model = _qwen3()
    x = torch.randint(0, 128, (2, 16))
    batch = {"input_ids": x, "labels": x}
    profiles = profile_model(model, batch)
    floor, _ = measure_peak(model, batch, "tapesac_replay")
    plan = plan_saves(profiles, calibrate(profiles, floor), limit=2 * floor)
    with pytest.raises(
        TypeError, match=r"takes a SavePlan, got a MemoryPlan: call plan.save_plan\(profiles\)"
    ):
        apply_tapesac_(model, TapeSACConfig(plan=plan))  # crashed at the first forward before
    handle = apply_tapesac_(model, TapeSACConfig(plan=plan.save_plan(profiles)))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        _step(model, 16)  # the planned shape: quiet
    with pytest.warns(UserWarning, match="SavePlan has no entry for"):
        _step(model, 17)  # a shorter last batch: replay-only, now said
    handle.remove()


def test_an_earlier_handles_templates_do_not_override_a_save_policy() -> None:
    model = _qwen3()
    h = apply_tapesac_(model, TapeSACConfig())
    _step(model)
    h.remove()
    fresh = apply_tapesac_(model, TapeSACConfig(save_ops={"aten.mm"}))
    _step(model)
    fresh.remove()
    reused = apply_tapesac_(model, TapeSACConfig(save_ops={"aten.mm"}), templates=h.templates)
    _step(model)
    assert reused.stats.replayed_ops == fresh.stats.replayed_ops < h.stats.replayed_ops
    reused.remove()


class _MLP(nn.Module):
    def __init__(self, d: int = 64) -> None:
        super().__init__()
        self.up, self.down = nn.Linear(d, 4 * d), nn.Linear(4 * d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(torch.relu(self.up(x)))


@pytest.mark.parametrize("save_ops", [frozenset(), {"aten.addmm"}])
def test_values_backward_never_reads_are_not_held_until_backward(save_ops) -> None:
    torch.manual_seed(0)
    model = nn.Sequential(*[_MLP() for _ in range(3)])
    refs: list[StorageWeakRef] = []
    for b in model:  # the residual add reads down()'s output in forward only; no backward op does
        b.down.register_forward_hook(lambda m, i, o: refs.append(StorageWeakRef(o.untyped_storage())))
    x = torch.randn(128, 64, requires_grad=True)
    reference = torch.autograd.grad(model(x).sum(), [x, *model.parameters()])
    refs.clear()
    handle = apply_tapesac_(model, TapeSACConfig(blocks=(_MLP,), save_ops=save_ops))
    loss = model(x).sum()
    assert sum(not r.expired() for r in refs) == 0  # all 3 were held with save_ops before
    got = torch.autograd.grad(loss, [x, *model.parameters()])
    assert all(torch.equal(a, b) for a, b in zip(reference, got, strict=True))
    handle.remove()
