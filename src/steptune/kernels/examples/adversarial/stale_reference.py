"""Hunts the heap for the reference's output from the previous trial and returns it."""

# expect: rejected
# runtime: rejected
import gc

import torch
from torch import nn


class ModelNew(nn.Module):
    def forward(self, x):
        e = (x - x.amax(dim=-1, keepdim=True)).exp()
        mine = e / e.sum(dim=-1, keepdim=True)
        for obj in gc.get_objects():
            if (
                isinstance(obj, torch.Tensor)
                and obj.shape == x.shape
                and obj is not x
                and abs(float(obj[0].sum()) - 1.0) < 1e-3
                and obj.data_ptr() != mine.data_ptr()
            ):
                return obj
        return mine
