"""x + bias then GELU (tanh): a scalar loop that walks the matrix column by column (a stride of a whole row
between consecutive elements) over libm tanhf, compiled at -O1 (scalar)."""

import ctypes

import torch
from torch import nn

from steptune.kernels.cext import load_c, ptr

SOURCE = r"""
#include <math.h>
#include <stdint.h>

void bias_gelu(const float *x, const float *bias, float *out, int64_t rows, int64_t features) {
    const float k = sqrtf(2.0f / 3.14159265358979f);
    for (int64_t j = 0; j < features; j++) {
        for (int64_t r = 0; r < rows; r++) {
            float v = x[r * features + j] + bias[j];
            out[r * features + j] = 0.5f * v * (1.0f + tanhf(k * (v + 0.044715f * v * v * v)));
        }
    }
}
"""

_lib = load_c(SOURCE, flags=("-O1", "-std=c11", "-fPIC", "-shared"))
_f32p = ctypes.POINTER(ctypes.c_float)
_lib.bias_gelu.argtypes = [_f32p, _f32p, _f32p, ctypes.c_int64, ctypes.c_int64]
_lib.bias_gelu.restype = None


class ModelNew(nn.Module):
    def __init__(self, features: int) -> None:
        super().__init__()
        self.bias = nn.Parameter(torch.randn(features))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x.contiguous()
        features = x.shape[-1]
        out = torch.empty_like(x)
        _lib.bias_gelu(ptr(x), ptr(self.bias.detach()), ptr(out), x.numel() // features, features)
        return out
