"""Gradients under TapeSAC equal plain training's bit for bit (fp32, deterministic CPU kernels)."""

import pytest
import torch

from steptune.memory import TapeSACConfig, apply_tapesac_
from steptune.memory.measure import grads, max_abs_diff
from steptune.memory.models import build_model, make_batch
from steptune.memory.tape import TapeSACError
from steptune.testing.memory_blocks import Chain, DenseBlock, DropoutBlock, InplaceViewBlock, OpaqueBlock

pytestmark = pytest.mark.timeout(120)


def _chain_grads(model, x, seed, config=None):
    model.zero_grad(set_to_none=True)
    handle = apply_tapesac_(model, config) if config is not None else None
    torch.manual_seed(seed)
    model(x).backward()
    after = torch.rand(1)  # where the generator stands after backward
    if handle is not None:
        handle.remove()
    out = {n: p.grad.clone() for n, p in model.named_parameters()}
    return out, after, handle


@pytest.mark.parametrize("name", ["llama-tiny", "qwen3-tiny", "qwen3-moe-tiny"])
def test_hf_models_match_no_checkpointing_over_steps(name):
    model = build_model(name)
    handle = apply_tapesac_(model, TapeSACConfig())
    for step in range(3):  # a new batch each step: reused tapes must replay this step's values
        batch = make_batch(name, seed=step)
        handle.remove()
        reference = grads(model, batch, "no_ac")
        handle = apply_tapesac_(model, TapeSACConfig())
        got = grads(model, batch, "no_ac")  # "no_ac" adds nothing: TapeSAC is already applied
        assert max_abs_diff(reference, got) == 0.0
        assert handle.stats.replays == model.config.num_hidden_layers
    handle.remove()


@pytest.mark.parametrize("name", ["llama-tiny", "qwen3-moe-tiny"])
def test_identical_layers_share_one_tape_and_later_steps_skip_the_mode(name):
    model = build_model(name)
    handle = apply_tapesac_(model)
    for step in range(3):
        grads(model, make_batch(name, seed=step), "no_ac")
    assert handle.stats.forwards == 3 * model.config.num_hidden_layers
    # each layer's first call is recorded and checked against the shared tape; later steps record nothing
    assert handle.stats.recorded == model.config.num_hidden_layers
    assert len(handle.templates) == 1 and not handle.templates.split
    handle.remove()


def test_bf16_autocast_matches_no_checkpointing_under_the_same_autocast():
    model = build_model("qwen3-tiny")
    batch = make_batch("qwen3-tiny")
    with torch.autocast("cpu", dtype=torch.bfloat16):
        reference = grads(model, batch, "no_ac")
        got = grads(model, batch, "tapesac_replay")
    assert max_abs_diff(reference, got) == 0.0


def _autocast_steps(model, batch, handle_config, steps, optimizer_steps):
    """``steps`` forward+backward passes inside ONE autocast region; SGD after each if ``optimizer_steps``."""
    handle = apply_tapesac_(model, handle_config) if handle_config is not None else None
    out = []
    with torch.autocast("cpu", dtype=torch.bfloat16):
        for _ in range(steps):
            model.zero_grad(set_to_none=True)
            model(**batch).loss.backward()
            out.append({n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None})
            if optimizer_steps:
                with torch.no_grad():
                    for p in model.parameters():
                        if p.grad is not None:
                            p -= 0.1 * p.grad
    if handle is not None:
        handle.remove()
    return out


def test_an_autocast_region_spanning_optimizer_steps_is_refused_not_silently_wrong():
    # Found by a sweep (2026-12-05): autocast caches each weight's bf16 cast until its outermost region
    # exits, so a region around several steps feeds the next forward the cast of the old weights; a reused
    # tape replays the cast of the new ones (gradients 0.02-0.1 off, silently). It is now refused.
    import copy

    base = build_model("llama-tiny")
    batch = make_batch("llama-tiny")
    with pytest.raises(TapeSACError, match=r"torch.autocast region spans an optimizer step"):
        _autocast_steps(copy.deepcopy(base), batch, TapeSACConfig(), 2, optimizer_steps=True)
    # Several backward passes in one region without a step (gradient accumulation) use valid casts: exact
    reference = _autocast_steps(copy.deepcopy(base), batch, None, 3, optimizer_steps=False)
    got = _autocast_steps(copy.deepcopy(base), batch, TapeSACConfig(), 3, optimizer_steps=False)
    assert [max_abs_diff(a, b) for a, b in zip(reference, got, strict=True)] == [0.0, 0.0, 0.0]


