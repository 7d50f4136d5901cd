"""Build ``ModelSpec`` layer lists from HF-style config numbers.

Counting rules (see docs/core.md for the derivations): matmul FLOPs are 2 per multiply-add;
biases, norms, rotary embeddings, softmax and elementwise work are left out (well under 1% of a
layer); attention is causal unless the family says otherwise (vision encoders and DiT blocks
attend fully).
"""

from __future__ import annotations

from typing import Any

from steptune.core.specs import LayerKind, LayerSpec, ModelSpec

_FAMILIES = ("dense", "moe", "hybrid", "vlm", "dit")


_FRACTIONS = frozenset({"image_token_fraction"})
"""Config numbers that are fractions in [0, 1]; every other number a builder reads is a count or a size."""


def _req(cfg: dict[str, Any], key: str) -> Any:
    if key not in cfg:
        raise ValueError(f"model config is missing {key!r} (needed by family {cfg.get('family')!r})")
    return _checked(key, cfg[key])


def _opt(cfg: dict[str, Any], key: str, default: int) -> int:
    """An optional count (``n_shared_experts``, ``first_k_dense_replace``): a whole number >= 0."""
    v = cfg.get(key, default)
    if isinstance(v, bool) or not isinstance(v, int) or v < 0:
        raise ValueError(f"model config {key}={v!r}: a whole number >= 0")
    return v


def _checked(key: str, v: Any) -> Any:
    if isinstance(v, dict | str | list):
        return v
    if key in _FRACTIONS:
        if isinstance(v, bool) or not isinstance(v, int | float) or not 0 <= v <= 1:
            raise ValueError(f"model config {key}={v!r}: a fraction in [0, 1]")
        return v
    if isinstance(v, bool) or not isinstance(v, int) or v < 1:
        raise ValueError(f"model config {key}={v!r}: a whole number >= 1 (a count or a size)")
    return v


def _head_dim(cfg: dict[str, Any], h: int, nh: int) -> tuple[int, int]:
    """(key-value heads, head dim), checked: grouped-query attention needs the heads to split evenly."""
    nkv = _checked("num_key_value_heads", cfg.get("num_key_value_heads", nh))
    if nh % nkv:
        raise ValueError(
            f"model config: num_attention_heads {nh} is not a multiple of num_key_value_heads {nkv}"
        )
    if "head_dim" in cfg:
        return nkv, _checked("head_dim", cfg["head_dim"])
    if h % nh:
        raise ValueError(
            f"model config: hidden_size {h} is not a multiple of num_attention_heads {nh}; give head_dim"
        )
    return nkv, h // nh


def _attention_parts(
    h: int, num_heads: int, num_kv_heads: int, head_dim: int, *, causal: bool, b: int
) -> tuple[int, float, float, float]:
    """(params, linear F FLOPs/token, quadratic F FLOPs/token^2, saved bytes/token)."""
    q = num_heads * head_dim
    kv = num_kv_heads * head_dim
    params = h * q + 2 * h * kv + q * h
    quad = 4.0 * q * (0.5 if causal else 1.0)  # QK^T and PV, 2 FLOPs per MAC each
    act = b * (2 * h + 2 * q + 2 * kv) + 4 * num_heads  # norm in, proj in, q, k, v, out, lse (fp32)
    return params, 2.0 * params, quad, act


def _mla_parts(cfg: dict[str, Any], h: int, *, b: int) -> tuple[int, float, float, float]:
    """DeepSeek-V3 multi-head latent attention (training form: latents up-projected)."""
    nh = _req(cfg, "num_attention_heads")
    q_lora, kv_lora = _req(cfg, "q_lora_rank"), _req(cfg, "kv_lora_rank")
    nope, rope, v_dim = _req(cfg, "qk_nope_head_dim"), _req(cfg, "qk_rope_head_dim"), _req(cfg, "v_head_dim")
    qk_dim = nope + rope
    params = (
        h * q_lora
        + q_lora * nh * qk_dim
        + h * (kv_lora + rope)
        + kv_lora * nh * (nope + v_dim)
        + nh * v_dim * h
    )
    quad = 2.0 * nh * (qk_dim + v_dim) * 0.5
    act = b * (2 * h + q_lora + kv_lora + rope + nh * qk_dim * 2 + nh * v_dim * 2) + 4 * nh
    return params, 2.0 * params, quad, act


