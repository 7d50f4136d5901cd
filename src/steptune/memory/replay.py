"""Replaying a tape's backward slice: only the producers of what backward reads.

Contract: the slice runs in tape order under ``no_grad`` with autocast off (the tape already holds
autocast's casts), without any Python module code. Each replayed object is dropped after its last
use in the slice unless backward still has to unpack it. Random ops run under the generator state
they consumed in forward; the caller's generator state is restored afterwards, so a backward with
replay leaves the RNG exactly where a backward without it would.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils._pytree import tree_flatten, tree_unflatten

from steptune.memory.tape import Tape, TapeSACError, ValueKey, _Ref, backward_slice

__all__ = ["ReplayPlan", "plan_replay", "run_replay"]


@dataclass(frozen=True, slots=True)
class ReplayPlan:
    """What to run for one tape; reusable across steps for a tape template."""

    order: tuple[int, ...]
    """Node indices to replay, in tape order."""
    last_use: dict[int, int]
    """Slot id -> position in ``order`` after which the replay drops it."""
    keep: frozenset[int]
    """Slots backward unpacks (never dropped by the replay)."""
    reads_saved: frozenset[ValueKey]
    packed: tuple[ValueKey, ...]
    """The internal values autograd packed (what the replay must return)."""
    num_ops: int
    flops: int


def plan_replay(tape: Tape, saved: set[ValueKey]) -> ReplayPlan:
    needed = tape.packed_internal()
    order, cut = backward_slice(tape, needed, saved)
    last_use: dict[int, int] = {}
    for pos, n in enumerate(order):
        for sid, _ in tape.nodes[n].reads:
            last_use[sid] = pos
        for _, sid in tape.nodes[n].outs:
            last_use.setdefault(sid, pos)
    return ReplayPlan(
        order=tuple(order),
        last_use=last_use,
        keep=frozenset(sid for sid, _ in needed),
        reads_saved=frozenset(cut),
        packed=tuple(needed),
        num_ops=len(order),
        flops=sum(tape.nodes[n].flops for n in order),
    )


def run_replay(
    tape: Tape,
    plan: ReplayPlan,
    externals: dict[int, torch.Tensor],
    saved: dict[ValueKey, torch.Tensor],
) -> dict[ValueKey, torch.Tensor]:
    """Run the slice; returns every packed internal value."""
    env: dict[int, torch.Tensor] = dict(externals)
    with torch.no_grad(), _autocast_off(), _rng_restored(tape, plan):
        for pos, n in enumerate(plan.order):
            node = tape.nodes[n]
            flat = [_resolve(a, env, saved) if isinstance(a, _Ref) else a for a in node.flat_args]
            args, kwargs = tree_unflatten(flat, node.spec)
            if node.random and node.rng_state is not None:
                _set_rng(node.rng_state)
            out = node.func(*args, **kwargs)
            flat_out = tree_flatten(out)[0]
            for out_pos, sid in node.outs:
                env[sid] = flat_out[out_pos]
            for sid, _ in node.reads:
                if plan.last_use.get(sid) == pos and sid not in plan.keep and sid not in externals:
                    env.pop(sid, None)
            for _, sid in node.outs:
                if plan.last_use.get(sid) == pos and sid not in plan.keep:
                    env.pop(sid, None)
    result: dict[ValueKey, torch.Tensor] = {}
    for key in plan.packed:
        if key in saved:
            result[key] = saved[key]
        elif key[0] in env:
            result[key] = env[key[0]]
        else:
            raise TapeSACError(f"internal: packed value {key} was not produced by the replay")
    return result


def _resolve(ref: _Ref, env: dict[int, torch.Tensor], saved: dict[ValueKey, torch.Tensor]) -> torch.Tensor:
    hit = saved.get((ref.sid, ref.version))
    if hit is not None:
        return hit
    try:
        return env[ref.sid]
    except KeyError:
        raise TapeSACError(f"internal: slot {ref.sid} read before it was replayed") from None


@contextlib.contextmanager
def _autocast_off() -> Iterator[None]:
    with contextlib.ExitStack() as stack:
        for device in ("cpu", "cuda"):
            if torch.is_autocast_enabled(device):
                stack.enter_context(torch.autocast(device, enabled=False))
        yield


@contextlib.contextmanager
def _rng_restored(tape: Tape, plan: ReplayPlan) -> Iterator[None]:
    devices = {tape.nodes[n].rng_state[0] for n in plan.order if tape.nodes[n].rng_state is not None}
    if not devices:
        yield
        return
    before = [(d, _get_rng(d)) for d in devices]
    try:
        yield
    finally:
        for device, state in before:
            _set_rng((device, state))


def _get_rng(device: torch.device) -> Any:
    return torch.cuda.get_rng_state(device) if device.type == "cuda" else torch.get_rng_state()


def _set_rng(snapshot: tuple[torch.device, Any]) -> None:
    device, state = snapshot
    if device.type == "cuda":
        torch.cuda.set_rng_state(state, device)
    else:
        torch.set_rng_state(state)
