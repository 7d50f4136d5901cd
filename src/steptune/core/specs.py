"""Model and cluster descriptions shared by every area.

Contract:
- Every spec is a frozen dataclass; presets are data (TOML under ``core/presets/``) so a new
  model or cluster needs no code.
- FLOPs count a multiply-add as 2. Per layer and per token, a layer's cost for one sequence of
  ``s`` tokens is ``s * per_token + s**2 * per_token2``; the ``per_token2`` term is the attention
  score/value product, already halved for causal masking (what flash attention executes).
- Backward is split as in zero-bubble pipelines: ``B`` (input gradient) and ``W`` (weight
  gradient). For a weight-bearing matmul ``B == W == F``; for parameter-free work (attention
  scores, SSM scans) ``B == 2 F`` and ``W == 0``.
- Byte counts are per token at the model's ``dtype_bytes`` (bf16 = 2) unless named otherwise.
  Activation bytes are what autograd saves for backward with flash attention and no dropout;
  they are estimates (see docs/core.md), not measurements.
"""

from __future__ import annotations

import math
import numbers
import tomllib
from dataclasses import dataclass, field, replace
from enum import StrEnum
from importlib import resources
from typing import Any

__all__ = [
    "ClusterSpec",
    "DeviceSpec",
    "LayerKind",
    "LayerSpec",
    "LinkSpec",
    "ModelSpec",
    "Phase",
    "cluster_preset",
    "list_cluster_presets",
    "list_model_presets",
    "model_preset",
]


class LayerKind(StrEnum):
    EMBEDDING = "embedding"
    DECODER = "decoder"  # attention + dense MLP
    MOE_DECODER = "moe_decoder"  # attention + mixture-of-experts MLP
    ATTENTION = "attention"  # attention alone (hybrid models)
    MLP = "mlp"  # MLP alone (hybrid models)
    MAMBA = "mamba"  # Mamba-2 mixer
    VISION = "vision"  # ViT encoder block
    PROJECTOR = "projector"  # vision-to-language merger
    DIT = "dit"  # diffusion-transformer block (self-attn + cross-attn + MLP)
    HEAD = "head"  # final norm + LM head + loss


class Phase(StrEnum):
    F = "F"  # forward
    B = "B"  # backward, input gradient
    W = "W"  # backward, weight gradient


@dataclass(frozen=True, kw_only=True, slots=True)
class LayerSpec:
    """One pipeline-placeable layer: its compute, memory and communication per token."""

    name: str
    kind: LayerKind
    f_flops_per_token: float
    """Forward FLOPs linear in sequence length (matmuls, scans)."""
    f_flops_per_token2: float = 0.0
    """Forward FLOPs per token squared (causal attention scores and values)."""
    b_flops_per_token: float
    b_flops_per_token2: float = 0.0
    w_flops_per_token: float
    w_flops_per_token2: float = 0.0
    params: int
    """Parameters stored on the device that holds this layer (all experts for MoE)."""
    active_params: int
    """Parameters one token touches (== params for dense layers)."""
    activation_bytes_per_token: float
    """Bytes saved for backward per token without checkpointing."""
    output_bytes_per_token: float
    """Bytes this layer hands to the next one per token (the pipeline P2P payload)."""
    all_to_all_bytes_per_token: float = 0.0
    """MoE dispatch + combine bytes per token (zero for dense layers)."""
    num_tokens_scale: float = 1.0
    """Tokens this layer sees per model token (e.g. 4.0 for ViT patches before a 2x2 merge)."""

    def flops(self, seq_len: int, phase: Phase | str = Phase.F) -> float:
        """FLOPs of one sequence of ``seq_len`` model tokens through this layer in ``phase``."""
        s = seq_len * self.num_tokens_scale  # unchecked: the simulators' hot path (ModelSpec.flops checks)
        phase = Phase(phase)
        if phase is Phase.F:
            lin, quad = self.f_flops_per_token, self.f_flops_per_token2
        elif phase is Phase.B:
            lin, quad = self.b_flops_per_token, self.b_flops_per_token2
        else:
            lin, quad = self.w_flops_per_token, self.w_flops_per_token2
        return s * lin + s * s * quad

    def train_flops(self, seq_len: int) -> float:
        return sum(self.flops(seq_len, p) for p in Phase)


@dataclass(frozen=True, kw_only=True, slots=True)
class ModelSpec:
    """A model as a sequence of layers, with the config numbers it was built from."""

    name: str
    layers: tuple[LayerSpec, ...]
    hidden_size: int
    vocab_size: int
    seq_len: int
    """Default training sequence length (tokens per sample)."""
    dtype_bytes: int = 2
    config: dict[str, Any] = field(default_factory=dict, compare=False, hash=False)
    """The HF-style numbers this spec was built from, for reference."""

    @property
    def num_layers(self) -> int:
        return len(self.layers)

    @property
    def _tied_params(self) -> int:
        # Embedding and head share one matrix: count it once.
        return self.vocab_size * self.hidden_size if self.config.get("tie_word_embeddings") else 0

    @property
    def params(self) -> int:
        return sum(layer.params for layer in self.layers) - self._tied_params

    @property
    def active_params(self) -> int:
        return sum(layer.active_params for layer in self.layers) - self._tied_params

    def flops(self, seq_len: int | None = None, phase: Phase | str | None = None) -> float:
        """FLOPs of one sequence through the whole model; all three phases when ``phase`` is None."""
        if seq_len is not None and not seq_len > 0:  # 0 used to mean the default, -1 gave negative FLOPs
            raise ValueError(
                f"seq_len must be a positive number of tokens (None: the model's), got {seq_len!r}"
            )
        s = self.seq_len if seq_len is None else seq_len
        if phase is None:
            return sum(layer.train_flops(s) for layer in self.layers)
        return sum(layer.flops(s, phase) for layer in self.layers)

    def with_seq_len(self, seq_len: int) -> ModelSpec:
        return replace(self, seq_len=_tokens(seq_len))


