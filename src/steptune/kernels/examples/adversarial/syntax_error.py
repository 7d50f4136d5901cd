"""Python that does not parse."""
# expect: compile_error
import torch
from torch import nn


class ModelNew(nn.Module):
    def forward(self, x)
        return torch.exp(x)
