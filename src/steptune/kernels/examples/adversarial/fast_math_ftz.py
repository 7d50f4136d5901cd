"""A correct C softmax built with -ffast-math, which turns on flush-to-zero for the whole process on load."""

# expect: rejected
import torch
from torch import nn

from steptune.kernels.cext import load_c, ptr

lib = load_c(
    r"""
#include <math.h>
void softmax_rows(const float* x, float* y, long rows, long cols) {
    for (long r = 0; r < rows; r++) {
        const float* xr = x + r * cols; float* yr = y + r * cols;
        float m = xr[0]; for (long c = 1; c < cols; c++) m = xr[c] > m ? xr[c] : m;
        float s = 0.f; for (long c = 0; c < cols; c++) { yr[c] = expf(xr[c] - m); s += yr[c]; }
        for (long c = 0; c < cols; c++) yr[c] /= s;
    }
}
""",
    flags=("-O3", "-ffast-math", "-fPIC", "-shared"),
)


class ModelNew(nn.Module):
    def forward(self, x):
        y = torch.empty_like(x)
        lib.softmax_rows(ptr(x), ptr(y), x.shape[0], x.shape[1])
        return y