@dataclass(frozen=True, kw_only=True, slots=True)
class DeviceSpec:
    name: str
    peak_flops: float
    """Dense bf16 tensor-core FLOP/s."""
    memory_bytes: float
    memory_bandwidth: float
    """HBM bytes/s."""
    num_sms: int = 0


@dataclass(frozen=True, kw_only=True, slots=True)
class LinkSpec:
    """One level of the network as each GPU sees it (alpha-beta model)."""

    name: str
    bandwidth: float
    """Bytes/s per GPU per direction."""
    latency: float
    """Seconds per message or algorithm step (alpha)."""

    def __post_init__(self) -> None:
        # a NaN bandwidth or a negative latency dropped every cross-device dependency from the pipeline
        # simulator (a sweep: 1F1B's makespan 9 became 6); 0 divided by zero
        bw, lat = self.bandwidth, self.latency
        if isinstance(bw, bool) or not isinstance(bw, int | float) or not (math.isfinite(bw) and bw > 0):
            raise ValueError(
                f"LinkSpec {self.name!r}: bandwidth must be a finite number of bytes/s > 0, got {bw!r}"
            )
        if isinstance(lat, bool) or not isinstance(lat, int | float) or not (math.isfinite(lat) and lat >= 0):
            raise ValueError(
                f"LinkSpec {self.name!r}: latency must be a finite number of seconds >= 0, got {lat!r}"
            )


@dataclass(frozen=True, kw_only=True, slots=True)
class ClusterSpec:
    name: str
    device: DeviceSpec
    num_nodes: int
    gpus_per_node: int
    """GPUs in one fast (NVLink/NVSwitch) domain."""
    intra: LinkSpec
    inter: LinkSpec
    """Per-GPU share of the scale-out network."""

    @property
    def num_gpus(self) -> int:
        return self.num_nodes * self.gpus_per_node

    def with_nodes(self, num_nodes: int) -> ClusterSpec:
        if isinstance(num_nodes, bool) or not isinstance(num_nodes, int) or num_nodes < 1:
            raise ValueError(f"num_nodes must be a whole number >= 1, got {num_nodes!r}")
        return replace(self, num_nodes=num_nodes)


def _tokens(seq_len: Any) -> int:
    """A model's sequence length: a whole number of tokens >= 1."""
    if isinstance(seq_len, bool) or not isinstance(seq_len, numbers.Integral) or seq_len < 1:
        raise ValueError(f"seq_len must be a whole number of tokens >= 1, got {seq_len!r}")
    return int(seq_len)


# --- presets -------------------------------------------------------------------------------------


def _preset_dir(kind: str) -> Any:
    return resources.files("steptune.core").joinpath("presets", kind)


def list_model_presets() -> list[str]:
    return sorted(
        p.name.removesuffix(".toml") for p in _preset_dir("models").iterdir() if p.name.endswith(".toml")
    )


def list_cluster_presets() -> list[str]:
    return sorted(
        p.name.removesuffix(".toml") for p in _preset_dir("clusters").iterdir() if p.name.endswith(".toml")
    )


def _load(kind: str, name: str, known: list[str]) -> dict[str, Any]:
    if name not in known:
        what = kind.removesuffix("s")  # "models" -> "model"
        raise ValueError(f"unknown {what} preset {name!r}; choose one of: {', '.join(known)}")
    text = _preset_dir(kind).joinpath(f"{name}.toml").read_text()
    data: dict[str, Any] = tomllib.loads(text)
    return data


def model_preset(
    name: str, *, seq_len: int | None = None, overrides: dict[str, Any] | None = None
) -> ModelSpec:
    """A ``ModelSpec`` from a preset under ``core/presets/models`` (e.g. ``"llama3.1-8b"``).

    ``overrides`` replaces config numbers before building (e.g. ``{"num_hidden_layers": 16}``);
    the spec's name records them.
    """
    from steptune.core._builders import build_model

    if seq_len is not None:
        _tokens(seq_len)
    data = _load("models", name, list_model_presets())
    if overrides:
        unknown = sorted(set(overrides) - set(data))
        if unknown:
            raise ValueError(f"overrides {unknown} are not keys of preset {name!r}; known: {sorted(data)}")
        data = {**data, **overrides}
        name = name + "(" + ",".join(f"{k}={v}" for k, v in sorted(overrides.items())) + ")"
    spec = build_model(name, data)
    return spec.with_seq_len(seq_len) if seq_len is not None else spec


def cluster_preset(name: str, *, num_nodes: int | None = None) -> ClusterSpec:
    """A ``ClusterSpec`` from a preset under ``core/presets/clusters`` (e.g. ``"dgx-h100"``)."""
    data = _load("clusters", name, list_cluster_presets())
    dev = DeviceSpec(**data["device"])
    spec = ClusterSpec(
        name=name,
        device=dev,
        num_nodes=int(data["num_nodes"]),
        gpus_per_node=int(data["gpus_per_node"]),
        intra=LinkSpec(**data["intra"]),
        inter=LinkSpec(**data["inter"]),
    )
    return spec.with_nodes(num_nodes) if num_nodes is not None else spec
