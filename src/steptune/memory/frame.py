"""One block call under TapeSAC: the pack/unpack handles and the lazy replay behind them.

Contract: a :class:`Frame` lives as long as autograd holds one of its handles. It owns strong
references to the externals the replay reads (block inputs, parameters) and to saved values;
replayed values are held only until backward unpacks them. One backward per forward: a handle
unpacked twice raises :class:`TapeSACError` (like torch's selective checkpointing).
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from typing import Any

import torch

from steptune.memory.replay import ReplayPlan, plan_replay, run_replay
from steptune.memory.tape import Tape, TapeSACError, ValueKey

__all__ = ["Frame", "Handle", "ReplayStats"]


@dataclass(slots=True)
class ReplayStats:
    """Counters over every block of a model since :func:`apply_tapesac_` (or ``reset()``)."""

    forwards: int = 0
    recorded: int = 0
    """Forwards that ran under the recording mode (the rest reused a tape)."""
    replays: int = 0
    replayed_ops: int = 0
    replayed_flops: int = 0
    record_s: float = 0.0
    replay_s: float = 0.0
    force_saved: Counter[str] = field(default_factory=Counter)

    def reset(self) -> None:
        self.forwards = self.recorded = self.replays = self.replayed_ops = self.replayed_flops = 0
        self.record_s = self.replay_s = 0.0
        self.force_saved.clear()


@dataclass(slots=True)
class Handle:
    frame: Frame
    key: ValueKey
    used: bool = False


class Frame:
    def __init__(self, name: str, stats: ReplayStats) -> None:
        self.name = name
        self.stats = stats
        self.tape: Tape | None = None
        self.plan: ReplayPlan | None = None
        self.externals: dict[int, torch.Tensor] = {}
        self.saved: dict[ValueKey, torch.Tensor] = {}
        self.versions: dict[int, int] = {}
        self.pending: Counter[ValueKey] = Counter()
        self.results: dict[ValueKey, torch.Tensor] | None = None
        self.stale: dict[ValueKey, int] = {}  # packed values written in place later in the forward

    def handle(self, key: ValueKey) -> Handle:
        self.pending[key] += 1
        return Handle(self, key)

    def close(self, tape: Tape, plan: ReplayPlan | None, externals: Mapping[int, torch.Tensor]) -> None:
        """Called at the end of the block's forward."""
        self.tape = tape
        kept = dict(self.saved)  # packed values a save plan keeps (set by the pack hook)
        self.plan = plan if plan is not None else plan_replay(tape, set(tape.captured) | set(kept))
        if len(self.pending) != len(self.plan.packed):
            raise TapeSACError(
                f"TapeSAC block {self.name!r}: backward will read {len(self.pending)} replayed values "
                f"but its tape records {len(self.plan.packed)}; the tape does not match this forward"
            )
        # Autograd checks a saved tensor's version when it unpacks it, except under saved-tensor hooks (ours):
        # a value written in place after it was packed must fail here as it does without TapeSAC, where
        # replay would hand backward the newer value and wrong gradients.
        for key in self.pending:
            if key in tape.stale:
                self.stale[key] = tape.group_version[tape.slots[key[0]].group]
        self.externals = {sid: externals[sid] for sid in _external_reads(tape, self.plan)}
        self.versions = {sid: t._version for sid, t in self.externals.items()}
        self.saved = {key: tape.captured[key] for key in self.plan.reads_saved if key in tape.captured}
        self.saved.update(kept)
        for key in self.pending:
            if key in tape.captured:
                self.saved[key] = tape.captured[key]
        # Hold only what backward reads: captured values it never reads (a save policy's choices that
        # backward does not consume) are freed with the recorder, not kept until backward.
        self.tape = replace(tape, captured={})

    def unpack(self, handle: Handle) -> torch.Tensor:
        if handle.used:
            raise TapeSACError(
                f"a second backward reached TapeSAC block {self.name!r}: TapeSAC supports one "
                "backward per forward (replayed values are freed once backward reads them); run "
                "the forward again, or remove TapeSAC for double backward / retain_graph=True"
            )
        handle.used = True
        if handle.key in self.stale:
            raise RuntimeError(
                "one of the variables needed for gradient computation has been modified by an inplace "
                f"operation: a value of TapeSAC block {self.name!r} was saved for backward at version "
                f"{handle.key[1]} and written in place to version {self.stale[handle.key]} later in the "
                "block's forward (training without TapeSAC raises this too). Clone it before the in-place "
                "op, or make the op out of place"
            )
        if self.results is None:
            self._materialize()
        assert self.results is not None
        value = self.results[handle.key]
        self.pending[handle.key] -= 1
        if self.pending[handle.key] == 0:
            del self.results[handle.key]
        return value

    def _materialize(self) -> None:
        if self.tape is None or self.plan is None:
            raise TapeSACError(
                f"TapeSAC block {self.name!r} ran backward before its forward finished (torch.autograd.grad "
                "inside its forward, as a force field's or a gradient penalty's does): TapeSAC replays a "
                "block once its forward is recorded; leave this block out (TapeSACConfig(blocks=...))"
            )
        for sid, tensor in self.externals.items():
            ext = self.tape.slots[sid].external
            assert ext is not None
            if tensor._version != self.versions[sid]:
                what = f"argument {ext.index}" if ext.kind == "arg" else (ext.name or "a captured tensor")
                raise TapeSACError(
                    f"{what} of TapeSAC block {self.name!r} (shape {tuple(tensor.shape)}) was modified "
                    "in place between forward and backward; replay would read the new value. Clone "
                    "it before modifying, or modify it after backward"
                )
        start = time.perf_counter()
        values = run_replay(self.tape, self.plan, self.externals, self.saved)
        self.stats.replay_s += time.perf_counter() - start
        self.stats.replays += 1
        self.stats.replayed_ops += self.plan.num_ops
        self.stats.replayed_flops += self.plan.flops
        self.results = {key: values[key] for key in self.pending if self.pending[key] > 0}
        self.externals = {}
        self.saved = {}


def _external_reads(tape: Tape, plan: ReplayPlan) -> set[int]:
    out: set[int] = set()
    for n in plan.order:
        for sid, _ in tape.nodes[n].reads:
            if tape.slots[sid].producer == -1:
                out.add(sid)
    return out


def pack_hook(frame: Frame, key: ValueKey | None, t: torch.Tensor, keep: bool = False) -> Any:
    """Autograd's pack: externals are kept as they are; an internal value becomes a handle, and a
    value the save plan keeps is also held by the frame (once, however often it is packed)."""
    if key is None:
        return t
    if keep:
        frame.saved[key] = t
    return frame.handle(key)


def unpack_hook(obj: Any) -> torch.Tensor:
    return obj.frame.unpack(obj) if isinstance(obj, Handle) else obj
