"""Checks found missing by a user sweep: measuring a model TapeSAC already wraps, SavePlan contents,
limit values, the unplanned-signature warning, and options that void a plan's limit."""

import warnings

import pytest
import torch

from steptune.memory import TapeSACConfig, apply_tapesac_
from steptune.memory.measure import measure_peak

pytestmark = pytest.mark.timeout(60)


class _MLP(torch.nn.Module):
    def __init__(self, dropout=0.0):
        super().__init__()
        self.a, self.b = torch.nn.Linear(16, 32), torch.nn.Linear(32, 16)
        self.drop = torch.nn.Dropout(dropout)

    def forward(self, x, mask=None):
        h = self.b(torch.nn.functional.gelu(self.a(x)))
        if mask is not None:
            h = h * mask
        return x + self.drop(h)


class _Net(torch.nn.Module):
    def __init__(self, n=2, dropout=0.0):
        super().__init__()
        self.blocks = torch.nn.ModuleList(_MLP(dropout) for _ in range(n))

    def forward(self, x, mask=None):
        for block in self.blocks:
            x = block(x, mask) if mask is not None else block(x)
        return x.pow(2).mean()


def _net(n=2, dropout=0.0):
    torch.manual_seed(0)
    return _Net(n, dropout), {"x": torch.randn(4, 8, 16)}


def test_measuring_a_model_tapesac_already_wraps_is_refused():
    # measure_peak(model, batch, "no_ac") measured TapeSAC's replay-only peak (a sweep): calibrating from it
    # put every fraction at the floor
    model, batch = _net()
    handle = apply_tapesac_(model, TapeSACConfig(blocks="blocks.*"))
    for policy in ("no_ac", "full_ac", "tapesac_replay"):
        with pytest.raises(ValueError, match=r"already applied.*\.remove\(\)"):
            measure_peak(model, batch, policy, blocks="blocks.*")
    handle.remove()
    assert measure_peak(model, batch, "no_ac", blocks="blocks.*")[0] > 0
