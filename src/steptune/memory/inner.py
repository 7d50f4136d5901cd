"""torch's own checkpoint called inside a TapeSAC block, run as plain code.

TapeSAC recomputes what backward needs of the whole block, so a ``torch.utils.checkpoint.checkpoint`` call
inside the block's forward only adds a second recomputation of its region. While a block's forward runs
under ``flattened_checkpoints()``, both variants call their function directly: the non-reentrant one
without its saved-tensor hooks, the reentrant one without its ``autograd.Function`` (so the region's ops
are recorded and replayed like the block's others). Gradients are unchanged: the region computes the same
ops, and TapeSAC restores the RNG state of random ops it replays.

Both patches are process-wide (``torch.utils.checkpoint._checkpoint_without_reentrant_generator``, looked
up by ``checkpoint`` at each call, and ``CheckpointFunction.apply``), installed while any thread is inside
a block and refcounted; a thread outside a block gets torch's behaviour. A user's ``context_fn`` (torch's
selective checkpointing policy) is not applied in a flattened region: TapeSAC's own plan decides there.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
import torch.utils.checkpoint as _ckpt

from steptune.core.patching import MISSING, SharedPatch

__all__ = ["Flattened", "flattened_checkpoints"]


class Flattened:
    """How many checkpoint calls a ``flattened_checkpoints`` region ran as plain code."""

    def __init__(self) -> None:
        self.count = 0


_local = threading.local()


def _current() -> Flattened | None:
    stack: list[Flattened] = getattr(_local, "stack", [])
    return stack[-1] if stack else None


def _no_hooks(*args: Any, **kwargs: Any) -> Iterator[None]:
    yield  # checkpoint() runs the function between the two next() calls; nothing around it


def _generator(*args: Any, **kwargs: Any) -> Any:
    seen = _current()
    if seen is None:
        return _patch.original(_ckpt, "_checkpoint_without_reentrant_generator")(*args, **kwargs)
    seen.count += 1
    return _no_hooks()


def _apply(cls: Any, function: Any, preserve_rng_state: bool, *args: Any) -> Any:
    seen = _current()
    if seen is None:  # torch's behaviour, through whatever Function.apply is now (the recorder patches it)
        own = _patch.original(_ckpt.CheckpointFunction, "apply")
        apply = torch.autograd.function.Function.apply if own is MISSING else own
        return apply.__func__(cls, function, preserve_rng_state, *args)
    seen.count += 1
    return function(*args)


_patch = SharedPatch(
    lambda: [
        (_ckpt, "_checkpoint_without_reentrant_generator", _generator),
        (_ckpt.CheckpointFunction, "apply", classmethod(_apply)),
    ]
)


@contextmanager
def flattened_checkpoints() -> Iterator[Flattened]:
    """Inside: this thread's ``torch.utils.checkpoint.checkpoint`` calls run their function directly."""
    seen = Flattened()
    stack: list[Flattened] = _local.__dict__.setdefault("stack", [])
    with _patch.held():
        stack.append(seen)
        try:
            yield seen
        finally:
            stack.pop()
