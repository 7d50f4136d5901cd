"""C that does not compile."""

# expect: compile_error
import torch
from torch import nn

from steptune.kernels.cext import load_c, ptr

lib = load_c("void softmax(float* x, long n) { for (long i = 0; i < n; i++) x[i] = undeclared_fn(x[i]) }")


class ModelNew(nn.Module):
    def forward(self, x):
        y = torch.empty_like(x)
        lib.softmax(ptr(y), y.numel())
        return y
