"""A C kernel that never returns."""

# expect: timeout
import torch
from torch import nn

from steptune.kernels.cext import load_c, ptr

lib = load_c("void spin(float* y) { volatile long i = 0; for (;;) i++; }")


class ModelNew(nn.Module):
    def forward(self, x):
        y = torch.empty_like(x)
        lib.spin(ptr(y))
        return y