def _mlp_parts(h: int, inter: int, *, gated: bool, b: int) -> tuple[int, float, float]:
    params = (3 if gated else 2) * h * inter
    act = b * (2 * h + (3 if gated else 2) * inter)
    return params, 2.0 * params, act


def _weighted(
    name: str,
    kind: LayerKind,
    *,
    params: int,
    active: int,
    lin_w: float,
    lin_free: float = 0.0,
    quad: float = 0.0,
    act: float,
    out: float,
    a2a: float = 0.0,
    scale: float = 1.0,
) -> LayerSpec:
    """A layer whose ``lin_w`` FLOPs are weight matmuls and ``lin_free``/``quad`` are parameter-free."""
    return LayerSpec(
        name=name,
        kind=kind,
        f_flops_per_token=lin_w + lin_free,
        f_flops_per_token2=quad,
        b_flops_per_token=lin_w + 2.0 * lin_free,
        b_flops_per_token2=2.0 * quad,
        w_flops_per_token=lin_w,
        w_flops_per_token2=0.0,
        params=int(params),
        active_params=int(active),
        activation_bytes_per_token=float(act),
        output_bytes_per_token=float(out),
        all_to_all_bytes_per_token=float(a2a),
        num_tokens_scale=scale,
    )


def _embedding(h: int, vocab: int, b: int) -> LayerSpec:
    p = vocab * h
    return _weighted("embed", LayerKind.EMBEDDING, params=p, active=p, lin_w=0.0, act=0.0, out=b * h)


def _head(h: int, vocab: int, b: int) -> LayerSpec:
    p = vocab * h
    # Saved: the normed hidden state and fp32 logits for the cross-entropy backward.
    return _weighted(
        "head", LayerKind.HEAD, params=p + h, active=p + h, lin_w=2.0 * p, act=b * h + 4 * vocab, out=0.0
    )


def _dense(cfg: dict[str, Any], b: int) -> list[LayerSpec]:
    h, vocab = _req(cfg, "hidden_size"), _req(cfg, "vocab_size")
    nh = _req(cfg, "num_attention_heads")
    nkv, hd = _head_dim(cfg, h, nh)
    gated = cfg.get("mlp_gated", True)
    ap, alin, aquad, aact = _attention_parts(h, nh, nkv, hd, causal=True, b=b)
    mp, mlin, mact = _mlp_parts(h, _req(cfg, "intermediate_size"), gated=gated, b=b)
    layers = [_embedding(h, vocab, b)]
    for i in range(_req(cfg, "num_hidden_layers")):
        layers.append(
            _weighted(
                f"layer{i}",
                LayerKind.DECODER,
                params=ap + mp,
                active=ap + mp,
                lin_w=alin + mlin,
                quad=aquad,
                act=aact + mact,
                out=b * h,
            )
        )
    layers.append(_head(h, vocab, b))
    return layers


def _moe(cfg: dict[str, Any], b: int) -> list[LayerSpec]:
    h, vocab = _req(cfg, "hidden_size"), _req(cfg, "vocab_size")
    if "q_lora_rank" in cfg:
        ap, alin, aquad, aact = _mla_parts(cfg, h, b=b)
    else:
        nh = _req(cfg, "num_attention_heads")
        ap, alin, aquad, aact = _attention_parts(h, nh, *_head_dim(cfg, h, nh), causal=True, b=b)
    num_dense = _opt(cfg, "first_k_dense_replace", 0)
    num_experts, top_k = _req(cfg, "n_routed_experts"), _req(cfg, "num_experts_per_tok")
    if top_k > num_experts:
        raise ValueError(f"model config: num_experts_per_tok {top_k} > n_routed_experts {num_experts}")
    if num_dense and "intermediate_size" not in cfg:
        raise ValueError(
            f"model config: first_k_dense_replace={num_dense} makes dense layers, which need "
            "intermediate_size"
        )
    num_shared = _opt(cfg, "n_shared_experts", 0)
    mi = _req(cfg, "moe_intermediate_size")
    expert = 3 * h * mi
    router = h * num_experts
    moe_params = (num_experts + num_shared) * expert + router
    moe_active = (top_k + num_shared) * expert + router
    moe_act = b * (2 * h + (top_k + num_shared) * (h + 3 * mi)) + 4 * num_experts
    a2a = 2 * top_k * h * b  # dispatch and combine, one copy of h per routed expert each way
    dp, dlin, dact = _mlp_parts(h, _req(cfg, "intermediate_size") if num_dense else 0, gated=True, b=b)
    layers = [_embedding(h, vocab, b)]
    for i in range(_req(cfg, "num_hidden_layers")):
        if i < num_dense:
            layers.append(
                _weighted(
                    f"layer{i}",
                    LayerKind.DECODER,
                    params=ap + dp,
                    active=ap + dp,
                    lin_w=alin + dlin,
                    quad=aquad,
                    act=aact + dact,
                    out=b * h,
                )
            )
        else:
            layers.append(
                _weighted(
                    f"layer{i}",
                    LayerKind.MOE_DECODER,
                    params=ap + moe_params,
                    active=ap + moe_active,
                    lin_w=alin + 2.0 * moe_active,
                    quad=aquad,
                    act=aact + moe_act,
                    out=b * h,
                    a2a=a2a,
                )
            )
    layers.append(_head(h, vocab, b))
    return layers


