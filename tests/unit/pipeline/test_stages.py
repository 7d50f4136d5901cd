"""Stages and unit lists: exact split equivalence, the I/W backward split, and the sleep harness.

Correctness is checked bit for bit in fp32 against the unsplit model; the sleep harness by call
counts (exact) and by wall time with sleeps that must *not* run set large, so the margins are wide.
"""

from __future__ import annotations

import threading
import time

import pytest
import torch
from torch import nn

from steptune.pipeline.costs import LayerCosts
from steptune.pipeline.stages import (
    SleepLayer,
    Stage,
    boundary_shape,
    hf_decoder_layers,
    lm_loss,
    sleep_layers,
    split_layers,
    tiny_decoder_layers,
)

VOCAB, SEQ = 128, 16


def _tokens(batch=2, seq=SEQ, vocab=VOCAB, seed=1):
    g = torch.Generator().manual_seed(seed)
    ids, targets = torch.randint(0, vocab, (2, batch, seq), generator=g)
    return ids, targets


def _params(layers):
    return [p for layer in layers for p in layer.parameters()]


def _reference_grads(layers, ids, targets):
    for p in _params(layers):
        p.grad = None
    x = ids
    for layer in layers:
        x = layer(x)
    lm_loss(x, targets).backward()
    grads = [p.grad.clone() for p in _params(layers)]
    for p in _params(layers):
        p.grad = None
    return x.detach(), grads


def _pipelined_grads(stages, ids, targets, *, split_iw):
    """Run stages as an executor would: detached boundaries, then per stage I and W (or fused B)."""
    inputs, outputs, x = [], [], ids
    for stage in stages:
        inp = x.detach().requires_grad_() if x.is_floating_point() else x
        out, outs = stage.forward_collect(inp)
        assert out is outs[-1]
        inputs.append(inp)
        outputs.append(outs)
        x = out
    logits = x
    (grad,) = torch.autograd.grad(lm_loss(logits, targets), logits)
    for stage, inp, outs in zip(reversed(stages), reversed(inputs), reversed(outputs), strict=True):
        wanted = ([inp] if inp.requires_grad else []) + outs[:-1]
        if not split_iw:
            torch.autograd.backward(outs[-1], grad)
            grad = inp.grad
            continue
        # I: gradients of the stage input and of every unit output but the last, weights untouched.
        got = torch.autograd.grad(outs[-1], inputs=wanted, grad_outputs=grad, retain_graph=True)
        assert all(p.grad is None for p in _params(stage.layers))
        unit_grads = [*got[1 if inp.requires_grad else 0 :], grad]
        # W: per unit, from its own output's gradient.
        for out_l, grad_l, params_l in zip(outs, unit_grads, stage.layer_params(), strict=True):
            torch.autograd.backward(out_l, grad_l, inputs=params_l)
        grad = got[0] if inp.requires_grad else None
    return logits.detach(), [p.grad.clone() for stage in stages for p in _params(stage.layers)]


# --- split_layers and Stage ----------------------------------------------------------------------


@pytest.mark.parametrize("partition", [(2, 2), (1, 2), (4, 0, 1), (), (6, -1)])
def test_split_layers_rejects_bad_partitions(partition):
    with pytest.raises(ValueError, match="partition"):
        split_layers([nn.Linear(2, 2) for _ in range(5)], partition)


def test_split_layers_shares_modules_and_parameters():
    layers = [nn.Linear(3, 3) for _ in range(5)]
    stages = split_layers(layers, (2, 1, 2))
    assert [(s.index, s.num_stages, len(s.layers)) for s in stages] == [(0, 3, 2), (1, 3, 1), (2, 3, 2)]
    assert [m for s in stages for m in s.layers] == layers
    assert all(a is b for a, b in zip((m for s in stages for m in s.layers), layers, strict=True))
    assert [id(p) for s in stages for p in s.parameters()] == [id(p) for p in _params(layers)]
    assert stages[1].layer_params() == [[layers[2].weight, layers[2].bias]]
    layers[3].bias.requires_grad_(False)
    assert stages[2].layer_params() == [[layers[3].weight], [layers[4].weight, layers[4].bias]]


def test_forward_collect_matches_sequential_application():
    layers = tiny_decoder_layers()
    ids, _ = _tokens()
    stage = Stage(layers, index=0, num_stages=1)
    out, outs = stage.forward_collect(ids)
    x = ids
    for layer, got in zip(layers, outs, strict=True):
        x = layer(x)
        assert torch.equal(got, x)
    assert out is outs[-1]
    assert torch.equal(stage(ids), out)


