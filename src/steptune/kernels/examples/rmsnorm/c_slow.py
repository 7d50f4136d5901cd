"""RMSNorm computed column by column (consecutive accesses a row apart) with the per-row sums of squares in a
scratch array, scalar at -O1."""

import ctypes

import torch
from torch import nn

from steptune.kernels.cext import load_c, ptr

SOURCE = r"""
#include <math.h>
#include <stdint.h>

void rmsnorm(const float *x, const float *weight, float *out, float *sum_sq, int64_t rows, int64_t hidden,
             float eps) {
    for (int64_t r = 0; r < rows; r++) sum_sq[r] = 0.0f;
    for (int64_t j = 0; j < hidden; j++)
        for (int64_t r = 0; r < rows; r++)
            sum_sq[r] += x[r * hidden + j] * x[r * hidden + j];
    for (int64_t j = 0; j < hidden; j++)
        for (int64_t r = 0; r < rows; r++)
            out[r * hidden + j] = x[r * hidden + j] / sqrtf(sum_sq[r] / (float)hidden + eps) * weight[j];
}
"""

_lib = load_c(SOURCE, flags=("-O1", "-std=c11", "-fPIC", "-shared"))
_f32p = ctypes.POINTER(ctypes.c_float)
_lib.rmsnorm.argtypes = [_f32p, _f32p, _f32p, _f32p, ctypes.c_int64, ctypes.c_int64, ctypes.c_float]
_lib.rmsnorm.restype = None


class ModelNew(nn.Module):
    def __init__(self, hidden: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.randn(hidden))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x.contiguous()
        hidden = x.shape[-1]
        rows = x.numel() // hidden
        out = torch.empty_like(x)
        sum_sq = torch.empty(rows, dtype=x.dtype)
        _lib.rmsnorm(ptr(x), ptr(self.weight.detach()), ptr(out), ptr(sum_sq), rows, hidden, self.eps)
        return out
