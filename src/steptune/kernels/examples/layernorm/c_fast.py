"""LayerNorm per row in two passes over an L1-resident row (both moments, then the affine write), the
write with non-temporal stores: the output is not read back here, so skipping the read-for-ownership of its
cache lines saves a third of the memory traffic (torch's kernel is already one pass per row and
memory-bound at this size)."""

import ctypes

import torch
from torch import nn

from steptune.kernels.cext import DEFAULT_CFLAGS, load_c, ptr

SOURCE = r"""
#include <immintrin.h>
#include <math.h>
#include <stdint.h>

void layernorm(const float *restrict x, const float *restrict weight, const float *restrict bias,
               float *restrict out, int64_t rows, int64_t hidden, float eps) {
    for (int64_t r = 0; r < rows; r++) {
        const float *xr = x + r * hidden;
        float *yr = out + r * hidden;
        /* Both moments in one pass, on data shifted by the row's first element: the shift keeps
           E[d^2] - E[d]^2 from cancelling badly when the mean is large against the spread. */
        float shift = xr[0], sum = 0.0f, sum_sq = 0.0f;
        for (int64_t j = 0; j < hidden; j++) {
            float d = xr[j] - shift;
            sum += d;
            sum_sq += d * d;
        }
        float mean_d = sum / (float)hidden;
        float var = sum_sq / (float)hidden - mean_d * mean_d;
        float mean = shift + mean_d;
        float rstd = 1.0f / sqrtf((var > 0.0f ? var : 0.0f) + eps);
        int64_t j = 0;
#ifdef __AVX512F__
        if (((uintptr_t)yr & 63) == 0) {
            __m512 vmean = _mm512_set1_ps(mean), vrstd = _mm512_set1_ps(rstd);
            for (; j + 16 <= hidden; j += 16) {
                __m512 v = _mm512_mul_ps(_mm512_sub_ps(_mm512_loadu_ps(xr + j), vmean), vrstd);
                v = _mm512_fmadd_ps(v, _mm512_loadu_ps(weight + j), _mm512_loadu_ps(bias + j));
                _mm512_stream_ps(yr + j, v);
            }
        }
#endif
        for (; j < hidden; j++) yr[j] = (xr[j] - mean) * rstd * weight[j] + bias[j];
    }
    _mm_sfence(); /* order the streamed stores before the caller reads the output */
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
_lib.layernorm.argtypes = [_f32p, _f32p, _f32p, _f32p, ctypes.c_int64, ctypes.c_int64, ctypes.c_float]
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
        out = torch.empty_like(x)
        weight, bias = self.weight.detach(), self.bias.detach()
        _lib.layernorm(ptr(x), ptr(weight), ptr(bias), ptr(out), x.numel() // hidden, hidden, self.eps)
        return out
