"""Per-stage costs for the simulator, and the partitions partition-only systems would pick.

``StageCosts`` holds seconds and bytes *per microbatch* for each stage. It is built from a core
``ModelSpec`` (analytic FLOPs at a fixed efficiency: a simulated input, labelled so) or from
measured per-layer times. A partition is the number of consecutive model layers per stage.
"""

from __future__ import annotations

import itertools
import math
import numbers
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from steptune.core.cost import compute_time
from steptune.core.specs import DeviceSpec, LayerSpec, LinkSpec, ModelSpec, Phase

__all__ = [
    "LayerCosts",
    "StageCosts",
    "balanced_partition",
    "layer_costs",
    "split_layer",
    "stage_costs",
    "uniform_partition",
]


def _check_fields(costs: Any, what: str, fields: tuple[str, ...]) -> None:
    """Every field one finite value >= 0 per layer or stage, all of one length >= 1 (a NaN cost vanished
    from the makespan, a negative one shortened it: found in a sweep on 2026-12-05)."""
    cls = type(costs).__name__
    lengths = {name: len(getattr(costs, name)) for name in fields}
    if len(set(lengths.values())) != 1 or lengths["f"] == 0:
        raise ValueError(f"{cls}: each field needs one value per {what} (at least one): lengths {lengths}")
    for name in fields:
        for k, v in enumerate(getattr(costs, name)):
            if isinstance(v, bool) or not isinstance(v, numbers.Real) or not (math.isfinite(v) and v >= 0):
                raise ValueError(f"{cls}.{name}[{k}] ({what} {k}) must be a finite number >= 0, got {v!r}")
        if not isinstance(
            getattr(costs, name), tuple
        ):  # lists passed here, then failed in tune's split_layer
            object.__setattr__(costs, name, tuple(getattr(costs, name)))


@dataclass(frozen=True, kw_only=True, slots=True)
class LayerCosts:
    """Per-layer, per-microbatch costs (seconds, bytes)."""

    f: tuple[float, ...]
    i: tuple[float, ...]
    w: tuple[float, ...]
    act_bytes: tuple[float, ...]
    """Activation bytes held from F until W (or fused B)."""
    out_bytes: tuple[float, ...]
    """Bytes sent to the next stage after this layer (and its gradient back)."""
    static_bytes: tuple[float, ...]
    """Parameters, gradients and optimizer state held for the whole step."""
    names: tuple[str, ...] = ()
    head_carry_bytes: float | None = None
    """Bytes between two shards of a vocabulary-split head (``split_layer``): ``vocab_head``'s boundary,
    H + 4 fp32 channels per token (``layer_costs`` sets it); None: the previous layer's output."""

    def __post_init__(self) -> None:
        _check_fields(self, "layer", ("f", "i", "w", "act_bytes", "out_bytes", "static_bytes"))
        if self.head_carry_bytes is not None and not (
            math.isfinite(self.head_carry_bytes) and self.head_carry_bytes >= 0
        ):
            raise ValueError(f"head_carry_bytes must be a finite number >= 0, got {self.head_carry_bytes}")

    @property
    def num_layers(self) -> int:
        return len(self.f)

    def total(self, lo: int = 0, hi: int | None = None) -> float:
        hi = self.num_layers if hi is None else hi
        return sum(self.f[lo:hi]) + sum(self.i[lo:hi]) + sum(self.w[lo:hi])


@dataclass(frozen=True, kw_only=True, slots=True)
class StageCosts:
    f: tuple[float, ...]
    i: tuple[float, ...]
    w: tuple[float, ...]
    act_bytes: tuple[float, ...]
    out_bytes: tuple[float, ...]
    static_bytes: tuple[float, ...]
    link: LinkSpec | None = None
    """P2P link between devices; None means free communication."""
    overhead: float = 0.0
    """Fixed seconds added to every compute action (dispatch, launch)."""

    def __post_init__(self) -> None:
        _check_fields(self, "stage", ("f", "i", "w", "act_bytes", "out_bytes", "static_bytes"))
        if not (math.isfinite(self.overhead) and self.overhead >= 0):
            raise ValueError(f"StageCosts.overhead must be a finite number >= 0, got {self.overhead!r}")

    @property
    def num_stages(self) -> int:
        return len(self.f)

    @staticmethod
    def uniform(
        num_stages: int, *, f: float = 1.0, i: float = 1.0, w: float = 1.0, act_bytes: float = 1.0
    ) -> StageCosts:
        """Equal stages and free communication: closed forms, dry runs and unit-cost simulation."""
        n = num_stages
        return StageCosts(
            f=(f,) * n,
            i=(i,) * n,
            w=(w,) * n,
            act_bytes=(act_bytes,) * n,
            out_bytes=(0.0,) * n,
            static_bytes=(0.0,) * n,
        )

    def comm_time(self, stage: int) -> float:
        """Seconds to send stage ``stage``'s output (or its gradient) to a neighbour on another device."""
        if self.link is None:
            return 0.0
        return self.link.latency + self.out_bytes[stage] / self.link.bandwidth


