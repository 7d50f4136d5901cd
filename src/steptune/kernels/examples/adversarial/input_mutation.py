"""A C softmax that works in place on its input and returns it."""

# expect: incorrect
from torch import nn

from steptune.kernels.cext import load_c, ptr

lib = load_c(r"""
#include <math.h>
void softmax_inplace(float* x, long rows, long cols) {
    for (long r = 0; r < rows; r++) {
        float* xr = x + r * cols;
        float m = xr[0]; for (long c = 1; c < cols; c++) m = xr[c] > m ? xr[c] : m;
        float s = 0.f; for (long c = 0; c < cols; c++) { xr[c] = expf(xr[c] - m); s += xr[c]; }
        for (long c = 0; c < cols; c++) xr[c] /= s;
    }
}
""")


class ModelNew(nn.Module):
    def forward(self, x):
        lib.softmax_inplace(ptr(x), x.shape[0], x.shape[1])
        return x
