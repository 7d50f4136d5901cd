"""Profiling for the planner: one block per signature, every op's measured replay time, every
storage's bytes, and the replay working set.

Contract: :func:`profile_model` runs one training step of ``model`` under replay-only TapeSAC
(recording every call) and keeps, for the first block of each signature, its tape and every
tensor it produced. Each replayable op is then re-run on those tensors (written arguments cloned
first, so the recorded values stay intact) ``warmup + repeats`` times; its cost is the median.
On CUDA the timing uses events; on CPU ``perf_counter``. Costs are wall time of the op as replay
runs it, Python dispatch included (a view costs microseconds, not zero).
"""

from __future__ import annotations

import contextlib
import statistics
import time
import warnings
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.utils._pytree import tree_unflatten

from steptune.memory.apply import TapeSACConfig, apply_tapesac_
from steptune.memory.record import Recorder
from steptune.memory.reuse import same_tape
from steptune.memory.tape import Tape, ValueKey, _Ref

__all__ = ["BlockProfile", "profile_model"]


@dataclass(frozen=True, slots=True)
class BlockProfile:
    """What the planner needs about one block signature."""

    signature: Any
    name: str
    """FQN of the profiled (first) block with this signature."""
    num_blocks: int
    tape: Tape
    """The recorded tape (externals and captured values stripped)."""
    cost_s: tuple[float, ...]
    """Measured replay time per node (0 for force-saved nodes, which never replay)."""
    group_bytes: dict[int, int]
    """Storage bytes per storage group."""
    input_bytes: int
    """Bytes of the block's tensor arguments a checkpointed block keeps (its input)."""
    names: tuple[str, ...] = ()
    """Every block with this signature, in forward order."""
    has_last: bool = False
    """The model's last block (the first one backward reaches) has this signature."""

    def pack_bytes(self, key: ValueKey) -> int:
        return self.group_bytes[self.tape.slots[key[0]].group]


@contextlib.contextmanager
def grads_kept(model: nn.Module) -> Iterator[None]:
    """The parameters' ``.grad`` as they were when done (planning in the middle of gradient accumulation
    must not lose it; found in a sweep on 2026-12-05)."""
    kept = [(p, p.grad) for p in model.parameters()]
    try:
        yield
    finally:
        for p, g in kept:
            p.grad = g


@contextlib.contextmanager
def _removed(handle: Any) -> Iterator[None]:
    try:
        yield
    finally:
        handle.remove()


def profile_model(
    model: nn.Module,
    batch: dict[str, torch.Tensor],
    *,
    blocks: Any = None,
    repeats: int = 3,
    warmup: int = 1,
) -> dict[Any, BlockProfile]:
    """Profile every block signature of ``model`` on ``batch`` (one forward+backward)."""
    seen: dict[Any, tuple[str, Tape, dict[int, torch.Tensor]]] = {}
    counts: dict[Any, int] = {}
    order: list[tuple[str, Any]] = []

    def on_record(name: str, key: Any, tape: Tape, recorder: Recorder) -> None:
        if key in seen and not same_tape(seen[key][1], tape):
            # a block of this signature whose ops differ (SmolLM3's layers without rotary embeddings): it is
            # profiled, and later planned, under its own name, since its packs are not the others'
            key = name
        counts[key] = counts.get(key, 0) + 1
        order.append((name, key))
        if key not in seen:
            seen[key] = (name, tape, dict(recorder.kept_outputs))
        recorder.kept_outputs.clear()

    handle = apply_tapesac_(model, TapeSACConfig(blocks=blocks, reuse_tapes=False))
    in_eval = [name for name, block in handle.blocks if not block.training]
    if in_eval:  # HF's from_pretrained returns a model in eval mode (found in a sweep)
        warnings.warn(
            f"profile_model: block(s) {in_eval[:3]}{' ...' if len(in_eval) > 3 else ''} are in eval mode: "
            "the training flag is part of a block's signature, so a plan made from these profiles has no "
            "entry for a training step (each block then replays everything). Call model.train() before "
            "profiling",
            stacklevel=2,
        )
    handle.on_record = on_record
    handle.keep_outputs = True
    with grads_kept(model), _removed(handle):
        model.zero_grad(set_to_none=True)
        out = model(**batch)
        (out.loss if hasattr(out, "loss") else out).backward()
    profiles: dict[Any, BlockProfile] = {}
    for key, (name, tape, tensors) in seen.items():
        cost = [_time_node(tape, n, tensors, repeats, warmup) for n in range(len(tape.nodes))]
        group_bytes: dict[int, int] = {}
        for sid, t in tensors.items():
            group_bytes[tape.slots[sid].group] = t.untyped_storage().nbytes()
        for slot in tape.slots:
            group_bytes.setdefault(slot.group, slot.nbytes)
        inputs = sum(s.nbytes for s in tape.slots if s.external is not None and s.external.kind == "arg")
        names = tuple(n for n, k in order if k == key)
        profiles[key] = BlockProfile(
            key,
            name,
            counts[key],
            _strip(tape),
            tuple(cost),
            group_bytes,
            inputs,
            names,
            order[-1][0] in names,
        )
    return profiles


def _strip(tape: Tape) -> Tape:
    from dataclasses import replace

    slots = [replace(s, external=replace(s.external, tensor=None)) if s.external else s for s in tape.slots]
    return replace(tape, slots=slots, captured={})


def _time_node(tape: Tape, n: int, tensors: dict[int, torch.Tensor], repeats: int, warmup: int) -> float:
    node = tape.nodes[n]
    if node.force_save is not None or not callable(node.func) or node.spec is None:
        return 0.0
    written = set(node.writes)

    def value(ref: _Ref) -> torch.Tensor:
        slot = tape.slots[ref.sid]
        t = (
            slot.external.tensor
            if slot.external is not None and slot.external.tensor is not None
            else tensors[ref.sid]
        )
        return t.clone() if slot.group in written else t

    cuda = any(isinstance(t, torch.Tensor) and t.is_cuda for t in tensors.values())
    times: list[float] = []
    with torch.no_grad():
        for i in range(warmup + repeats):
            flat = [value(a) if isinstance(a, _Ref) else a for a in node.flat_args]
            args, kwargs = tree_unflatten(flat, node.spec)
            if cuda:
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                node.func(*args, **kwargs)
                end.record()
                end.synchronize()
                elapsed = start.elapsed_time(end) / 1e3
            else:
                t0 = time.perf_counter()
                node.func(*args, **kwargs)
                elapsed = time.perf_counter() - t0
            if i >= warmup:
                times.append(elapsed)
    return statistics.median(times)