def layer_costs(
    model: ModelSpec,
    device: DeviceSpec,
    *,
    microbatch_size: int = 1,
    efficiency: float = 0.5,
    seq_len: int | None = None,
    static_bytes_per_param: float = 16.0,
    expert_parallel: int = 1,
    a2a_link: LinkSpec | None = None,
) -> LayerCosts:
    """Analytic per-layer costs of ``model`` on ``device`` (SIMULATED input: FLOPs at ``efficiency``).

    ``static_bytes_per_param``: 16 = bf16 weights + fp32 master + fp32 grads + two fp32 Adam
    moments; with ZeRO-1 over a data-parallel group of ``dp`` use ``2 + 4 + 12 / dp``.
    MoE layers: experts not touched by a token are sharded over ``expert_parallel`` ranks
    (stored = active + (total - active) / EP), and with ``a2a_link`` the dispatch + combine
    all-to-all is charged to F and again to I (its backward), not overlapped with compute.
    """
    if expert_parallel < 1:
        raise ValueError(f"expert_parallel must be >= 1, got {expert_parallel}")
    if microbatch_size < 1:
        raise ValueError(f"microbatch_size must be >= 1 sequence, got {microbatch_size}")
    if seq_len is not None and seq_len < 1:
        raise ValueError(f"seq_len must be >= 1 token (or None for the model's), got {seq_len}")
    if not 0 < efficiency <= 1:
        raise ValueError(f"efficiency must be in (0, 1], got {efficiency}")
    s = seq_len or model.seq_len
    tokens = s * microbatch_size

    def t(flops: float) -> float:
        return compute_time(flops * microbatch_size, device, efficiency=efficiency)

    def a2a(x: LayerSpec) -> float:
        if a2a_link is None or x.all_to_all_bytes_per_token == 0:
            return 0.0
        return 2 * a2a_link.latency + x.all_to_all_bytes_per_token * tokens / a2a_link.bandwidth

    def stored(x: LayerSpec) -> float:
        return x.active_params + (x.params - x.active_params) / expert_parallel

    layers = model.layers
    return LayerCosts(
        f=tuple(t(x.flops(s, Phase.F)) + a2a(x) for x in layers),
        i=tuple(t(x.flops(s, Phase.B)) + a2a(x) for x in layers),
        w=tuple(t(x.flops(s, Phase.W)) for x in layers),
        act_bytes=tuple(x.activation_bytes_per_token * tokens * x.num_tokens_scale for x in layers),
        out_bytes=tuple(x.output_bytes_per_token * tokens * x.num_tokens_scale for x in layers),
        static_bytes=tuple(stored(x) * static_bytes_per_param for x in layers),
        names=tuple(x.name for x in layers),
        head_carry_bytes=4.0 * (model.hidden_size + 4) * tokens,  # vocab_head: fp32 hidden, m, s, t, target
    )


def stage_costs(
    layers: LayerCosts, partition: Sequence[int], *, link: LinkSpec | None = None, overhead: float = 0.0
) -> StageCosts:
    if sum(partition) != layers.num_layers or any(n < 1 for n in partition):
        raise ValueError(
            f"partition {tuple(partition)} must cover all {layers.num_layers} layers with >= 1 each"
        )
    bounds = [0]
    for n in partition:
        bounds.append(bounds[-1] + n)
    spans = list(itertools.pairwise(bounds))
    return StageCosts(
        f=tuple(sum(layers.f[a:b]) for a, b in spans),
        i=tuple(sum(layers.i[a:b]) for a, b in spans),
        w=tuple(sum(layers.w[a:b]) for a, b in spans),
        act_bytes=tuple(sum(layers.act_bytes[a:b]) for a, b in spans),
        out_bytes=tuple(layers.out_bytes[b - 1] for a, b in spans),
        static_bytes=tuple(sum(layers.static_bytes[a:b]) for a, b in spans),
        link=link,
        overhead=overhead,
    )


def uniform_partition(num_layers: int, num_stages: int) -> tuple[int, ...]:
    """As many layers per stage as possible, the remainder to the first stages (torch/Megatron style)."""
    if not 1 <= num_stages <= num_layers:
        raise ValueError(f"cannot split {num_layers} layers into {num_stages} stages")
    q, r = divmod(num_layers, num_stages)
    return tuple(q + (1 if k < r else 0) for k in range(num_stages))


