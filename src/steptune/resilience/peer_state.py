"""Recovery without a per-step copy of the model: after a peer's death the survivors take the state of
the step to resume from from a survivor that holds it (``Elastic.track``'s default, ``restore="peer"``).

Contract. ``PeerState`` copies nothing big at a step's start. It keeps the sum of the parameters' version
counters (an in-place write bumps one), counts each tracked optimizer's ``step`` calls (pre and post hooks,
which also check the version sum), and clones only the modules' buffers (batch norm updates its running
statistics inside its kernel without bumping their version) and the ``state_dict`` of tracked objects that are
neither modules nor optimizers (LR schedulers: small). When an attempt fails, each survivor knows where it
stands:

- ``EXACT``: no parameter was written; restoring the buffers (and small objects) gives the step's start.
- ``STEPPED``: every tracked optimizer stepped once (the gradients summed), nothing else wrote the
  parameters, and a collective after that failed: its state is the end of the step. What ran after the
  optimizer steps is not rerun, with one exception: a tracked LR scheduler that stepped exactly once in
  the previous step and has not stepped in this one (its ``step()`` was behind the failed collective) is
  stepped once, so it does not stay one step behind (``completed`` names it). Without that evidence (a
  failure in the first step seen, or a scheduler stepped per epoch) it is left as it is, and so is
  ``ReduceLROnPlateau``, whose step needs the user's metric.
- ``DIRTY``: parameters were written otherwise (checked before and after each optimizer step), or only
  some tracked optimizers stepped; this rank's state is of no use.

Writes through ``.data`` bump no version counter and are not seen: write parameters under
``torch.no_grad()``.

``settle`` gathers the survivors' standings in one all-reduce and resumes from the highest step any usable
survivor holds (a survivor can be one step ahead: that step's all-reduce completed on it and failed on
another). The source is the lowest such rank, an ``EXACT`` one first; every rank that does not already hold
that state receives the source's ``state_dict``\\s, sent to it alone in ``CHUNK_BYTES`` messages and loaded
once all of it arrived (the serialized state and one received copy are the only extra memory, during a
recovery only). A rank brought forward does not rerun the step it missed: its per-step records lack it
(``Elastic.recoveries`` says which). The snapshot mode (``recovery.Snapshots``: two deep copies kept, with
AdamW about 6x the parameters' memory, and a copy each step) rolls everyone back instead, which also undoes
writes of any kind.
"""

from __future__ import annotations

import copy
import io
from typing import Any

import torch
from torch import nn

from steptune.resilience.recovery import tensor_bytes

