"""Row L2 normalization computed column by column (consecutive accesses a row apart), per-row sums of squares
in a scratch array, scalar at -O1."""

import ctypes

import torch
from torch import nn

from steptune.kernels.cext import load_c, ptr

SOURCE = r"""
#include <math.h>
#include <stdint.h>

void l2_normalize(const float *x, float *out, float *sum_sq, int64_t rows, int64_t cols, float eps) {
    for (int64_t r = 0; r < rows; r++) sum_sq[r] = 0.0f;
    for (int64_t j = 0; j < cols; j++)
        for (int64_t r = 0; r < rows; r++)
            sum_sq[r] += x[r * cols + j] * x[r * cols + j];
    for (int64_t j = 0; j < cols; j++)
        for (int64_t r = 0; r < rows; r++)
            out[r * cols + j] = x[r * cols + j] / fmaxf(sqrtf(sum_sq[r]), eps);
}
"""

_lib = load_c(SOURCE, flags=("-O1", "-std=c11", "-fPIC", "-shared"))
_f32p = ctypes.POINTER(ctypes.c_float)
_lib.l2_normalize.argtypes = [_f32p, _f32p, _f32p, ctypes.c_int64, ctypes.c_int64, ctypes.c_float]
_lib.l2_normalize.restype = None


class ModelNew(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x.contiguous()
        cols = x.shape[-1]
        rows = x.numel() // cols
        out = torch.empty_like(x)
        sum_sq = torch.empty(rows, dtype=x.dtype)
        _lib.l2_normalize(ptr(x), ptr(out), ptr(sum_sq), rows, cols, 1e-12)
        return out
