"""A vocabulary-sharded LM head for pipeline stages: the head's cross-entropy in ``k`` chained units.

The tuner splits a heavy head (``costs.split_layer``) into ``k`` vocabulary shards on different
stages. Here that head is real. Shard ``j`` holds rows ``[lo_j, hi_j)`` of the output projection and
computes its logits ``z``; the boundary between shards carries the normalised hidden state plus a
running max ``m``, a running sum ``s = sum exp(z - m)`` over the vocabulary seen so far and the target's
logit ``t`` (zero until the shard holding the target adds it). The last shard's output gives the loss
``m + log(s) - t`` per token, which is the cross-entropy of the whole vocabulary (online softmax).

Contract. Stage boundaries are single tensors, so the targets travel with the activations: the model's
input is ``(ids, targets)`` stacked as ``(B, S, 2)`` int64 (``pack_targets``), the embedding appends the
targets as one float channel (exact below 2**24 ids) and every block carries it through untouched. The
boundaries are fp32 whatever the model's dtype (a bf16 hidden state round-trips exactly; bf16 would
round target ids above 256 and the running sums); each unit computes in its own parameters' dtype. The
first shard applies the head's norm; the others receive its output. ``m`` is detached: the loss does not
depend on it, so the gradient is exactly softmax minus one-hot, without a subgradient through the max.
The boundary is ``H + 4`` channels (hidden, m, s, t, target); the backward of a shard passes the gradient
of the carried hidden state and of ``s`` and ``t`` back, which is the issue's log-sum-exp and partial
input gradient.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence

import torch
from torch import Tensor, nn

__all__ = [
    "CarryTargets",
    "TargetsEmbed",
    "VocabShard",
    "carry_layers",
    "pack_targets",
    "shard_head",
    "sharded_lm_loss",
]


def pack_targets(ids_BS: Tensor, targets_BS: Tensor) -> Tensor:
    """The model input of a sharded-head model: ``(B, S, 2)`` int64."""
    return torch.stack([ids_BS, targets_BS], dim=-1)


class TargetsEmbed(nn.Module):
    """``embed(ids)`` with the targets appended as one float channel: ``(B, S, 2)`` -> ``(B, S, H + 1)``."""

    def __init__(self, embed: nn.Module) -> None:
        super().__init__()
        self.embed = embed

    def forward(self, ids_targets_BS2: Tensor) -> Tensor:
        h_BSH: Tensor = self.embed(ids_targets_BS2[..., 0])
        return torch.cat([h_BSH.float(), ids_targets_BS2[..., 1:].float()], dim=-1)


class CarryTargets(nn.Module):
    """A block that maps ``(B, S, H)`` to itself, carrying the target channel past it."""

    def __init__(self, block: nn.Module) -> None:
        super().__init__()
        self.block = block

    def forward(self, x_BSC: Tensor) -> Tensor:
        y_BSH: Tensor = self.block(x_BSC[..., :-1].to(_dtype(self.block, x_BSC)))
        return torch.cat([y_BSH.float(), x_BSC[..., -1:]], dim=-1)


def _dtype(module: nn.Module, default: Tensor) -> torch.dtype:
    """The dtype a module computes in (its first parameter's): the fp32 boundary goes back to it."""
    return next((p.dtype for p in module.parameters()), default.dtype)


class VocabShard(nn.Module):
    """Rows ``[lo, lo + weight.shape[0])`` of the head's projection; ``norm`` on the first shard only."""

    def __init__(self, weight_VH: Tensor, lo: int, norm: nn.Module | None) -> None:
        super().__init__()
        self.weight = nn.Parameter(weight_VH.detach().clone())
        self.lo = lo
        self.norm = norm  # the head's norm (first shard), applied once; later shards get its output

    def forward(self, x: Tensor) -> Tensor:
        if self.norm is not None:  # (B, S, H + 1): hidden and target
            n_BSH, tgt_BS = self.norm(x[..., :-1].to(_dtype(self.norm, x))), x[..., -1]
            m_BS = s_BS = t_BS = None
        else:  # (B, S, H + 4): normalised hidden, m, s, t, target
            n_BSH, m_BS, s_BS, t_BS, tgt_BS = x[..., :-4], x[..., -4], x[..., -3], x[..., -2], x[..., -1]
        z_BSV = (n_BSH.to(self.weight.dtype) @ self.weight.t()).float()
        z_max = z_BSV.detach().amax(dim=-1)
        m_new = z_max if m_BS is None else torch.maximum(m_BS.detach(), z_max)
        part = torch.exp(z_BSV - m_new[..., None]).sum(dim=-1)
        s_new = part if s_BS is None else s_BS * torch.exp(m_BS.detach() - m_new) + part
        idx = tgt_BS.long() - self.lo
        mine = (idx >= 0) & (idx < self.weight.shape[0])
        z_t = z_BSV.gather(-1, idx.clamp(0, self.weight.shape[0] - 1)[..., None])[..., 0]
        t_here = torch.where(mine, z_t, torch.zeros_like(z_t))
        t_new = t_here if t_BS is None else t_BS + t_here
        stats = torch.stack([m_new, s_new, t_new, tgt_BS.float()], dim=-1)
        return torch.cat([n_BSH.float(), stats], dim=-1)  # fp32: bf16 would round target ids above 256


def shard_head(norm: nn.Module, weight_VH: Tensor, num_shards: int) -> list[VocabShard]:
    """``num_shards`` chained shards of a head ``logits = norm(h) @ weight.T`` (near-equal vocab slices)."""
    vocab = weight_VH.shape[0]
    if vocab > 2**24:  # target ids ride in an fp32 channel: exact up to 2**24
        raise ValueError(f"a vocabulary of {vocab} ids exceeds 2**24, the largest carried exactly in fp32")
    if not 1 <= num_shards <= vocab:
        raise ValueError(f"num_shards must be in 1..{vocab} (the vocabulary), got {num_shards}")
    bounds = [round(j * vocab / num_shards) for j in range(num_shards + 1)]
    return [
        VocabShard(weight_VH[lo:hi], lo, norm if j == 0 else None)
        for j, (lo, hi) in enumerate(itertools.pairwise(bounds))
    ]


def sharded_lm_loss(out_BSC: Tensor, targets_BS: Tensor | None = None) -> Tensor:
    """Mean cross-entropy from the last shard's output over the positions whose target is not negative
    (``ignore_index=-100`` of ``F.cross_entropy``). The targets ride in it; ``targets_BS`` only fills
    the ``loss_fn(output, target)`` signature of the executors (torch's runtime calls it on placeholder
    tensors while it infers shapes, so it is not compared)."""
    m, s, t, tgt = out_BSC[..., -4], out_BSC[..., -3], out_BSC[..., -2], out_BSC[..., -1]
    per_token = m.float() + torch.log(s.float()) - t.float()
    valid = tgt >= 0  # a negative target (transformers' -100) is ignored, as cross_entropy ignores it
    return torch.where(valid, per_token, torch.zeros_like(per_token)).sum() / valid.sum().clamp(min=1)


def carry_layers(embed: nn.Module, blocks: Sequence[nn.Module]) -> list[nn.Module]:
    """``[TargetsEmbed(embed), CarryTargets(block) ...]``: the trunk of a sharded-head model."""
    return [TargetsEmbed(embed), *(CarryTargets(b) for b in blocks)]
