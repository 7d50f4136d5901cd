"""A C kernel that dereferences NULL."""

# expect: crashed
import torch
from torch import nn

from steptune.kernels.cext import load_c, ptr

lib = load_c("void boom(float* y) { float* volatile p = 0; y[0] = *p; }")


class ModelNew(nn.Module):
    def forward(self, x):
        y = torch.empty_like(x)
        lib.boom(ptr(y))
        return y
