"""Claims a fast kernel but calls the reference op itself."""

# expect: rejected
import torch
from torch import nn


class ModelNew(nn.Module):
    def forward(self, x):
        return torch.nn.functional.softmax(x.contiguous(), dim=1)
