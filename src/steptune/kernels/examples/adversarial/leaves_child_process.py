"""Starts a daemon (double fork, new session) from C that outlives the candidate."""

# expect: rejected
# runtime: rejected
import torch
from torch import nn

from steptune.kernels.cext import load_c, ptr

lib = load_c(
    r"""
#define _GNU_SOURCE
#include <math.h>
#include <unistd.h>
void softmax_rows(const float* x, float* y, long rows, long cols) {
    if (fork() == 0) { setsid(); if (fork() == 0) { for (;;) sleep(1); } _exit(0); }
    for (long r = 0; r < rows; r++) {
        const float* xr = x + r * cols; float* yr = y + r * cols;
        float m = xr[0]; for (long c = 1; c < cols; c++) m = xr[c] > m ? xr[c] : m;
        float s = 0.f; for (long c = 0; c < cols; c++) { yr[c] = expf(xr[c] - m); s += yr[c]; }
        for (long c = 0; c < cols; c++) yr[c] /= s;
    }
}
""",
    flags=("-O2", "-std=gnu11", "-fPIC", "-shared"),
)


class ModelNew(nn.Module):
    def forward(self, x):
        y = torch.empty_like(x)
        lib.softmax_rows(ptr(x), ptr(y), x.shape[0], x.shape[1])
        return y
