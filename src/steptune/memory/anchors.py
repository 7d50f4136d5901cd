"""Hand-tuned checkpointing policies from other systems, run for real on the same blocks.

- ``torchtitan_sac``: torchtitan's op-level selective AC (torchtitan/distributed/activation_checkpoint.py,
  2026-08): torch SAC saving the compute-intensive ops (mm, addmm, bmm, convolution, the SDPA
  variants, _scaled_mm, linear) plus aten.max and aten.topk, with every second mm of a block
  recomputed, device-to-host copies always saved, everything else recomputed; ``early_stop=False``
  and ``preserve_rng_state=True`` as torchtitan sets them.
- ``hf_every_2``: HF transformers ``activation_checkpointing_enable(every_n_layers=2)``: full
  non-reentrant checkpointing (early stop on) of every second decoder layer, starting with the first.
- ``megatron_core_attn``: Megatron-LM's default selective recompute (``recompute_modules=["core_attn"]``):
  only the attention core is recomputed, every other activation is kept as plain autograd keeps
  it: HF's registered SDPA attention function runs under non-reentrant checkpointing (query, key
  and value are its kept inputs, its output and softmax statistics are recomputed).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

__all__ = ["ANCHORS", "apply_anchor_", "remove_anchor_"]

ANCHORS = ("torchtitan_sac", "hf_every_2", "megatron_core_attn")

_aten = torch.ops.aten
_ATTENTION = {
    _aten._scaled_dot_product_flash_attention.default,
    _aten._scaled_dot_product_efficient_attention.default,
    _aten._scaled_dot_product_cudnn_attention.default,
    _aten._scaled_dot_product_flash_attention_for_cpu.default,
    _aten._flash_attention_forward.default,
    _aten._efficient_attention_forward.default,
}
_TORCHTITAN_SAVE = {
    _aten.mm.default,
    _aten.addmm.default,
    _aten.bmm.default,
    _aten.convolution.default,
    _aten._scaled_mm.default,
    _aten.linear.default,
    _aten.max.default,
    _aten.topk.default,
    *_ATTENTION,
}


def _torchtitan_context() -> Any:
    from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

    mm_count = {"forward": 0, "recompute": 0}

    def policy(ctx: Any, func: Any, *args: Any, **kwargs: Any) -> Any:
        if (
            func == _aten._to_copy.default
            and "cuda" in str(args[0].device)
            and str(kwargs.get("device")) == "cpu"
        ):
            return CheckpointPolicy.MUST_SAVE
        # torchtitan counts forward and recompute calls apart (older torch calls the policy in both)
        mode = "recompute" if getattr(ctx, "is_recompute", False) else "forward"
        if func == _aten.mm.default:
            mm_count[mode] += 1
        # torchtitan: "recompute every second mm" (per block call)
        save = func in _TORCHTITAN_SAVE and not (func == _aten.mm.default and mm_count[mode] % 2 == 0)
        return CheckpointPolicy.MUST_SAVE if save else CheckpointPolicy.PREFER_RECOMPUTE

    return create_selective_checkpoint_contexts(policy)


def _wrapped(
    forward: Callable[..., Any],
    early_stop: bool,
    context_fn: Callable[[], Any] | None,
    *args: Any,
    **kwargs: Any,
) -> Any:
    from torch.utils.checkpoint import checkpoint

    if not torch.is_grad_enabled():
        return forward(*args, **kwargs)
    extra: dict[str, Any] = {} if context_fn is None else {"context_fn": context_fn}
    return checkpoint(forward, *args, use_reentrant=False, early_stop=early_stop, **extra, **kwargs)


def apply_anchor_(
    name: str, blocks: list[tuple[str, nn.Module]], context: Callable[[], Any] | None = None
) -> list[nn.Module] | Callable[[], None]:
    """Apply anchor ``name`` to ``blocks``; returns what :func:`remove_anchor_` undoes."""
    if name == "torchtitan_sac":
        chosen, early_stop, ctx = [b for _, b in blocks], False, _torchtitan_context
    elif name == "hf_every_2":
        chosen, early_stop, ctx = [b for i, (_, b) in enumerate(blocks) if i % 2 == 0], True, None
    elif name == "megatron_core_attn":
        return _checkpoint_core_attention()
    elif name.startswith("torch_auto_sac"):
        if context is None:
            raise ValueError(f"{name} needs auto-SAC's decisions (steptune.memory.autosac.auto_sac_context)")
        chosen, early_stop, ctx = [b for _, b in blocks], True, context
    else:
        raise ValueError(f"unknown anchor {name!r}; choose one of {ANCHORS}")
    for block in chosen:
        block.forward = functools.partial(_wrapped, block.forward, early_stop, ctx)  # type: ignore[method-assign]
    return chosen


def remove_anchor_(wrapped: list[nn.Module] | Callable[[], None]) -> None:
    if callable(wrapped):
        wrapped()
        return
    for block in wrapped:
        del block.forward


def _checkpoint_core_attention() -> Callable[[], None]:
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    local = getattr(ALL_ATTENTION_FUNCTIONS, "_local_mapping", None)
    had_local = local is None or "sdpa" in local
    original = ALL_ATTENTION_FUNCTIONS["sdpa"]

    def core_attention(*args: Any, **kwargs: Any) -> Any:
        from torch.utils.checkpoint import checkpoint

        if not torch.is_grad_enabled():
            return original(*args, **kwargs)
        return checkpoint(original, *args, use_reentrant=False, **kwargs)

    ALL_ATTENTION_FUNCTIONS["sdpa"] = core_attention

    def restore() -> None:
        if had_local or local is None:
            ALL_ATTENTION_FUNCTIONS["sdpa"] = original
        else:
            local.pop("sdpa", None)

    return restore
