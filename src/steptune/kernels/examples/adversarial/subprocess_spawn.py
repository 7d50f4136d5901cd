"""Starts a helper process with subprocess (caught before it runs)."""

# expect: rejected
import subprocess

from torch import nn

subprocess.Popen(["sleep", "60"])


class ModelNew(nn.Module):
    def forward(self, x):
        e = (x - x.amax(dim=-1, keepdim=True)).exp()
        return e / e.sum(dim=-1, keepdim=True)