def _mamba(cfg: dict[str, Any], h: int, name: str, b: int) -> LayerSpec:
    nheads, hdim = _req(cfg, "mamba_num_heads"), _req(cfg, "mamba_head_dim")
    ngroups, state = _req(cfg, "n_groups"), _req(cfg, "ssm_state_size")
    chunk = cfg.get("chunk_size", 256)
    d_inner = nheads * hdim
    conv_dim = d_inner + 2 * ngroups * state
    proj = 2 * d_inner + 2 * ngroups * state + nheads  # z, x, B, C, dt
    params = h * proj + d_inner * h + conv_dim * cfg.get("conv_kernel", 4)
    # SSD (chunked scan), per token: intra-chunk C.B^T and its product with x, plus the
    # inter-chunk state update and readout. Parameter-free, so B = 2F and W = 0 for this part.
    scan = 2.0 * chunk * ngroups * state + 2.0 * chunk * d_inner + 4.0 * d_inner * state
    act = b * (2 * h + proj + conv_dim + 2 * d_inner)
    return _weighted(
        name,
        LayerKind.MAMBA,
        params=params,
        active=params,
        lin_w=2.0 * (h * proj + d_inner * h),
        lin_free=scan,
        act=act,
        out=b * h,
    )


def _hybrid(cfg: dict[str, Any], b: int) -> list[LayerSpec]:
    h, vocab = _req(cfg, "hidden_size"), _req(cfg, "vocab_size")
    pattern = _req(cfg, "hybrid_override_pattern")
    nh = _req(cfg, "num_attention_heads")
    ap, alin, aquad, aact = _attention_parts(h, nh, *_head_dim(cfg, h, nh), causal=True, b=b)
    mp, mlin, mact = _mlp_parts(h, _req(cfg, "intermediate_size"), gated=cfg.get("mlp_gated", False), b=b)
    if len(pattern) != _req(cfg, "num_hidden_layers"):
        raise ValueError(
            f"hybrid_override_pattern has {len(pattern)} entries, num_hidden_layers is "
            f"{cfg['num_hidden_layers']}: make them agree"
        )
    layers = [_embedding(h, vocab, b)]
    for i, c in enumerate(pattern):
        if c == "M":
            layers.append(_mamba(cfg, h, f"layer{i}", b))
        elif c == "*":
            layers.append(
                _weighted(
                    f"layer{i}",
                    LayerKind.ATTENTION,
                    params=ap,
                    active=ap,
                    lin_w=alin,
                    quad=aquad,
                    act=aact,
                    out=b * h,
                )
            )
        elif c == "-":
            layers.append(
                _weighted(f"layer{i}", LayerKind.MLP, params=mp, active=mp, lin_w=mlin, act=mact, out=b * h)
            )
        else:
            raise ValueError(f"hybrid_override_pattern: unknown layer code {c!r} at {i}; use M, * or -")
    layers.append(_head(h, vocab, b))
    return layers


