"""LayerNorm computed column by column (consecutive accesses a row apart), per-row mean and variance in
scratch arrays, scalar at -O1."""

import ctypes

import torch
from torch import nn

from steptune.kernels.cext import load_c, ptr

SOURCE = r"""
#include <math.h>
#include <stdint.h>

void layernorm(const float *x, const float *weight, const float *bias, float *out, float *mean, float *var,
               int64_t rows, int64_t hidden, float eps) {
    for (int64_t r = 0; r < rows; r++) mean[r] = var[r] = 0.0f;
    for (int64_t j = 0; j < hidden; j++)
        for (int64_t r = 0; r < rows; r++) mean[r] += x[r * hidden + j] / (float)hidden;
    for (int64_t j = 0; j < hidden; j++)
        for (int64_t r = 0; r < rows; r++) {
            float d = x[r * hidden + j] - mean[r];
            var[r] += d * d / (float)hidden;
        }
    for (int64_t j = 0; j < hidden; j++)
        for (int64_t r = 0; r < rows; r++)
            out[r * hidden + j] = (x[r * hidden + j] - mean[r]) / sqrtf(var[r] + eps) * weight[j] + bias[j];
}
"""

_lib = load_c(SOURCE, flags=("-O1", "-std=c11", "-fPIC", "-shared"))
_f32p = ctypes.POINTER(ctypes.c_float)
_lib.layernorm.argtypes = [_f32p] * 6 + [ctypes.c_int64, ctypes.c_int64, ctypes.c_float]
_lib.layernorm.restype = None


class ModelNew(nn.Module):
    def __init__(self, hidden: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.randn(hidden))
        self.bias = nn.Parameter(torch.randn(hidden))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x.contiguous()
        hidden = x.shape[-1]
        rows = x.numel() // hidden
        out = torch.empty_like(x)
        mean = torch.empty(rows, dtype=x.dtype)
        var = torch.empty(rows, dtype=x.dtype)
        weight, bias = self.weight.detach(), self.bias.detach()
        _lib.layernorm(ptr(x), ptr(weight), ptr(bias), ptr(out), ptr(mean), ptr(var), rows, hidden, self.eps)
        return out
