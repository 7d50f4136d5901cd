"""RMSNorm per row in two passes over an L1-resident row (sum of squares, then scale); eager torch runs pow,
mean, add, rsqrt and two multiplies as separate full-tensor ops."""

import ctypes

import torch
from torch import nn

from steptune.kernels.cext import DEFAULT_CFLAGS, load_c, ptr

SOURCE = r"""
#include <math.h>
#include <stdint.h>

void rmsnorm(const float *restrict x, const float *restrict weight, float *restrict out, int64_t rows,
             int64_t hidden, float eps) {
    for (int64_t r = 0; r < rows; r++) {
        const float *xr = x + r * hidden;
        float *yr = out + r * hidden;
        float sum_sq = 0.0f;
        for (int64_t j = 0; j < hidden; j++) sum_sq += xr[j] * xr[j];
        float inv_rms = 1.0f / sqrtf(sum_sq / (float)hidden + eps);
        for (int64_t j = 0; j < hidden; j++) yr[j] = xr[j] * inv_rms * weight[j];
    }
}
"""

# The parts of -ffast-math that let gcc vectorize the row reductions (reassociation, max without NaN rules)
# and rintf; not -ffast-math itself, which (gcc 12) links crtfastmath.o into the library and so turns on
# flush-to-zero for the whole process that loads it.
_FLAGS = (
    *DEFAULT_CFLAGS,
    "-ffp-contract=fast",
    "-fno-math-errno",
    "-fno-trapping-math",
    "-fno-signed-zeros",
    "-fassociative-math",
    "-ffinite-math-only",
)
_lib = load_c(SOURCE, flags=_FLAGS)
_f32p = ctypes.POINTER(ctypes.c_float)
_lib.rmsnorm.argtypes = [_f32p, _f32p, _f32p, ctypes.c_int64, ctypes.c_int64, ctypes.c_float]
_lib.rmsnorm.restype = None


class ModelNew(nn.Module):
    def __init__(self, hidden: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.randn(hidden))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x.contiguous()
        hidden = x.shape[-1]
        out = torch.empty_like(x)
        _lib.rmsnorm(ptr(x), ptr(self.weight.detach()), ptr(out), x.numel() // hidden, hidden, self.eps)
        return out
