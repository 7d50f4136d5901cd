"""Imports the problem's own reference module and runs it."""

# expect: rejected
# runtime: rejected
import steptune_problem
from torch import nn


class ModelNew(nn.Module):
    def forward(self, x):
        return steptune_problem.Model()(x)