def test_boundary_shape_per_unit():
    layers = tiny_decoder_layers(vocab=64, hidden=16, num_layers=2, num_heads=2, seq_len=8)
    ids = torch.zeros(3, 8, dtype=torch.int64)
    hidden = (torch.Size([3, 8, 16]), torch.float32)
    assert boundary_shape(layers, ids) == [hidden, hidden, hidden, (torch.Size([3, 8, 64]), torch.float32)]
    stages = split_layers(layers, (3, 1))
    assert boundary_shape(stages, ids) == [hidden, (torch.Size([3, 8, 64]), torch.float32)]
    assert (
        boundary_shape(sleep_layers(_costs(2), hidden=5), torch.ones(4, 5))
        == [(torch.Size([4, 5]), torch.float32)] * 2
    )


# --- Tiny decoder --------------------------------------------------------------------------------


def test_tiny_decoder_is_deterministic_and_keeps_global_rng():
    state = torch.random.get_rng_state()
    a, b, c = tiny_decoder_layers(seed=3), tiny_decoder_layers(seed=3), tiny_decoder_layers(seed=4)
    assert torch.equal(torch.random.get_rng_state(), state)
    assert all(torch.equal(p, q) for p, q in zip(_params(a), _params(b), strict=True))
    assert not all(torch.equal(p, q) for p, q in zip(_params(a), _params(c), strict=True))
    with pytest.raises(ValueError, match="seq_len"):
        a[0](torch.zeros(1, SEQ + 1, dtype=torch.int64))


def test_tiny_decoder_is_causal():
    layers = tiny_decoder_layers()
    ids, _ = _tokens(batch=1)
    changed = ids.clone()
    changed[0, -1] = (changed[0, -1] + 1) % VOCAB
    out, out_changed = (
        Stage(layers, index=0, num_stages=1)(ids),
        Stage(layers, index=0, num_stages=1)(changed),
    )
    assert torch.equal(out[:, :-1], out_changed[:, :-1])
    assert not torch.equal(out[:, -1], out_changed[:, -1])


@pytest.mark.parametrize("split_iw", [False, True], ids=["fused_b", "i_then_w"])
def test_tiny_decoder_three_stages_match_unsplit_exactly(split_iw):
    layers = tiny_decoder_layers(num_layers=4)
    ids, targets = _tokens()
    ref_logits, ref_grads = _reference_grads(layers, ids, targets)
    logits, grads = _pipelined_grads(split_layers(layers, (2, 2, 2)), ids, targets, split_iw=split_iw)
    assert torch.equal(logits, ref_logits)
    assert len(grads) == len(ref_grads)
    for got, want in zip(grads, ref_grads, strict=True):
        assert got.abs().sum() > 0
        assert torch.equal(got, want)


# --- transformers models -------------------------------------------------------------------------


def _hf_model(kind, **overrides):
    transformers = pytest.importorskip("transformers")
    config_cls = {"llama": transformers.LlamaConfig, "qwen3": transformers.Qwen3Config}[kind]
    kwargs = dict(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        vocab_size=256,
        max_position_embeddings=64,
        tie_word_embeddings=False,
    )
    kwargs.update(overrides)
    attn = kwargs.pop("attn_implementation", "sdpa")
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        return transformers.AutoModelForCausalLM.from_config(config_cls(**kwargs), attn_implementation=attn)


@pytest.mark.parametrize("kind", ["llama", "qwen3"])
def test_hf_units_match_model_forward_and_backward(kind):
    model = _hf_model(kind)
    units = hf_decoder_layers(model)
    assert len(units) == 4
    assert {id(p) for p in _params(units)} == {id(p) for p in model.parameters()}
    ids, targets = _tokens(vocab=256, seq=12)

    logits_ref = model(ids).logits
    lm_loss(logits_ref, targets).backward()
    grads_ref = {name: p.grad.clone() for name, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)

    logits, _ = _pipelined_grads(split_layers(units, (2, 2)), ids, targets, split_iw=True)
    assert (logits - logits_ref.detach()).abs().max() < 1e-5
    for name, p in model.named_parameters():
        torch.testing.assert_close(p.grad, grads_ref[name], rtol=1e-5, atol=1e-6, msg=name)


@pytest.mark.parametrize(
    ("kind", "overrides", "match"),
    [
        ("llama", {"attn_implementation": "eager"}, "sdpa"),
        ("llama", {"tie_word_embeddings": True}, "tie_word_embeddings"),
        ("qwen3", {"use_sliding_window": True, "sliding_window": 4, "max_window_layers": 1}, "sliding"),
    ],
)
def test_hf_units_reject_unsupported_configs(kind, overrides, match):
    model = _hf_model(kind, **overrides)
    with pytest.raises(ValueError, match=match):
        hf_decoder_layers(model)


def test_hf_units_reject_non_llama_models():
    with pytest.raises(ValueError, match="Llama-style"):
        hf_decoder_layers(nn.Linear(2, 2))


# --- Sleep harness -------------------------------------------------------------------------------


