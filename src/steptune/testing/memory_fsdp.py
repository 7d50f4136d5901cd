"""TapeSAC inside FSDP2 (one spawned gloo rank per process): the rank function the dist tests run.

FSDP2 frees each layer's unsharded parameters after its forward and all-gathers them again before
its backward; TapeSAC's replay reads those parameters, so it is only correct if it runs after the
pre-backward all-gather and never holds a stale or freed storage. Each rank trains the same HF
Qwen3 stack (random weights) three steps under FSDP2 without checkpointing, with TapeSAC applied
after ``fully_shard`` and before it, and with torch's checkpointing, and reports its local shards,
losses and each policy's MemTracker peak of one step.
"""

from __future__ import annotations

import contextlib
from typing import Any

import torch
from torch import nn

__all__ = ["fsdp_rank"]

_CONFIG = {
    "vocab_size": 257,
    "hidden_size": 64,
    "intermediate_size": 160,
    "num_hidden_layers": 3,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "max_position_embeddings": 128,
    "tie_word_embeddings": False,
    "use_cache": False,
}


def _model() -> nn.Module:
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = AutoConfig.for_model("qwen3", **_CONFIG)
    cfg._attn_implementation = "sdpa"
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg)
    model.train()
    return model


def _batch(step: int, rank: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(100 * step + rank)
    ids = torch.randint(0, _CONFIG["vocab_size"], (4, 64), generator=g)
    return {"input_ids": ids, "labels": ids}


def _train(policy: str, before_shard: bool, rank: int, steps: int) -> dict[str, Any]:
    from torch.distributed._tools.mem_tracker import MemTracker
    from torch.distributed.fsdp import fully_shard

    from steptune.memory.measure import apply_policy

    model = _model()
    with contextlib.ExitStack() as stack:
        handle = stack.enter_context(apply_policy(model, policy)) if before_shard else None
        for layer in model.model.layers:
            fully_shard(layer)
        fully_shard(model)
        if not before_shard:
            handle = stack.enter_context(apply_policy(model, policy))
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        losses, tracker = [], MemTracker()
        tracker.track_external(model, opt)
        for step in range(steps):
            # the last step is measured: tapes reused, gradients allocated
            with tracker if step == steps - 1 else contextlib.nullcontext():
                loss = model(**_batch(step, rank)).loss
                loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=False)
            losses.append(loss.item())
    stats = handle.stats if handle is not None else None
    return {
        "losses": losses,
        "shards": [p.to_local().detach().clone() for p in model.parameters()],
        "peak": max(int(d["Total"]) for d in tracker.get_tracker_snapshot("peak").values()),
        "recorded": stats.recorded if stats else 0,
        "forwards": stats.forwards if stats else 0,
        "replays": stats.replays if stats else 0,
    }


def fsdp_rank(rank: int, group: Any, steps: int = 3) -> dict[str, Any]:
    del group  # fully_shard uses the default group the pool registered
    runs = {
        "no_ac": _train("no_ac", False, rank, steps),
        "tapesac_after_shard": _train("tapesac_replay", False, rank, steps),
        "tapesac_before_shard": _train("tapesac_replay", True, rank, steps),
        "full_ac_no_early_stop": _train("full_ac_no_early_stop", False, rank, steps),
    }
    ref = runs["no_ac"]["shards"]
    out: dict[str, Any] = {}
    for policy, r in runs.items():
        diff = max((a - b).abs().max().item() for a, b in zip(ref, r.pop("shards"), strict=True))
        out[policy] = {**r, "max_shard_diff": diff}
    return out
