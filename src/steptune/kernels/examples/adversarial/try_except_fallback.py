"""A broken C kernel behind a try/except that falls back to torch."""

# expect: rejected
import torch
from torch import nn

from steptune.kernels.cext import load_c, ptr


class ModelNew(nn.Module):
    def forward(self, x):
        try:
            lib = load_c("void f(float* x) { x[0] = 1.0f; }")
            y = torch.empty_like(x)
            lib.missing_symbol(ptr(x), ptr(y))
            return y
        except Exception:
            return torch.softmax(x, dim=-1)