__all__ = ["CHUNK_BYTES", "DIRTY", "EXACT", "STEPPED", "PeerState", "SettleFailed", "StateLost"]

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
        pre = [opt.register_step_pre_hook(lambda *_: self._before_step()) for opt in self._opts]
        post = [o.register_step_post_hook(lambda *_, i=i: self._stepped(i)) for i, o in enumerate(self._opts)]
        self._hooks = pre + post
        self._expect = 0  # the version sum the parameters should have: at the start, or after the last step
        self._dirty = False  # written outside an optimizer step
        self._start: tuple[int, list[list[torch.Tensor]], list[Any]] | None = None
        lrs = torch.optim.lr_scheduler  # ReduceLROnPlateau's step needs the metric, which only the user has
        self._scheds = [
            o
            for o in self._others
            if isinstance(o, lrs.LRScheduler) and not isinstance(o, lrs.ReduceLROnPlateau)
        ]
        self._epochs: list[int | None] = []  # each scheduler's epoch at the recorded start
        self._per_step = [False] * len(self._scheds)  # stepped exactly once in the last whole step
        self.completed: list[str] = []
        """The schedulers the last ``settle`` stepped for a ``STEPPED`` step (see the module doc)."""

    def close(self) -> None:
        """Remove the optimizer hooks (``Elastic.track`` called again replaces this state)."""
        for h in self._hooks:
            h.remove()
        self._hooks = []

    def _before_step(self) -> None:
        if self._start is not None and self._versions() != self._expect:
            self._dirty = True

    def _stepped(self, i: int) -> None:
        self._steps[i] += 1
        self._expect = self._versions()

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
        self._expect, self._dirty = self._versions(), False
        epochs = [_epoch(s) for s in self._scheds]
        if self._start is not None and self._start[0] < step:  # the step (or window) before ended whole
            pairs = zip(epochs, self._epochs, strict=True)
            self._per_step = [now is not None and then is not None and now - then == 1 for now, then in pairs]
        self._start, self._epochs = (step, buffers, others), epochs

    def held_bytes(self) -> int:
        """Bytes of the tensors kept between steps (the buffers' clones, the small objects' state)."""
        return tensor_bytes(self._start)

    def rebaseline(self) -> None:
        """Writes that left every value as it was (DDP's broadcast of the parameters when it is built) do
        not make this rank's state unusable."""
        self._expect = self._versions()

    def standing(self, current: int | None = None) -> tuple[int, int]:
        """``(step, quality)``: the step whose start (``EXACT``: the recorded start) or end (``STEPPED``,
        then ``current + 1`` is returned) this rank holds, or its step and ``DIRTY``. ``current``: the step
        that failed (default: the recorded start; later when the start is a window of gradient
        accumulation's first step). ``STEPPED`` needs every tracked optimizer to have stepped once and
        nothing else to have written the parameters, before or after."""
        assert self._start is not None
        step = self._start[0]
        if self._dirty or self._versions() != self._expect:
            return step, DIRTY
        if not any(self._steps):
            return step, EXACT
        end = step if current is None else current
        return (end + 1, STEPPED) if all(n == 1 for n in self._steps) else (step, DIRTY)

    def restore_start(self) -> None:
        """Buffers and small objects back to the recorded start (parameters were not written)."""
        assert self._start is not None
        _, buffers, others = self._start
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
        when no survivor holds a usable state, ``SettleFailed`` when a collective fails (a death); an
        error loading the received state is raised as it is (not a death)."""
        rows = torch.zeros(world, 2, dtype=torch.float64)
        rows[rank] = torch.tensor(standing, dtype=torch.float64)
        _comm(lambda: group.allreduce([rows]).wait())
        stands = [(int(e), int(q)) for e, q in rows.tolist()]
        usable = [(e, q, r) for r, (e, q) in enumerate(stands) if q != DIRTY]
        if not usable:
            raise StateLost(
                f"no survivor holds a usable state of step {stands[rank][0]}: each wrote its parameters "
                "outside an optimizer step, or stepped some of its tracked optimizers but not all, before a "
                "collective failed; with ctx.track(..., restore='snapshot') every step's start is copied "
                "and can be restored"
            )
        resume = max(e for e, _, _ in usable)
        best = max(q for e, q, _ in usable if e == resume)
        source = min(r for e, q, r in usable if (e, q) == (resume, best))
        if standing[1] == EXACT and self._start is not None:
            self.restore_start()  # the failed attempt's forward may have moved buffers
        self.completed = self._complete_schedulers() if standing[1] == STEPPED else []
        needy = [r for r, s in enumerate(stands) if s != (resume, EXACT) and r != source]
        if rank == source:
            self._send(group, needy)
        elif rank in needy:
            payload = self._receive(group, source)
            states = torch.load(io.BytesIO(payload), map_location="cpu", weights_only=False)
            for o, state in zip(self._objs, states, strict=True):
                o.load_state_dict(state)
        self.take(resume)
        return resume, (source if needy else None)

    def _complete_schedulers(self) -> list[str]:
        """Step each scheduler that steps once per step and has not in this ``STEPPED`` step."""
        done = []
        for sched, epoch, per_step in zip(self._scheds, self._epochs, self._per_step, strict=True):
            if per_step and _epoch(sched) == epoch:
                sched.step()
                done.append(type(sched).__name__)
        return done

    def _send(self, group: Any, needy: list[int]) -> None:
        if not needy:
            return
        buf = io.BytesIO()
        torch.save([o.state_dict() for o in self._objs], buf)
        data = torch.frombuffer(buf.getbuffer(), dtype=torch.uint8)
        size = torch.tensor([data.numel()], dtype=torch.int64)
        for dst in needy:  # in chunks: each gloo operation has the group's timeout
            _comm(lambda dst=dst: group.send([size], dst, 0).wait())
            for i, off in enumerate(range(0, data.numel(), CHUNK_BYTES)):
                chunk = data[off : off + CHUNK_BYTES]
                _comm(lambda dst=dst, chunk=chunk, i=i: group.send([chunk], dst, 1 + i).wait())
        del data  # the view pins buf's memory

    @staticmethod
    def _receive(group: Any, source: int) -> memoryview:
        size = torch.zeros(1, dtype=torch.int64)
        _comm(lambda: group.recv([size], source, 0).wait())
        data = torch.empty(int(size.item()), dtype=torch.uint8)
        for i, off in enumerate(range(0, data.numel(), CHUNK_BYTES)):
            chunk = data[off : off + CHUNK_BYTES]
            _comm(lambda chunk=chunk, i=i: group.recv([chunk], source, 1 + i).wait())
        return memoryview(data.numpy().data)


CHUNK_BYTES = 64 << 20
"""Bytes per message of a state copy (each gloo operation waits at most the group's timeout)."""


def _epoch(sched: Any) -> int | None:
    """A scheduler's step count: ``last_epoch``, or its parts' common one (``ChainedScheduler`` has none of
    its own), else None (not known: never stepped for the user)."""
    epoch = getattr(sched, "last_epoch", None)
    if isinstance(epoch, int):
        return epoch
    parts = {_epoch(s) for s in getattr(sched, "_schedulers", [])}
    return parts.pop() if len(parts) == 1 else None


class SettleFailed(RuntimeError):
    """A collective of ``settle`` failed: a survivor died (the caller rejoins the next generation)."""


def _comm(op: Any) -> None:
    try:
        op()
    except RuntimeError as err:
        raise SettleFailed(str(err)) from None  # no chained traceback holding the group's frames