def _costs(n, f=0.0, i=0.0, w=0.0):
    return LayerCosts(
        f=(f,) * n,
        i=(i,) * n,
        w=(w,) * n,
        act_bytes=(0.0,) * n,
        out_bytes=(0.0,) * n,
        static_bytes=(0.0,) * n,
    )


def test_sleep_layer_gradients_are_those_of_x_a_plus_b():
    layer = SleepLayer(0.0, 0.0, 0.0, hidden=6)
    x = torch.linspace(-1.0, 1.0, 18).reshape(3, 6).requires_grad_()
    g = torch.linspace(0.5, 2.0, 18).reshape(3, 6)
    y = layer(x)
    y.backward(g)
    grads = [t.grad.clone() for t in (x, layer.a, layer.b)]

    x2, a2, b2 = (t.detach().clone().requires_grad_() for t in (x, layer.a, layer.b))
    y2 = x2 * a2 + b2
    y2.backward(g)
    assert torch.equal(y, y2)
    for got, want in zip(grads, (x2.grad, a2.grad, b2.grad), strict=True):
        torch.testing.assert_close(got, want)
        assert got.abs().sum() > 0


def test_sleep_layer_input_path_runs_alone():
    layer = SleepLayer(0.0, 0.02, 0.25)
    x = torch.ones(4, 16, requires_grad=True)
    y = layer(x)
    start = time.perf_counter()
    (gx,) = torch.autograd.grad(y, inputs=[x], grad_outputs=torch.ones_like(y), retain_graph=True)
    elapsed = time.perf_counter() - start
    assert (layer.num_input_backward, layer.num_weight_backward) == (1, 0)
    assert 0.02 <= elapsed < 0.2
    assert layer.a.grad is None and torch.equal(gx, layer.a.detach().expand(4, 16))

    start = time.perf_counter()
    torch.autograd.backward(y, torch.ones_like(y), inputs=[layer.a, layer.b])
    elapsed = time.perf_counter() - start
    assert (layer.num_input_backward, layer.num_weight_backward) == (1, 1)
    assert 0.25 <= elapsed < 0.6
    assert x.grad is None


def test_sleep_layer_weight_path_runs_alone():
    layer = SleepLayer(0.0, 0.5, 0.02)
    x = torch.ones(4, 16, requires_grad=True)
    y = layer(x)
    start = time.perf_counter()
    torch.autograd.backward(y, torch.ones_like(y), inputs=list(layer.parameters()))
    elapsed = time.perf_counter() - start
    assert (layer.num_input_backward, layer.num_weight_backward) == (0, 1)
    assert 0.02 <= elapsed < 0.2
    assert x.grad is None
    assert torch.equal(layer.b.grad, torch.full((16,), 4.0))


def test_sleep_stage_i_then_w_counts_each_path_once_per_layer():
    layers = sleep_layers(_costs(3))
    stage = split_layers(layers, (3,))[0]
    x = torch.ones(2, 16, requires_grad=True)
    out, outs = stage.forward_collect(x)
    got = torch.autograd.grad(
        out, inputs=[x, *outs[:-1]], grad_outputs=torch.ones_like(out), retain_graph=True
    )
    assert [(m.num_input_backward, m.num_weight_backward) for m in layers] == [(1, 0)] * 3
    for out_l, grad_l, params_l in zip(
        outs, [*got[1:], torch.ones_like(out)], stage.layer_params(), strict=True
    ):
        torch.autograd.backward(out_l, grad_l, inputs=params_l)
    assert [(m.num_forward, m.num_input_backward, m.num_weight_backward) for m in layers] == [(1, 1, 1)] * 3


def test_sleep_layers_scale_names_and_thread_overlap():
    costs = LayerCosts(
        f=(0.01, 0.02), i=(0.03, 0.04), w=(0.05, 0.06), act_bytes=(0.0, 0.0), out_bytes=(0.0, 0.0),
        static_bytes=(0.0, 0.0), names=("emb", "head"),
    )  # fmt: skip
    layers = sleep_layers(costs, scale=2.0, hidden=4)
    assert [(m.f, m.i, m.w, m.name) for m in layers] == [(0.02, 0.06, 0.1, "emb"), (0.04, 0.08, 0.12, "head")]
    assert layers[0].a.shape == (4,)
    with pytest.raises(ValueError, match="scale"):
        sleep_layers(costs, scale=-1.0)
    with pytest.raises(ValueError, match=">= 0"):
        SleepLayer(0.1, -0.1, 0.0)

    # Two thread "ranks", 4 x 25 ms of forward each: sleeping releases the GIL, so they overlap.
    ranks = [Stage(sleep_layers(_costs(4, f=0.025)), index=r, num_stages=2) for r in range(2)]
    threads = [threading.Thread(target=stage, args=(torch.ones(2, 16),)) for stage in ranks]
    start = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    elapsed = time.perf_counter() - start
    assert 0.1 <= elapsed < 0.18
