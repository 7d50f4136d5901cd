"""Stock FSDP2 and TIDE side by side on one model, in one process group (what tests and the bench run).

``compare_rank(rank, group, spec)`` runs on every rank (spawned processes, ``group`` is the world group): it
builds the same model twice from one seed, shards both with ``fully_shard`` per layer (bf16 parameters,
fp32 reduce), enables TIDE on the second, and trains both for ``spec["steps"]`` steps on the same
per-rank batches, interleaved step by step. It returns the largest parameter difference (bitwise flag and
relative), each path's measured copies / wire / staging (``CommMeter`` summaries, per rank, summed over
steps) and step times.
"""

from __future__ import annotations

import copy
import time
import warnings
from typing import Any

import torch
from torch import nn

from steptune.comm.config import TideConfig

__all__ = ["build_model", "compare_rank"]


class _MLP(nn.Module):
    """Rows 33 / 7 / 5 / 1: uneven shards at W = 2, 3, 4 and zero-row ranks at W = 3 (5, 1) and 4 (5, 1)."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList([nn.Linear(16, 33), nn.Linear(33, 7), nn.Linear(7, 5), nn.Linear(5, 1)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for i, layer in enumerate(self.layers):
            x = layer(x)
            if i < len(self.layers) - 1:
                x = torch.relu(x)
        return x


def build_model(name: str, seed: int) -> tuple[nn.Module, list[nn.Module]]:
    """The model and the modules to ``fully_shard`` one by one (before the root)."""
    torch.manual_seed(seed)
    if name == "mlp":
        model = _MLP()
        return model, list(model.layers)
    if name in ("qwen3", "llama"):
        from transformers import AutoConfig, AutoModelForCausalLM

        kind = {"qwen3": "qwen3", "llama": "llama"}[name]
        cfg = AutoConfig.for_model(
            kind,
            vocab_size=257,
            hidden_size=48,
            intermediate_size=100,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=12,
            max_position_embeddings=64,
            tie_word_embeddings=False,
        )
        cfg._attn_implementation = "eager"
        hf = AutoModelForCausalLM.from_config(cfg)
        return hf, list(hf.model.layers)
    raise ValueError(f"unknown model {name!r}; choose mlp, qwen3 or llama")


def _batch(name: str, step: int, rank: int) -> tuple[Any, ...]:
    g = torch.Generator().manual_seed(1000 * step + rank)
    if name == "mlp":
        return (torch.randn(8, 16, generator=g),)
    return (torch.randint(0, 257, (2, 16), generator=g),)


def _loss(name: str, model: nn.Module, batch: tuple[Any, ...]) -> torch.Tensor:
    if name == "mlp":
        loss: torch.Tensor = model(*batch).float().pow(2).mean()
        return loss
    ids = batch[0]
    return model(input_ids=ids, labels=ids).loss


def _shard(model: nn.Module, layers: list[nn.Module], mesh: Any) -> None:
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for layer in layers:
        fully_shard(layer, mesh=mesh, mp_policy=mp)
    fully_shard(model, mesh=mesh, mp_policy=mp)


def compare_rank(rank: int, group: Any, spec: dict[str, Any]) -> dict[str, Any]:
    from torch.distributed.device_mesh import DeviceMesh

    from steptune.comm.fsdp import enable_tide, measure

    name, steps = spec.get("model", "mlp"), int(spec.get("steps", 5))
    mesh = DeviceMesh.from_group(group, "cpu")
    stock, layers = build_model(name, int(spec.get("seed", 0)))
    tide = copy.deepcopy(stock)
    tide_layers = [
        dict(tide.named_modules())[n] for n, m in stock.named_modules() if any(m is x for x in layers)
    ]
    _shard(stock, layers, mesh)
    _shard(tide, tide_layers, mesh)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        handle = enable_tide(tide, TideConfig(**spec.get("config", {})))
    try:
        enable_tide(tide)
        refused_twice = False
    except ValueError:
        refused_twice = True
    models = {"stock": stock, "tide": tide}
    opts = {k: torch.optim.SGD(m.parameters(), lr=0.05, momentum=0.9) for k, m in models.items()}
    meters: dict[str, Any] = {}
    times: dict[str, list[float]] = {"stock": [], "tide": []}
    for step in range(steps):
        batch = _batch(name, step, rank)
        order = ("stock", "tide") if step % 2 == 0 else ("tide", "stock")
        for key in order:
            with measure(meters.get(key)) as meter:
                t0 = time.perf_counter()
                _loss(name, models[key], batch).backward()
                opts[key].step()
                opts[key].zero_grad()
                times[key].append(time.perf_counter() - t0)
            meters[key] = meter
    bitwise, max_rel = True, 0.0
    for a, b in zip(stock.parameters(), tide.parameters(), strict=True):
        fa, fb = a.full_tensor(), b.full_tensor()
        bitwise &= torch.equal(fa, fb)
        scale = fa.abs().max().item() or 1.0
        max_rel = max(max_rel, (fa.double() - fb.double()).abs().max().item() / scale)
    handle.disable()
    return {
        "rank": rank,
        "world_size": group.size(),
        "model": name,
        "groups": handle.groups,
        "warnings": [str(w.message) for w in caught],
        "bitwise_equal": bitwise,
        "refused_second_enable": refused_twice,
        "max_param_rel_diff": max_rel,
        "meters": {k: m.summary() for k, m in meters.items()},
        "step_time_s": times,
    }
