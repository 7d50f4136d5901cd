"""``Elastic.ddp``: torch's ``DistributedDataParallel`` over the survivors of an ``elastic`` job.

    model = ctx.ddp(nn.Sequential(...))  # once, like DDP(model); ctx.track(model, opt) as usual
    while ctx.step < steps:
        with ctx.attempt():
            loss = loss_fn(model(x[list(ctx.shard(len(x)))]))
            loss.backward()  # DDP's bucketed all-reduce, overlapped with the backward
            opt.step()
            opt.zero_grad()

Contract. The wrapper builds a ``DistributedDataParallel`` on the current generation's gloo group (wrapped
as a ``ProcessGroup``, ``core.dist.as_process_group``; no default process group) at its first forward in
each generation, and drops it when a peer dies. Its gradient all-reduce is a DDP communication hook on
that group, which marks the attempt when a bucket's all-reduce fails: ``attempt`` then treats the
``RuntimeError`` that surfaces from ``backward`` as a peer's death (a ``RuntimeError`` with no failed
all-reduce behind it stays the user's). DDP's own collectives (the buffer broadcast in each forward, the
checks and broadcast when it is built) are marked when their error is gloo's. ``average=True`` divides
the summed gradients by ``ctx.world``, as DDP does; ``average=False`` keeps the sum, the convention of
``ctx.sync`` (scale each rank's loss by the global batch, and the update does not depend on the number
of survivors). Any other keyword goes to ``DistributedDataParallel`` (``bucket_cap_mb``,
``find_unused_parameters``, ``static_graph``, ...). ``register_comm_hook`` is ours; CPU (gloo) only.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from steptune.core.dist import as_process_group

if TYPE_CHECKING:
    from steptune.resilience.elastic import Elastic

__all__ = ["ElasticDDP"]

_REFUSED = ("process_group", "device_ids", "output_device", "device_mesh")


class _HookState:
    def __init__(self, ctx: Elastic, average: bool) -> None:
        self.ctx, self.average = ctx, average


def _allreduce(state: _HookState, bucket):  # type: ignore[no-untyped-def]
    """Sum one bucket over the survivors (divided by their number with ``average``); a failure marks the
    attempt, so that ``attempt`` takes the error out of ``backward`` for a peer's death. No annotations on
    ``bucket`` and the result: DDP compares them with its classes, and this module's are strings."""
    ctx, world = state.ctx, state.ctx.world
    try:
        work = ctx._group.allreduce([bucket.buffer()])
    except RuntimeError:
        ctx._comm_failed = True
        raise
    ctx._works.append(work)  # waited for before a lost group is freed (Elastic._recover)
    fut = work.get_future()

    def done(f: torch.futures.Future[list[torch.Tensor]]) -> torch.Tensor:
        try:
            out = f.value()[0]
        except Exception:
            ctx._comm_failed = True
            raise
        return out.div_(world) if state.average else out

    return fut.then(done)


class ElasticDDP(nn.Module):
    """``module`` under ``DistributedDataParallel`` on the current survivors (built by ``Elastic.ddp``)."""

    def __init__(
        self, ctx: Elastic, module: nn.Module, index: int, *, average: bool, **ddp_kwargs: Any
    ) -> None:
        super().__init__()
        refused = sorted(set(ddp_kwargs) & set(_REFUSED))
        if refused:
            raise ValueError(
                f"ctx.ddp: {refused} cannot be given: the group is the survivors' (it changes after a death) "
                "and the module stays on the CPU (gloo)"
            )
        self.module = module
        self._average, self._index, self._kwargs = average, index, ddp_kwargs
        object.__setattr__(self, "_ctx", ctx)  # not a submodule: the state_dict is the module's own
        object.__setattr__(self, "_ddp", None)
        self._built_for: tuple[int, int] | None = None  # (generation, id of its group)

    def _current(self) -> DistributedDataParallel:
        ctx = self._ctx
        group = ctx._group
        if group is None:
            raise RuntimeError(
                "ctx.ddp's module runs inside ctx.attempt(), which rejoins the survivors after a death first"
            )
        key = (ctx.generation, id(group))
        if self._ddp is None or self._built_for != key:
            self.drop()
            pg = as_process_group(
                group, ctx._store, ctx.rank, ctx.world, prefix=f"ddp{self._index}/gen{key[0]}"
            )
            try:
                ddp = DistributedDataParallel(self.module, process_group=pg, **self._kwargs)
            except RuntimeError as err:
                if "gloo" in str(err):  # its constructor's collectives (a parameter check, a broadcast)
                    ctx._comm_failed = True
                    ctx._rebaseline()  # buckets broadcast before the failure hold the values they had
                raise
            ctx._rebaseline()  # its broadcast of the parameters rewrote them with the values they had
            ddp.register_comm_hook(_HookState(ctx, self._average), _allreduce)
            object.__setattr__(self, "_ddp", ddp)
            self._built_for = key
        assert self._ddp is not None
        return self._ddp

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        ddp = self._current()
        try:
            return ddp(*args, **kwargs)
        except RuntimeError as err:
            if "gloo" in str(err):  # DDP's forward broadcasts the buffers (broadcast_buffers=True)
                self._ctx._comm_failed = True
            raise

    def no_sync(self) -> Any:
        """DDP's ``no_sync`` (gradient accumulation without an all-reduce)."""
        return self._current().no_sync()

    def drop(self) -> DistributedDataParallel | None:
        """Forget the DDP of a broken group (``attempt`` calls it when a peer dies); returns it, for the
        caller to free once the group's threads are idle (``LostGroups.free``)."""
        ddp = self._ddp
        object.__setattr__(self, "_ddp", None)
        self._built_for = None
        return ddp
