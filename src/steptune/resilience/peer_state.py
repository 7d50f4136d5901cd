"""Recovery without a per-step copy of the model: after a peer's death the survivors take the state of
the step to resume from from a survivor that holds it (``Elastic.track``'s default, ``restore="peer"``).

Contract. ``PeerState`` copies nothing big at a step's start. It keeps the sum of the parameters' version
counters (any in-place write bumps one), counts each tracked optimizer's ``step`` calls (a post hook),
and clones only the modules' buffers (batch norm updates its running statistics inside its kernel
without bumping their version) and the ``state_dict`` of tracked objects that are neither modules nor
optimizers (LR schedulers: small). When an attempt fails, each survivor knows where it stands:

- ``EXACT``: no parameter was written; restoring the buffers (and small objects) gives the step's start.
- ``STEPPED``: every tracked optimizer stepped once the gradients were summed, and a collective after
  that failed: its state is the end of the step (what ran after the optimizer step is not rerun).
- ``DIRTY``: parameters were written otherwise; this rank's state is of no use.

``settle`` gathers the survivors' standings in one all-reduce and resumes from the highest step any
usable survivor holds (a survivor can be one step ahead: that step's all-reduce completed on it and
failed on another). The source is the lowest such rank, an ``EXACT`` one first; every rank that does not
already hold that state receives the source's ``state_dict``\\s in one gloo broadcast. A rank brought
forward does not rerun the step it missed: its per-step records lack it (``Elastic.recoveries`` says which).
The snapshot mode (``recovery.Snapshots``: two deep copies kept, with AdamW about 6x the parameters'
memory, and a copy each step) rolls everyone back instead, which also undoes writes of any kind.
"""

from __future__ import annotations

import copy
import io
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

__all__ = ["DIRTY", "EXACT", "STEPPED", "PeerState", "StateLost"]

DIRTY, STEPPED, EXACT = 0, 1, 2


class StateLost(RuntimeError):
    """No survivor holds a usable state of the step (every one wrote its parameters, not through a whole
    optimizer step, before the peer's death)."""


class PeerState:
    """The tracked modules, optimizers and other ``state_dict`` holders of one rank (see the module doc)."""

    def __init__(self, *objs: Any) -> None:
        self._objs = list(objs)
        self._modules = [o for o in objs if isinstance(o, nn.Module)]
        self._opts = [o for o in objs if isinstance(o, torch.optim.Optimizer)]
        self._others = [o for o in objs if not isinstance(o, nn.Module | torch.optim.Optimizer)]
        seen: dict[int, torch.Tensor] = {}
        for m in self._modules:
            seen.update((id(p), p) for p in m.parameters())
        for opt in self._opts:
            seen.update((id(p), p) for g in opt.param_groups for p in g["params"])
        self._params = list(seen.values())
        self._steps = [0] * len(self._opts)
        self._hooks = [
            opt.register_step_post_hook(lambda *_, i=i: self._count(i)) for i, opt in enumerate(self._opts)
        ]
        self._start: tuple[int, int, list[list[torch.Tensor]], list[Any]] | None = None

    def close(self) -> None:
        """Remove the optimizer hooks (``Elastic.track`` called again replaces this state)."""
        for h in self._hooks:
            h.remove()
        self._hooks = []

    def _count(self, i: int) -> None:
        self._steps[i] += 1

    def _versions(self) -> int:
        return sum(p._version for p in self._params)

    @property
    def taken(self) -> bool:
        """Whether a step's start is recorded."""
        return self._start is not None

    def take(self, step: int) -> None:
        """At the start of ``step``: the version baseline, the buffers, the small objects' state."""
        buffers = [[b.detach().clone() for b in m.buffers()] for m in self._modules]
        others = [copy.deepcopy(o.state_dict()) for o in self._others]
        self._steps = [0] * len(self._opts)
        self._start = (step, self._versions(), buffers, others)

    def rebaseline(self) -> None:
        """Writes that left every value as it was (DDP's broadcast of the parameters when it is built) do
        not make this rank's state unusable."""
        if self._start is not None:
            step, _, buffers, others = self._start
            self._start = (step, self._versions(), buffers, others)

    def standing(self) -> tuple[int, int]:
        """``(step, quality)``: the step whose start (``EXACT``) or end (``STEPPED``, then ``step + 1`` is
        returned) this rank holds, or its step and ``DIRTY``."""
        assert self._start is not None
        step, versions, _, _ = self._start
        if any(self._steps):
            return (step + 1, STEPPED) if all(n == 1 for n in self._steps) else (step, DIRTY)
        return (step, EXACT) if self._versions() == versions else (step, DIRTY)

    def restore_start(self) -> None:
        """Buffers and small objects back to the recorded start (parameters were not written)."""
        assert self._start is not None
        _, _, buffers, others = self._start
        with torch.no_grad():
            for m, saved in zip(self._modules, buffers, strict=True):
                for b, s in zip(m.buffers(), saved, strict=True):
                    b.copy_(s)
        for o, state in zip(self._others, others, strict=True):
            o.load_state_dict(copy.deepcopy(state))

    def zero_grad(self) -> None:
        """Drop the gradients (an abandoned step's partial ones)."""
        for p in self._params:
            p.grad = None

    def settle(self, group: Any, rank: int, world: int, standing: tuple[int, int]) -> tuple[int, int | None]:
        """Agree with the survivors (``group``) on the step to resume from and bring this rank's state to
        its start: ``(resume, source group rank or None when nobody needed a copy)``. Raises ``StateLost``
        when no survivor holds a usable state, ``RuntimeError`` when a collective fails (a death)."""
        rows = torch.zeros(world, 2, dtype=torch.float64)
        rows[rank] = torch.tensor(standing, dtype=torch.float64)
        group.allreduce([rows]).wait()
        stands = [(int(e), int(q)) for e, q in rows.tolist()]
        usable = [(e, q, r) for r, (e, q) in enumerate(stands) if q != DIRTY]
        if not usable:
            raise StateLost(
                f"no survivor holds a usable state of step {stands[rank][0]}: each wrote its parameters "
                "(not through one step of every tracked optimizer) before a collective failed; with "
                "ctx.track(..., restore='snapshot') every step's start is copied and can be restored"
            )
        resume = max(e for e, _, _ in usable)
        best = max(q for e, q, _ in usable if e == resume)
        source = min(r for e, q, r in usable if (e, q) == (resume, best))
        if standing[1] == EXACT and self._start is not None:
            self.restore_start()  # the failed attempt's forward may have moved buffers
        needy = [r for r, s in enumerate(stands) if s != (resume, EXACT) and r != source]
        if needy:
            self._broadcast(group, rank, source)
        self.take(resume)
        return resume, (source if needy else None)

    def _broadcast(self, group: Any, rank: int, source: int) -> None:
        opts = dist.BroadcastOptions()
        opts.rootRank = source
        payload = torch.empty(0, dtype=torch.uint8)
        if rank == source:
            buf = io.BytesIO()
            torch.save([o.state_dict() for o in self._objs], buf)
            payload = torch.frombuffer(bytearray(buf.getvalue()), dtype=torch.uint8)
        size = torch.tensor([payload.numel()], dtype=torch.int64)
        group.broadcast([size], opts).wait()
        if rank != source:
            payload = torch.empty(int(size.item()), dtype=torch.uint8)
        group.broadcast([payload], opts).wait()
        if rank != source:  # loaded only once all of it arrived: a death mid-way leaves the state as it was
            states = torch.load(io.BytesIO(payload.numpy().tobytes()), weights_only=False)
            for o, state in zip(self._objs, states, strict=True):
                o.load_state_dict(state)