def test_dropout_replays_the_same_masks_and_leaves_the_generator_where_it_was():
    torch.manual_seed(0)
    model = Chain(DropoutBlock).train()
    x = torch.randn(16, 32)
    reference, after_ref, _ = _chain_grads(model, x, seed=3)
    got, after, handle = _chain_grads(model, x, seed=3, config=TapeSACConfig(blocks=(DropoutBlock,)))
    assert max_abs_diff(reference, got) == 0.0
    assert torch.equal(after, after_ref)
    assert handle.stats.recorded == 2  # random ops: recorded every call, never reused
    assert handle.stats.replays == 2


def test_dropout_without_rng_restore_would_differ(monkeypatch):
    """Negative control: the test above fails if replay draws fresh masks."""
    import steptune.memory.replay as replay

    torch.manual_seed(0)
    model = Chain(DropoutBlock).train()
    x = torch.randn(16, 32)
    reference, _, _ = _chain_grads(model, x, seed=3)
    monkeypatch.setattr(replay, "_set_rng", lambda snapshot: None)
    got, _, _ = _chain_grads(model, x, seed=3, config=TapeSACConfig(blocks=(DropoutBlock,)))
    assert max_abs_diff(reference, got) > 0.0


@pytest.mark.parametrize("block", [InplaceViewBlock, OpaqueBlock, DenseBlock])
def test_inplace_views_and_custom_functions_match(block):
    torch.manual_seed(0)
    model = Chain(block)
    x = torch.randn(8, 32)
    reference, _, _ = _chain_grads(model, x, seed=0)
    for _ in range(2):  # second pass reuses the tape where it may
        got, _, handle = _chain_grads(model, x, seed=0, config=TapeSACConfig(blocks=(block,)))
        assert max_abs_diff(reference, got) == 0.0
        assert handle.stats.replays == 2


def test_removing_restores_the_plain_forward():
    model = Chain(DenseBlock)
    handle = apply_tapesac_(model, TapeSACConfig(blocks=(DenseBlock,)))
    assert all("forward" in layer.__dict__ for layer in model.layers)
    handle.remove()
    assert all("forward" not in layer.__dict__ for layer in model.layers)
    handle = apply_tapesac_(model, TapeSACConfig(blocks="layers.*"))  # by FQN pattern
    assert len(handle.blocks) == 2
    handle.remove()


def test_a_save_set_cuts_the_replay_and_keeps_gradients_exact():
    model = build_model("qwen3-tiny")
    batch = make_batch("qwen3-tiny")
    reference = grads(model, batch, "no_ac")
    replay_only = apply_tapesac_(model, TapeSACConfig())
    grads(model, batch, "no_ac")
    replay_only.remove()
    saving = apply_tapesac_(model, TapeSACConfig(save_ops=frozenset({"aten.mm.default"}), count_flops=True))
    got = grads(model, batch, "no_ac")
    saving.remove()
    assert max_abs_diff(reference, got) == 0.0
    assert saving.stats.replayed_flops == 0  # every matmul output is held, so no matmul is replayed
    assert 0 < saving.stats.replayed_ops < replay_only.stats.replayed_ops


def test_an_hf_kv_cache_argument_warns_once_and_records_every_call():
    # use_cache=True makes HF pass a DynamicCache to every layer: the call cannot be keyed, so the
    # tape is recorded every time; the user is told why and what to set.
    model = build_model("qwen3-tiny")
    model.config.use_cache = True
    batch = make_batch("qwen3-tiny")
    reference = grads(model, batch, "no_ac")
    handle = apply_tapesac_(model)
    with pytest.warns(UserWarning, match="use_cache = False") as record:
        got = grads(model, batch, "no_ac")
        grads(model, batch, "no_ac")
    handle.remove()
    assert len([w for w in record if "TapeSAC" in str(w.message)]) == 1
    assert handle.stats.recorded == handle.stats.forwards == 2 * model.config.num_hidden_layers
    assert max_abs_diff(reference, got) == 0.0


@pytest.mark.parametrize(
    "ops", [{"aten.mm"}, {torch.ops.aten.mm.default}, {torch.ops.aten.mm}, ["aten.mm.default"]]
)
def test_save_ops_accepts_packets_and_op_objects(ops):
    """'aten.mm' (every overload) and torch.ops objects save the same as 'aten.mm.default': before,
    anything but the exact overload string saved nothing, silently."""
    model = build_model("qwen3-tiny")
    batch = make_batch("qwen3-tiny")
    handle = apply_tapesac_(model, TapeSACConfig(save_ops=ops, count_flops=True))
    grads(model, batch, "no_ac")
    handle.remove()
    assert handle.stats.replayed_flops == 0 and handle.stats.replayed_ops > 0


