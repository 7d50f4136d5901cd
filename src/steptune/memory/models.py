"""Small HF decoder models built from configs with random weights (no downloads), and batches.

Presets keep the architecture of the named family (GQA, RMSNorm, SwiGLU, Qwen3's q/k norms,
Qwen3-MoE's top-k router and expert loop) at widths a 2-core CPU can step in seconds.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # torch loads on first use: the CLI lists these presets without importing it
    import torch
    from torch import nn

__all__ = ["MODEL_PRESETS", "ModelPreset", "build_model", "make_batch"]


@dataclass(frozen=True, slots=True)
class ModelPreset:
    family: str
    """HF ``model_type``."""
    config: dict[str, Any]
    batch: int
    seq: int
    note: str = ""


_TINY = dict(
    hidden_size=128,
    intermediate_size=256,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=32,
    vocab_size=512,
)
_SMALL = dict(
    hidden_size=1024,
    intermediate_size=3072,
    num_hidden_layers=2,
    num_attention_heads=16,
    num_key_value_heads=8,
    head_dim=64,
    vocab_size=2048,
)
_MOE_TINY = dict(_TINY, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=64, decoder_sparse_step=1)
_MOE_SMALL = dict(
    _SMALL, num_experts=16, num_experts_per_tok=4, moe_intermediate_size=768, decoder_sparse_step=1
)

MODEL_PRESETS: dict[str, ModelPreset] = {
    "llama-tiny": ModelPreset("llama", _TINY, batch=2, seq=64),
    "qwen3-tiny": ModelPreset("qwen3", _TINY, batch=2, seq=64),
    "qwen3-moe-tiny": ModelPreset("qwen3_moe", _MOE_TINY, batch=2, seq=64),
    "llama-small": ModelPreset(
        "llama", _SMALL, batch=1, seq=512, note="one layer's forward >= 20 ms on 2 cores"
    ),
    "qwen3-small": ModelPreset(
        "qwen3", _SMALL, batch=1, seq=512, note="one layer's forward >= 20 ms on 2 cores"
    ),
    "qwen3-moe-small": ModelPreset(
        "qwen3_moe",
        _MOE_SMALL,
        batch=1,
        seq=512,
        note="16 experts top-4; one layer's forward >= 20 ms on 2 cores",
    ),
}


def build_model(name: str, *, seed: int = 0, dtype: torch.dtype | None = None, **overrides: Any) -> nn.Module:
    """An HF causal LM from a preset (random weights, SDPA attention, no KV cache, no dropout;
    float32 unless ``dtype``)."""
    import torch

    try:
        preset = MODEL_PRESETS[name]
    except KeyError:
        raise ValueError(f"unknown model preset {name!r}; choose one of {sorted(MODEL_PRESETS)}") from None
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.for_model(preset.family, **{**preset.config, **overrides})
    config._attn_implementation = "sdpa"
    config.use_cache = False
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config).to(dtype or torch.float32)
    model.train()
    return model


def make_batch(
    name: str, *, seed: int = 1, batch: int | None = None, seq: int | None = None
) -> dict[str, torch.Tensor]:
    import torch

    preset = MODEL_PRESETS[name]
    vocab = int(preset.config["vocab_size"])
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab, (batch or preset.batch, seq or preset.seq), generator=g)
    return {"input_ids": ids, "labels": ids.clone()}
