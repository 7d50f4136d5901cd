"""GELU (tanh) as the textbook formula in a scalar loop over libm tanhf, compiled at -O1 (scalar)."""

import ctypes

import torch
from torch import nn

from steptune.kernels.cext import load_c, ptr

SOURCE = r"""
#include <math.h>
#include <stdint.h>

void gelu_tanh(const float *x, float *out, int64_t n) {
    const float k = sqrtf(2.0f / 3.14159265358979f);
    for (int64_t i = 0; i < n; i++) {
        out[i] = 0.5f * x[i] * (1.0f + tanhf(k * (x[i] + 0.044715f * x[i] * x[i] * x[i])));
    }
}
"""

_lib = load_c(SOURCE, flags=("-O1", "-std=c11", "-fPIC", "-shared"))
_f32p = ctypes.POINTER(ctypes.c_float)
_lib.gelu_tanh.argtypes = [_f32p, _f32p, ctypes.c_int64]
_lib.gelu_tanh.restype = None


class ModelNew(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x.contiguous()
        out = torch.empty_like(x)
        _lib.gelu_tanh(ptr(x), ptr(out), x.numel())
        return out