@pytest.mark.parametrize(
    ("ops", "error", "match"),
    [
        ("aten.mm.default", TypeError, r"not one string: write save_ops=\{'aten.mm.default'\}"),
        ({"mm"}, ValueError, r"write 'aten.mm.default' \(one overload\) or 'aten.mm'"),
        ({"aten.mmm.default"}, ValueError, "no op aten.mmm is registered"),
        ({"aten.mm.defualt"}, ValueError, "has no overload 'defualt'; it has default"),
        ({3}, TypeError, "holds 3"),
        # found in a sweep (2026-12-05): composite ops decompose before the recorder, and were taken
        ({"aten.linear"}, ValueError, r"aten.linear decomposes .* becomes \(aten.mm / aten.addmm\)"),
        ({torch.ops.aten.softmax.int}, ValueError, r"aten.softmax.int decomposes .*\(aten._softmax\)"),
    ],
)
def test_save_ops_that_would_save_nothing_are_refused(ops, error, match):
    with pytest.raises(error, match=match):
        apply_tapesac_(build_model("qwen3-tiny"), TapeSACConfig(save_ops=ops))


class _ScaledBlock(torch.nn.Module):
    """Identical shapes in every instance, but each scales by its own constant (as GPT-2's attention does
    with scale_attn_by_inverse_layer_idx)."""

    def __init__(self, scale):
        super().__init__()
        self.a, self.b = torch.nn.Linear(16, 16), torch.nn.Linear(16, 16)
        self.scale = scale

    def forward(self, x):
        return x + self.b(torch.tanh(self.a(x) * self.scale))


def test_blocks_that_differ_only_in_a_constant_do_not_share_a_tape():
    # Found by a sweep of 46 HF architectures (2026-12-05): layer 1 reused layer 0's tape, whose replay
    # multiplied by layer 0's constant: silently wrong gradients (4e-4). Each block's first call is now
    # recorded and compared with the shared tape.
    torch.manual_seed(0)
    # block 0 has a signature of its own (its input needs no gradient); blocks 1-3 share one
    model = torch.nn.Sequential(*(_ScaledBlock(s) for s in (1.0, 1.0, 0.5, 1.0)))
    x = torch.randn(4, 16)

    def step():
        model.zero_grad(set_to_none=True)
        model(x).sum().backward()
        return {n: p.grad.clone() for n, p in model.named_parameters()}

    reference = step()
    handle = apply_tapesac_(model, TapeSACConfig(blocks=[_ScaledBlock]))
    assert [max_abs_diff(reference, step()) for _ in range(2)] == [0.0, 0.0]  # step 2 reuses the templates
    assert handle.stats.recorded == 4 and handle.templates.split == {"2"}
    assert len(handle.templates) == 3  # block 0's, the one blocks 1 and 3 share, and block 2's own
    handle.remove()


def _hf_diffs_under_tapesac(model_type, **config):
    """Gradient differences of two TapeSAC steps (record, then reuse) against plain training, for a tiny
    HF model of ``model_type`` (eager attention, no KV cache), and the TapeSAC handle."""
    transformers = pytest.importorskip("transformers")
    cfg = transformers.AutoConfig.for_model(model_type, **config)
    cfg.use_cache = False
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(cfg, attn_implementation="eager")
    ids = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(1))

    def step():
        model.zero_grad(set_to_none=True)
        model(input_ids=ids, labels=ids).loss.backward()
        return {n: p.grad.clone() for n, p in model.named_parameters()}

    reference = step()
    handle = apply_tapesac_(model, TapeSACConfig())
    diffs = [max_abs_diff(reference, step()) for _ in range(2)]
    handle.remove()
    return diffs, handle


def test_gpt2_with_per_layer_attention_scales_matches_no_checkpointing():
    diffs, handle = _hf_diffs_under_tapesac(
        "gpt2", n_embd=64, n_layer=2, n_head=4, vocab_size=128, n_positions=64,
        scale_attn_by_inverse_layer_idx=True, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
    )  # fmt: skip
    assert diffs == [0.0, 0.0]
    assert handle.stats.replays == 4 and len(handle.templates.split) == 1


def test_hybrid_layers_of_one_class_get_their_own_tapes():
    # SmolLM3 skips rotary embeddings on the layers no_rope_layers marks 0: same class and shapes, other ops.
    # Before 2026-12-05 the second layer reused the first's tape and the first backward raised a
    # TapeSACError asking for reuse_tapes=False; now that layer keeps a tape of its own.
    diffs, handle = _hf_diffs_under_tapesac(
        "smollm3", hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4,
        vocab_size=128, intermediate_size=128, no_rope_layers=[1, 0], pad_token_id=0, eos_token_id=1,
    )  # fmt: skip
    assert diffs == [0.0, 0.0]
    assert handle.templates.split == {"model.layers.1"} and handle.stats.recorded == 2
