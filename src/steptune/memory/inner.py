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

__all__ = ["Flattened", "flattened_checkpoints"]


class Flattened:
    """How many checkpoint calls a ``flattened_checkpoints`` region ran as plain code."""

    def __init__(self) -> None:
        self.count = 0


_local = threading.local()
_lock = threading.Lock()
_users = 0
_original_generator: Any = None
_own_apply: Any = None  # CheckpointFunction's own ``apply``, if a torch version defines one


def _current() -> Flattened | None:
    stack: list[Flattened] = getattr(_local, "stack", [])
    return stack[-1] if stack else None


def _no_hooks(*args: Any, **kwargs: Any) -> Iterator[None]:
    yield  # checkpoint() runs the function between the two next() calls; nothing around it


def _generator(*args: Any, **kwargs: Any) -> Any:
    seen = _current()
    if seen is None:
        return _original_generator(*args, **kwargs)
    seen.count += 1
    return _no_hooks()


def _apply(cls: Any, function: Any, preserve_rng_state: bool, *args: Any) -> Any:
    seen = _current()
    if seen is None:  # torch's behaviour, through whatever Function.apply is now (the recorder patches it)
        apply = _own_apply if _own_apply is not None else torch.autograd.function.Function.apply
        return apply.__func__(cls, function, preserve_rng_state, *args)
    seen.count += 1
    return function(*args)


def _install() -> None:
    global _users, _original_generator, _own_apply
    with _lock:
        if _users == 0:
            _original_generator = _ckpt._checkpoint_without_reentrant_generator
            _own_apply = _ckpt.CheckpointFunction.__dict__.get("apply")
            _ckpt._checkpoint_without_reentrant_generator = _generator  # type: ignore[assignment]
            _ckpt.CheckpointFunction.apply = classmethod(_apply)  # type: ignore[assignment,method-assign]
        _users += 1


def _remove() -> None:
    global _users
    with _lock:
        _users -= 1
        if _users == 0:
            _ckpt._checkpoint_without_reentrant_generator = _original_generator
            if _own_apply is None:
                del _ckpt.CheckpointFunction.apply  # back to the inherited Function.apply
            else:
                _ckpt.CheckpointFunction.apply = _own_apply  # type: ignore[method-assign]


@contextmanager
def flattened_checkpoints() -> Iterator[Flattened]:
    """Inside: this thread's ``torch.utils.checkpoint.checkpoint`` calls run their function directly."""
    seen = Flattened()
    _install()
    stack: list[Flattened] = _local.__dict__.setdefault("stack", [])
    stack.append(seen)
    try:
        yield seen
    finally:
        stack.pop()
        _remove()
