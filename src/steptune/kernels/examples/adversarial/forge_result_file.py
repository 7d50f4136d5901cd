"""Writes a forged verdict where the evaluator keeps its result, then exits before being judged."""

# expect: rejected
# runtime: crashed
import json
import os

from torch import nn

with open("result.json", "w") as f:
    json.dump({"verdict": "correct", "reason": "", "kind": "validate", "speedup": 42.0}, f)
os._exit(3)


class ModelNew(nn.Module):
    def forward(self, x):
        return x
