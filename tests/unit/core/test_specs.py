"""Spec presets against hand-computed numbers from the published configs."""

import pytest

from steptune.core.specs import (
    LayerKind,
    Phase,
    cluster_preset,
    list_cluster_presets,
    list_model_presets,
    model_preset,
)


def test_llama2_7b_layer_flops_by_hand():
    m = model_preset("llama2-7b")
    layer = m.layers[1]
    assert layer.kind is LayerKind.DECODER
    # attention 4 h^2 + SwiGLU 3 h i, h = 4096, i = 11008
    params = 4 * 4096**2 + 3 * 4096 * 11008
    assert params == 202_375_168
    assert layer.params == params
    s = 4096
    # forward: 2 FLOPs per MAC on the weights, plus causal QK^T and PV: 2 * 2 * s^2 * h / 2
    f = 2 * params * s + 2 * s * s * 4096
    assert layer.flops(s, Phase.F) == f
    assert layer.flops(s, Phase.W) == 2 * params * s  # attention scores carry no weight gradient
    assert layer.flops(s, Phase.B) == 2 * params * s + 4 * s * s * 4096
    # total without per-layer norms; HF reports 6,738,415,616 including 65 RMSNorm vectors of 4096
    assert m.params == 32 * params + 2 * 32000 * 4096 + 4096
    assert m.params + 64 * 4096 == 6_738_415_616


def test_llama3_1_8b_gqa_by_hand():
    m = model_preset("llama3.1-8b")
    attn = 2 * 4096 * 4096 + 2 * 4096 * (8 * 128)
    mlp = 3 * 4096 * 14336
    assert m.layers[1].params == attn + mlp == 218_103_808
    assert m.params + 64 * 4096 == 8_030_261_248  # HF's count, norms included
    head = m.layers[-1]
    assert head.kind is LayerKind.HEAD
    assert head.flops(8192, Phase.F) == 2 * 128256 * 4096 * 8192
    # whole-model training FLOPs close to the 6 N rule plus attention
    n_matmul = m.params - 128256 * 4096  # the embedding lookup does no matmul
    s = m.seq_len
    attn_flops = 32 * (2 + 4) * s * s * 4096  # F + B quadratic parts, per sequence
    assert m.flops() == pytest.approx(6 * n_matmul * s + attn_flops, rel=1e-6)


def test_gemma_2b_tied_embeddings_and_mqa():
    m = model_preset("gemma-2b")
    per_layer = (2048 * 2048 + 2 * 2048 * 256 + 2048 * 2048) + 3 * 2048 * 16384
    assert m.layers[1].params == per_layer == 110_100_480
    assert m.params == 18 * per_layer + 256000 * 2048 + 2048  # tied: the vocab matrix counted once
    assert m.params + 36 * 2048 == 2_506_172_416


def test_moe_presets_total_and_active():
    q = model_preset("qwen3-30b-a3b")
    assert q.params / 1e9 == pytest.approx(30.5, abs=0.1)
    assert q.active_params / 1e9 == pytest.approx(3.35, abs=0.05)
    moe = q.layers[1]
    assert moe.kind is LayerKind.MOE_DECODER and moe.all_to_all_bytes_per_token == 2 * 8 * 2048 * 2
    ds = model_preset("deepseek-v3-like")
    assert ds.params / 1e9 == pytest.approx(671, rel=0.01)
    assert [layer.kind for layer in ds.layers[1:5]] == [LayerKind.DECODER] * 3 + [LayerKind.MOE_DECODER]
    # a MoE layer stores far more than it computes with
    assert ds.layers[10].params > 20 * ds.layers[1].params / 2


def test_hybrid_pattern_and_vlm_and_dit():
    nh = model_preset("nemotron-h-8b")
    kinds = [layer.kind for layer in nh.layers[1:-1]]
    assert kinds.count(LayerKind.MAMBA) == 24 and kinds.count(LayerKind.ATTENTION) == 4
    assert kinds.count(LayerKind.MLP) == 24
    assert nh.params / 1e9 == pytest.approx(8.1, abs=0.1)
    vl = model_preset("qwen2-vl-7b-like")
    vit = [layer for layer in vl.layers if layer.kind is LayerKind.VISION]
    assert len(vit) == 32 and vit[0].num_tokens_scale == 2.0  # 2x2 merge, half the tokens are visual
    assert vl.params / 1e9 == pytest.approx(8.29, abs=0.05)
    wan = model_preset("wan2.2-14b")
    assert wan.params / 1e9 == pytest.approx(14.0, abs=0.2)
    block = wan.layers[1]
    assert block.f_flops_per_token2 == 4 * 5120  # full (non-causal) attention
    d, ffn = 5120, 13824
    # self-attn 4 d^2 + cross-attn q/o 2 d^2 + GELU MLP 2 d ffn, plus scores/values over 512 text tokens
    assert block.f_flops_per_token == 2 * (6 * d * d + 2 * d * ffn) + 4 * d * 512
    assert block.w_flops_per_token == 2 * (6 * d * d + 2 * d * ffn)


def test_every_preset_builds_and_seq_len_override():
    for name in list_model_presets():
        m = model_preset(name)
        assert m.flops() > 0 and m.params > 0
        for layer in m.layers:
            assert layer.b_flops_per_token >= layer.w_flops_per_token >= 0
    assert model_preset("llama2-7b", seq_len=1024).seq_len == 1024


def test_unknown_preset_says_what_exists():
    with pytest.raises(ValueError, match="llama2-7b"):
        model_preset("llama-9000")
    with pytest.raises(ValueError, match="dgx-h100"):
        cluster_preset("dgx-z900")


def test_cluster_presets():
    assert set(list_cluster_presets()) >= {"a100-256", "dgx-h100", "dgx-h200", "gb200-nvl72"}
    a = cluster_preset("a100-256")
    assert a.num_gpus == 256 and a.gpus_per_node == 8
    h200 = cluster_preset("dgx-h200", num_nodes=2)
    assert h200.num_gpus == 16 and h200.device.memory_bytes == 141e9
    assert cluster_preset("gb200-nvl72").gpus_per_node == 72
    with pytest.raises(ValueError):
        a.with_nodes(0)


def test_presets_and_step_configs_refuse_what_cannot_be_simulated():
    import pytest

    from steptune.core.specs import model_preset
    from steptune.core.stepsim import FSDPStepConfig

    with pytest.raises(ValueError, match="unknown model preset 'nope'"):  # said "unknown models preset"
        model_preset("nope")
    with pytest.raises(
        ValueError, match="seq_len must be a whole number of tokens >= 1"
    ):  # 0 was "the default"
        model_preset("llama2-7b", seq_len=0)
    with pytest.raises(ValueError, match="num_gpus >= 1"):
        FSDPStepConfig(num_gpus=0)
    with pytest.raises(ValueError, match=r"efficiency: a fraction of peak in \(0, 1\]"):
        FSDPStepConfig(num_gpus=8, efficiency=50)
