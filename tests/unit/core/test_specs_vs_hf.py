"""Every preset that HF transformers can build, counted against the real architecture: the preset's own
numbers go into HF's config class, the model is built on the meta device (no weights, no download), and
its parameters are counted. Our count leaves out the per-layer norms and the q/k/v biases (docs/core.md);
with those added back it must equal HF's exactly, which is also the published total (e.g. Llama-2-13B
13,015,864,320; Qwen2.5-72B 72,706,203,648)."""

import tomllib
from pathlib import Path

import pytest
import torch

from steptune.core.specs import list_model_presets, model_preset

transformers = pytest.importorskip("transformers")

PRESETS = Path(__file__).resolve().parents[3] / "src" / "steptune" / "core" / "presets" / "models"
HF_TYPES = {
    "llama": "llama",
    "qwen2.5-": "qwen2",
    "qwen3-8b": "qwen3",
    "gemma-": "gemma",
    "qwen3-30b": "qwen3_moe",
}
BUILT = sorted(n for n in list_model_presets() if any(n.startswith(k) for k in HF_TYPES))


def _hf_counts(name: str) -> tuple[int, int, int]:
    model_type = next(v for k, v in HF_TYPES.items() if name.startswith(k))
    fields = tomllib.loads((PRESETS / f"{name}.toml").read_text())
    for ours_only in ("family", "seq_len", "n_shared_experts", "first_k_dense_replace"):
        fields.pop(ours_only, None)
    if "n_routed_experts" in fields:
        fields["num_experts"] = fields.pop("n_routed_experts")
    config = transformers.AutoConfig.for_model(model_type, **fields)
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(config)
    named = dict(model.named_parameters())
    total = sum(p.numel() for p in named.values())
    norms = sum(p.numel() for n, p in named.items() if "norm" in n)
    biases = sum(p.numel() for n, p in named.items() if n.endswith(".bias"))
    return total, norms, biases


def test_thirteen_presets_are_built_by_hf():
    assert len(BUILT) == 13, BUILT  # the other four (DeepSeek-V3-like, Nemotron-H, Qwen2-VL-like, Wan2.2)
    # are checked against their model cards in test_specs.py


@pytest.mark.parametrize("name", BUILT)
def test_preset_parameter_count_equals_hf(name):
    total, norms, biases = _hf_counts(name)
    ours = model_preset(name)
    # we count the final norm (hidden_size) and no other norm, and no bias
    assert ours.params == total - norms - biases + ours.hidden_size, (ours.params, total, norms, biases)
    assert (total - ours.params) / total < 6e-5  # the README's "at most 0.0057%" of the published total