def _vlm(cfg: dict[str, Any], b: int) -> list[LayerSpec]:
    vis = _req(cfg, "vision")
    text = _req(cfg, "text")
    hv, h = _req(vis, "embed_dim"), _req(text, "hidden_size")
    merge = vis.get("spatial_merge_size", 2)
    frac = _req(cfg, "image_token_fraction")
    scale = merge * merge * frac  # ViT patch tokens per LLM token
    nh = _req(vis, "num_heads")
    ap, alin, aquad, aact = _attention_parts(hv, nh, nh, hv // nh, causal=False, b=b)
    mp, mlin, mact = _mlp_parts(hv, int(hv * vis.get("mlp_ratio", 4)), gated=False, b=b)
    patch_in = vis.get("in_channels", 3) * vis.get("temporal_patch_size", 2) * vis["patch_size"] ** 2
    layers = [
        _weighted(
            "patch_embed",
            LayerKind.EMBEDDING,
            params=patch_in * hv,
            active=patch_in * hv,
            lin_w=2.0 * patch_in * hv,
            act=b * patch_in,
            out=b * hv,
            scale=scale,
        )
    ]
    for i in range(_req(vis, "depth")):
        layers.append(
            _weighted(
                f"vit{i}",
                LayerKind.VISION,
                params=ap + mp,
                active=ap + mp,
                lin_w=alin + mlin,
                quad=aquad,
                act=aact + mact,
                out=b * hv,
                scale=scale,
            )
        )
    hm = hv * merge * merge
    pp = hm * hm + hm * h
    layers.append(
        _weighted(
            "merger",
            LayerKind.PROJECTOR,
            params=pp,
            active=pp,
            lin_w=2.0 * pp,
            act=b * (2 * hm),
            out=b * h,
            scale=frac,
        )
    )
    text_layers = _dense(text, b)
    # The LLM's own token embedding still runs (text tokens); keep it, then the decoder and head.
    return layers + text_layers


def _dit(cfg: dict[str, Any], b: int) -> list[LayerSpec]:
    d, ffn, nh = _req(cfg, "dim"), _req(cfg, "ffn_dim"), _req(cfg, "num_heads")
    text_len = cfg.get("text_len", 512)
    sp, slin, squad, sact = _attention_parts(d, nh, nh, d // nh, causal=False, b=b)
    # Cross-attention: q/o per video token, k/v over the text context. The k/v projections of the
    # text tokens (text_len per sample, not per video token) are left out: < 0.1% at 32k tokens.
    cross_params = 4 * d * d
    cross_lin = 2.0 * 2 * d * d
    cross_free = 4.0 * d * text_len  # scores and values over the text context, per video token
    mp, mlin, mact = _mlp_parts(d, ffn, gated=False, b=b)
    params = sp + cross_params + mp + 6 * d  # + adaLN modulation vectors
    act = sact + b * (3 * d) + mact
    patch = cfg.get("in_dim", 16) * 4
    layers = [
        _weighted(
            "patch_embed",
            LayerKind.EMBEDDING,
            params=patch * d,
            active=patch * d,
            lin_w=2.0 * patch * d,
            act=b * patch,
            out=b * d,
        )
    ]
    for i in range(_req(cfg, "num_layers")):
        layers.append(
            _weighted(
                f"block{i}",
                LayerKind.DIT,
                params=params,
                active=params,
                lin_w=slin + cross_lin + mlin,
                lin_free=cross_free,
                quad=squad,
                act=act,
                out=b * d,
            )
        )
    out = cfg.get("out_dim", 16) * 4
    layers.append(
        _weighted(
            "head", LayerKind.HEAD, params=d * out, active=d * out, lin_w=2.0 * d * out, act=b * d, out=0.0
        )
    )
    return layers


def build_model(name: str, data: dict[str, Any]) -> ModelSpec:
    family = data.get("family")
    if family not in _FAMILIES:
        raise ValueError(f"model preset {name!r}: family must be one of {_FAMILIES}, got {family!r}")
    b = int(data.get("dtype_bytes", 2))
    builders = {"dense": _dense, "moe": _moe, "hybrid": _hybrid, "vlm": _vlm, "dit": _dit}
    layers = builders[family](data, b)
    if family == "vlm":
        hidden, vocab = data["text"]["hidden_size"], data["text"]["vocab_size"]
        tied = data["text"].get("tie_word_embeddings", False)
    elif family == "dit":
        hidden, vocab, tied = data["dim"], 0, False
    else:
        hidden, vocab, tied = data["hidden_size"], data["vocab_size"], data.get("tie_word_embeddings", False)
    config = dict(data)
    config["tie_word_embeddings"] = tied
    return ModelSpec(
        name=name,
        layers=tuple(layers),
        hidden_size=hidden,
        vocab_size=vocab,
        seq_len=int(_req(data, "seq_len")),
        dtype_bytes=b,
        config=config,
    )
