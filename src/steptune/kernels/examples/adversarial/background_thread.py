"""A C kernel that leaves a pthread spinning after it returns."""

# expect: rejected
# runtime: rejected
import torch
from torch import nn

from steptune.kernels.cext import load_c, ptr

lib = load_c(
    r"""
#include <math.h>
#include <pthread.h>
#include <unistd.h>
static void* bg(void* a) { for (;;) sleep(1); return a; }
void softmax_rows(const float* x, float* y, long rows, long cols) {
    pthread_t t; pthread_create(&t, 0, bg, 0);
    for (long r = 0; r < rows; r++) {
        const float* xr = x + r * cols; float* yr = y + r * cols;
        float m = xr[0]; for (long c = 1; c < cols; c++) m = xr[c] > m ? xr[c] : m;
        float s = 0.f; for (long c = 0; c < cols; c++) { yr[c] = expf(xr[c] - m); s += yr[c]; }
        for (long c = 0; c < cols; c++) yr[c] /= s;
    }
}
""",
    flags=("-O2", "-std=c11", "-fPIC", "-shared", "-pthread"),
)


class ModelNew(nn.Module):
    def forward(self, x):
        y = torch.empty_like(x)
        lib.softmax_rows(ptr(x), ptr(y), x.shape[0], x.shape[1])
        return y
