"""Small blocks that exercise each corner of the tape (dropout, in-place and views, opaque kernels,
host syncs, side effects), shared by the memory tests."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.distributed import all_reduce as _all_reduce  # bound before TapeSAC is ever applied
from torch.distributed import all_to_all_single as _all_to_all_single


class Chain(nn.Module):
    """Stacks ``num`` copies of a block between two linears, like a decoder stack."""

    def __init__(self, block: type[nn.Module], num: int = 2, width: int = 32) -> None:
        super().__init__()
        self.inp = nn.Linear(width, width)
        self.layers = nn.ModuleList(block(width) for _ in range(num))
        self.out = nn.Linear(width, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.inp(x)
        for layer in self.layers:
            h = layer(h)
        return self.out(h).square().mean()


class DropoutBlock(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(width, 2 * width), nn.Linear(2 * width, width)
        self.drop = nn.Dropout(0.3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.b(self.drop(torch.nn.functional.gelu(self.a(x))))


class InplaceViewBlock(nn.Module):
    """In-place writes through views, in-place activations, slices, transposes and copy_."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(width, width), nn.Linear(2 * width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.a(x)
        g = h * 1.0
        g.view(g.shape[0], 4, -1).transpose(1, 2).mul_(0.5)  # write through a transposed view
        g.relu_()
        s = g.sigmoid()
        half = g[:, : g.shape[1] // 2]
        mixed = torch.cat([half * s[:, : g.shape[1] // 2], g[:, g.shape[1] // 2 :]], dim=1)
        buf = torch.empty_like(mixed)
        buf.copy_(mixed * 2.0)
        buf.add_(h.tanh())
        return x + self.b(torch.cat([buf, g], dim=1))


class _NumpySquare(torch.autograd.Function):
    """Fills its output outside the dispatcher (through a numpy view), like a raw Triton launch."""

    @staticmethod
    def forward(ctx, x):  # type: ignore[no-untyped-def]
        out = torch.full_like(x, float("nan"))  # a replay of this allocation alone yields NaN
        out.detach().numpy()[...] = x.detach().numpy() ** 2
        ctx.save_for_backward(x)
        return out

    @staticmethod
    def backward(ctx, grad):  # type: ignore[no-untyped-def]
        (x,) = ctx.saved_tensors
        return 2 * x * grad


class OpaqueBlock(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(width, width), nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.b(_NumpySquare.apply(self.a(x)))


class SyncBlock(nn.Module):
    """Host syncs and data-dependent shapes: nonzero, boolean masking and ``.item()``."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(width, width), nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.a(x)
        rows = (h.sum(dim=1) > 0).nonzero().squeeze(1)
        scale = float(h.abs().max().item())
        picked = torch.zeros_like(h)
        picked[rows] = h[rows] / scale
        return x + self.b(picked.sigmoid())


class BatchNormBlock(nn.Module):
    """Batch norm in training updates running statistics: replaying it would update them twice."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(width, width), nn.Linear(width, width)
        self.norm = nn.BatchNorm1d(width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.b(torch.relu(self.norm(self.a(x))))


class GeneratorNoiseBlock(nn.Module):
    """Noise from the block's own generator: replay cannot rewind a generator it does not own."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(width, width), nn.Linear(width, width)
        self.generator = torch.Generator().manual_seed(7)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        noise = torch.rand(x.shape, generator=self.generator)
        return x + self.b(self.a(x) * noise)


class ToggleBlock(nn.Module):
    """Its ops depend on a Python flag that no tensor shape reveals."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.a = nn.Linear(width, width)
        self.extra = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.a(x).tanh()
        if self.extra:
            h = h.sigmoid()
        return x + h


class CollectiveBlock(nn.Module):
    """All-reduces a statistic across the group in forward (as a data-parallel norm would). ``how``: an eager
    collective called as ``dist.all_reduce``, under a name imported before TapeSAC was applied
    (``imported``), as the process group's own method (``method``), or an all-to-all into a new tensor under
    an imported name (``all_to_all``) or as the group's method (``all_to_all_method``), or an all-gather into
    two views of one buffer (``all_gather_views``), or a swap with the ring neighbour whose receive is
    posted before the send (``exchange``, as a halo exchange does); ``functional`` uses the functional
    collective instead."""

    def __init__(self, width: int, group: object = None, functional: bool = False, how: str = "dist") -> None:
        super().__init__()
        self.a, self.b = nn.Linear(width, width), nn.Linear(width, width)
        self.group = group
        self.functional = functional
        self.how = how

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        import torch.distributed as dist
        import torch.distributed._functional_collectives as funcol

        h = self.a(x)
        stat = h.detach().pow(2).mean(dim=0)
        if self.functional:  # an out-of-place aten-level op
            stat = funcol.wait_tensor(funcol.all_reduce(stat, "sum", self.group))
        elif self.how == "imported":
            _all_reduce(stat, group=self.group)
        elif self.how == "method":
            self.group.allreduce([stat]).wait()  # type: ignore[attr-defined]
        elif self.how == "all_to_all":  # as expert parallelism exchanges tokens: returns no tensor
            out = torch.empty_like(stat)
            _all_to_all_single(out, stat, group=self.group)
            stat = out
        elif self.how == "all_to_all_method":
            out = torch.empty_like(stat)
            self.group.alltoall_base(out, stat, [], []).wait()  # type: ignore[attr-defined]
            stat = out
        elif self.how == "exchange":  # every rank posts its receive first: no rank may block in it
            group: Any = self.group
            peer_from, peer_to = (group.rank() - 1) % group.size(), (group.rank() + 1) % group.size()
            got = torch.empty_like(stat)
            received = group.recv([got], peer_from, 7)
            sent = group.send([stat], peer_to, 7)
            received.wait()
            sent.wait()
            stat = stat + got
        elif self.how == "all_gather_views":  # one op writes two views of one buffer
            chunks = list(torch.empty(2 * stat.numel()).chunk(2))
            dist.all_gather(chunks, stat, group=self.group)
            stat = chunks[0] + chunks[1]
        else:  # eager c10d: its schema does not say it writes `stat`
            dist.all_reduce(stat, group=self.group)
        return x + self.b(h * stat.rsqrt())


class SyncedBufferBlock(nn.Module):
    """Reads a buffer, then all-reduces it in place (as a synchronized running statistic would): the value
    read before the collective must not be recomputed from the buffer's new value."""

    def __init__(self, width: int, group: object = None) -> None:
        super().__init__()
        self.a = nn.Linear(width, width)
        self.register_buffer("scale", torch.full((width,), 0.5))
        self.group = group

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        import torch.distributed as dist

        s = self.scale.exp()  # saved by the mul below, computed from the buffer before the collective
        h = self.a(x) * s
        dist.all_reduce(self.scale, group=self.group)
        return x + h


class DenseBlock(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(width, 4 * width), nn.Linear(4 * width, width)
        self.norm = nn.RMSNorm(width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.b(torch.nn.functional.silu(self.a(self.norm(x))))


class InnerCheckpointBlock(nn.Module):
    """Calls torch's checkpoint on part of its own forward (``reentrant`` and ``p`` set per test):
    the region has dropout when ``p > 0``, and a raw-kernel Function when ``opaque``."""

    reentrant = False
    p = 0.0
    opaque = False

    def __init__(self, width: int) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(width, 2 * width), nn.Linear(2 * width, width)
        self.q = nn.Linear(width, width)
        self.drop = nn.Dropout(self.p)

    def _region(self, h: torch.Tensor) -> torch.Tensor:
        u = torch.nn.functional.gelu(self.a(h))
        if self.opaque:
            u = _NumpySquare.apply(u)
        return self.b(self.drop(u))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        from torch.utils.checkpoint import checkpoint

        h = torch.tanh(self.q(x))
        m = checkpoint(self._region, h, use_reentrant=self.reentrant)
        return x + m * h
