"""``core.dist.allreduce_grads``: one fp32 message, each gradient back in its dtype, owned layers only."""

import pytest
import torch

from steptune.core.dist import allreduce_grads
from steptune.testing import run_threads

pytestmark = [pytest.mark.dist, pytest.mark.timeout(60)]


def _rank(rank, group, owned_by_rank):
    model = torch.nn.Sequential(torch.nn.Linear(2, 3), torch.nn.Linear(3, 1).to(torch.bfloat16))
    params = list(model.parameters())
    for i, p in enumerate(params):
        if i != 1 or rank == 0:  # the first bias has a gradient on rank 0 only
            p.grad = torch.full_like(p, float(rank + 1 + i))
    allreduce_grads(params, group, owned_by_rank[rank] if owned_by_rank else None)
    return [None if p.grad is None else (p.grad.dtype, p.grad.flatten().tolist()) for p in params]


def test_gradients_are_summed_and_keep_their_dtype():
    res = run_threads(_rank, 2, None)
    assert res[0] == res[1]
    (w0, b0, w1, b1) = res[0]
    assert w0 == (torch.float32, [1.0 + 2.0] * 6)
    assert b0 == (torch.float32, [2.0] * 3)  # rank 1 had none: it added zeros and received the sum
    assert w1 == (torch.bfloat16, [(1 + 2) + (2 + 2)] * 3)
    assert b1 == (torch.bfloat16, [(1 + 3) + (2 + 3)])


def _fp64_rank(rank, group):
    p = torch.nn.Parameter(torch.zeros(1, dtype=torch.float64))
    p.grad = torch.tensor([1.0 + 2.0**-40 if rank == 0 else 1.0], dtype=torch.float64)
    allreduce_grads([p], group)
    return p.grad.item()


def test_fp64_gradients_travel_in_fp64():
    assert run_threads(_fp64_rank, 2) == [2.0 + 2.0**-40] * 2  # fp32 would round the 2**-40 away


def test_only_owned_parameters_contribute_and_receive():
    res = run_threads(_rank, 2, [{0, 1}, {0, 2, 3}])
    assert res[0][0] == res[1][0] == (torch.float32, [3.0] * 6)  # owned by both
    assert res[0][1] == (torch.float32, [2.0] * 3) and res[1][1] is None  # rank 1 does not own it
    assert res[0][2] is None and res[1][2] == (torch.bfloat16, [4.0] * 3)  # rank 0 added zeros
    assert res[0][3] is None and res[1][3] == (torch.bfloat16, [5.0])
