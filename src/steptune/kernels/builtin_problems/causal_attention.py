import math

import torch
from torch import nn

DESCRIPTION = "Multi-head causal attention, softmax(q k^T / sqrt(d) + mask) v, (2, 8, 256, 64) fp32"

# The reference's ops, every BLAS entry point (torch.bmm, addmm or einsum would otherwise pass for a new
# kernel while calling the same library GEMM) and torch's fused attention.
FORBIDDEN_OPS = [
    "aten.mm",
    "aten.bmm",
    "aten.addmm",
    "aten.baddbmm",
    "aten.addbmm",
    "aten._addmm_activation",
    "aten.mv",
    "aten.addmv",
    "aten.dot",
    "aten.vdot",
    "aten.mul",
    "aten.masked_fill",
    "aten._softmax",
    "aten.scaled_dot_product_attention",
    "aten._scaled_dot_product_flash_attention_for_cpu",
    "aten._scaled_dot_product_attention_math",
]

BATCH, HEADS, SEQ, HEAD_DIM = 2, 8, 256, 64


class Model(nn.Module):
    def __init__(self, seq: int, head_dim: int) -> None:
        super().__init__()
        self.scale = 1.0 / math.sqrt(head_dim)
        # Built once here so that forward's ops are only the attention itself.
        self.register_buffer("mask", torch.ones(seq, seq, dtype=torch.bool).triu(1), persistent=False)

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        scores = torch.matmul(q, k.transpose(-2, -1)) * self.scale
        scores = scores.masked_fill(self.mask, float("-inf"))
        return torch.matmul(torch.softmax(scores, dim=-1), v)


def get_inputs() -> list[torch.Tensor]:
    shape = (BATCH, HEADS, SEQ, HEAD_DIM)
    return [torch.randn(shape), torch.randn(shape), torch.randn(shape)]


def get_init_inputs() -> list:
    return [SEQ, HEAD_DIM]