def balanced_partition(
    weights: Sequence[float], num_stages: int, device_of_stage: Sequence[int] | None = None
) -> tuple[int, ...]:
    """Contiguous partition minimizing the heaviest stage (or device, when stages share devices).

    With one stage per device this is the exact min-max partition (binary search on the cap
    with a greedy feasibility check, then exact DP on the final cap); with several stages per
    device the DP minimizes the heaviest *device*, so it is a heuristic over stage order.
    """
    n = len(weights)
    if not 1 <= num_stages <= n:
        raise ValueError(f"cannot split {n} layers into {num_stages} stages")
    prefix = [0.0]
    for x in weights:
        prefix.append(prefix[-1] + x)
    if device_of_stage is None or len(set(device_of_stage)) == num_stages:
        # Exact min-max by DP over (stage, end) with O(S * n^2): fine for n <= a few hundred.
        inf = float("inf")
        best = [[inf] * (n + 1) for _ in range(num_stages + 1)]
        cut = [[0] * (n + 1) for _ in range(num_stages + 1)]
        best[0][0] = 0.0
        for k in range(1, num_stages + 1):
            for j in range(k, n - (num_stages - k) + 1):
                for i in range(k - 1, j):
                    v = max(best[k - 1][i], prefix[j] - prefix[i])
                    if v < best[k][j]:
                        best[k][j], cut[k][j] = v, i
        sizes, j = [], n
        for k in range(num_stages, 0, -1):
            i = cut[k][j]
            sizes.append(j - i)
            j = i
        return tuple(reversed(sizes))
    return _balanced_by_device(weights, prefix, num_stages, list(device_of_stage))


def _balanced_by_device(
    weights: Sequence[float], prefix: list[float], num_stages: int, devices: list[int]
) -> tuple[int, ...]:
    """Hill-climb stage boundaries to minimize (heaviest device, sum of squared device loads).

    Starts from both the uniform split and the exact stage-balanced split; a move takes 1 or 2
    layers from one stage and gives them to any other, shifting every boundary in between.
    """
    n = len(weights)
    num_dev = max(devices) + 1

    def score(sz: list[int]) -> tuple[float, float]:
        loads = [0.0] * num_dev
        pos = 0
        for k, m in enumerate(sz):
            loads[devices[k]] += prefix[pos + m] - prefix[pos]
            pos += m
        return max(loads), sum(x * x for x in loads)

    best_sizes: list[int] | None = None
    best_score = (float("inf"), float("inf"))
    for start in (list(uniform_partition(n, num_stages)), list(balanced_partition(weights, num_stages))):
        sizes, cur = start, score(start)
        improved = True
        while improved:
            improved = False
            # Move size from stage i to stage j: every layer in between shifts by delta.
            for i, j in itertools.combinations(range(num_stages), 2):
                for delta in (1, -1, 2, -2):
                    if sizes[i] - delta < 1 or sizes[j] + delta < 1:
                        continue
                    trial = list(sizes)
                    trial[i] -= delta
                    trial[j] += delta
                    sc = score(trial)
                    if sc < cur:
                        sizes, cur, improved = trial, sc, True
        if cur < best_score:
            best_sizes, best_score = sizes, cur
    assert best_sizes is not None
    return tuple(best_sizes)


def split_layer(
    layers: LayerCosts, index: int, num_parts: int, *, carry_bytes: float | None = None
) -> LayerCosts:
    """Split layer ``index`` into ``num_parts`` consecutive units of equal cost (a vocab-sharded head).

    A head split this way is a chain of vocabulary shards computing cross-entropy with an online
    softmax: each shard passes the hidden state plus the running max, sum and target logit to the
    next (``carry_bytes``, default: ``layers.head_carry_bytes``, else the previous layer's output), and
    backward passes the global log-sum-exp and the partial input gradient back. Compute, activations
    and parameters split evenly; only the last part's output is the layer's own output.
    """
    if num_parts < 1:
        raise ValueError(f"num_parts must be >= 1, got {num_parts}")
    if num_parts == 1:
        return layers
    if not 0 <= index < layers.num_layers:
        raise ValueError(f"layer index {index} outside 0..{layers.num_layers - 1}")
    carry = carry_bytes
    if carry is None and index == layers.num_layers - 1:  # the head: vocab_head's boundary
        carry = layers.head_carry_bytes
    if carry is None:
        carry = layers.out_bytes[index - 1] if index > 0 else 0.0

    def rep(values: tuple[float, ...], parts: list[float]) -> tuple[float, ...]:
        return values[:index] + tuple(parts) + values[index + 1 :]

    k = num_parts
    names = layers.names or tuple(f"layer{j}" for j in range(layers.num_layers))
    return LayerCosts(
        f=rep(layers.f, [layers.f[index] / k] * k),
        i=rep(layers.i, [layers.i[index] / k] * k),
        w=rep(layers.w, [layers.w[index] / k] * k),
        act_bytes=rep(layers.act_bytes, [layers.act_bytes[index] / k] * k),
        out_bytes=rep(layers.out_bytes, [carry] * (k - 1) + [layers.out_bytes[index]]),
        static_bytes=rep(layers.static_bytes, [layers.static_bytes[index] / k] * k),
        names=names[:index] + tuple(f"{names[index]}[{j}/{k}]" for j in range(k)) + names[index + 1 :],
        head_carry_bytes=layers.head_carry_bytes,
    )
