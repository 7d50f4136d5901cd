"""One rank's side of fail-stop recovery: rejoin the survivors, roll back, copy state under a commit.

Contract (the store protocol; the launcher side is ``failstop.run_failstop``). The launcher owns the
``TCPStore``. After a failed collective a rank publishes ``alive/<gen>/<rank>`` (its step) and waits for
``members/<gen>``, the launcher's list of the survivors for generation ``gen``. Every listed member
announces itself before any builds the group ``gen<gen>``; whether a generation forms or is superseded by
the next list (one more death) is decided once, by the first rank to look (``fate/<gen>``), so survivors
never split across generations. The new group then agrees, in one all-reduce, on the step to resume from
(the lowest any survivor was at) and on the layout epoch (the highest any survivor committed). State
copies between survivors (PP stages, TP shards) end with ``commit``, an all-reduce every survivor must
reach; ``Recovery`` keeps a rank's epoch and pending layout across recoveries. ``Snapshots`` holds the
safe points (the start of the current step and the one before).

Fault injection (``spec`` keys, see ``injected``) lets tests place a death at each point of this protocol.
"""

from __future__ import annotations

import copy
import datetime
import json
import os
import signal
import time
from typing import Any, NamedTuple

import torch
import torch.distributed as dist
from torch import nn
from torch.utils._pytree import tree_leaves

from steptune.core.dist import LOOPBACK, LostGroups, new_gloo_group

__all__ = [
    "CommitFailed",
    "Recovery",
    "Rejoined",
    "Snapshots",
    "adopt_pending",
    "commit",
    "injected",
    "rejoin",
    "tensor_bytes",
]


def injected(spec: dict[str, Any], what: str, orig: int, when: int) -> bool:
    """Whether ``spec[what]`` ([[rank, generation or step], ...]) injects a fault into rank ``orig`` at
    ``when``: during the recovery to a generation, ``recovery_kills`` as it rejoins, ``copy_kills`` as it
    copies state (PP, TP), ``commit_kills`` and ``commit_misses`` in the commit that ends the copy (see
    ``commit``); in a step, ``sync_kills`` and ``sync_misses`` (see ``split_sync``)."""
    return [orig, when] in spec.get(what, [])


class Rejoined(NamedTuple):
    """What the survivors agreed on in ``rejoin``."""

    members: list[int]  # by original rank, in group-rank order
    group: Any
    resume: int  # the step to resume from: the lowest one any survivor was at
    generation: int
    epoch: int  # the highest layout epoch any survivor committed (see ``commit``)


def tensor_bytes(obj: Any) -> int:
    """Bytes of the distinct tensors in ``obj`` and the dicts, lists and tuples inside it."""
    tensors = {id(x): x for x in tree_leaves(obj) if isinstance(x, torch.Tensor)}
    return sum(t.numel() * t.element_size() for t in tensors.values())


class Snapshots:
    """The state (``state_dict``) of modules and optimizers at the start of the current step and of the one
    before. A survivor can be one step ahead of the others: that step's all-reduce completed on it but
    failed on another survivor (a death inside it, see ``split_sync``). It then goes back to the step the
    survivors agreed to resume from (``restore``)."""

    def __init__(self, *stateful: Any) -> None:
        self._objs = list(stateful)
        self._kept: dict[int, list[Any]] = {}

    def take(self, step: int) -> None:
        """At the start of ``step`` (the last start taken before is kept too: the step before, or the first
        step of a window of gradient accumulation)."""
        before = max((k for k in self._kept if k < step), default=None)
        self._kept = {k: v for k, v in self._kept.items() if k == before}
        self._kept[step] = [copy.deepcopy(o.state_dict()) for o in self._objs]

    def restore(self, step: int, orig: int) -> None:
        if step not in self._kept:
            raise RuntimeError(
                f"rank {orig}: the survivors resume from step {step}, and this rank holds the start of steps "
                f"{sorted(self._kept)} only"
            )
        for o, state in zip(self._objs, self._kept[step], strict=True):
            o.load_state_dict(state)

    @property
    def taken(self) -> bool:
        """Whether any step's start is held."""
        return bool(self._kept)

    def clear(self) -> None:
        """After a recovery that moved state (the copies are older than it); the next ``take`` refills."""
        self._kept = {}

    def held_bytes(self) -> int:
        """Bytes of the tensors kept between steps (the copies of the starts kept)."""
        return tensor_bytes(self._kept)

    def zero_grad(self) -> None:
        """Drop the gradients of the modules and optimizers (an abandoned step's partial ones)."""
        for o in self._objs:
            if isinstance(o, nn.Module):
                for prm in o.parameters():
                    prm.grad = None
            elif hasattr(o, "zero_grad"):
                o.zero_grad(set_to_none=True)


def rejoin(
    store: Any, orig: int, gen: int, step: int, timeout: datetime.timedelta, *, epoch: int = 0,
    die: bool = False, host: str = LOOPBACK, hang_s: float | None = None,
) -> Rejoined:  # fmt: skip
    """After a failed collective: announce this rank alive for generation ``gen``, wait for the launcher's
    member list, build the survivors' group and agree on the step to resume from (the lowest one any
    survivor was at) and on the layout epoch (the highest one any survivor committed: ``epoch`` is this
    rank's count of committed state copies). A member that dies during this (a second failure in the
    recovery window) never announces itself, or breaks the new group; the launcher then lists the survivors
    again as generation ``gen + 1`` and this rank joins that one. ``die``: SIGKILL this rank first (fault
    injection: a death during recovery). ``host``: the address this rank's gloo device binds to. ``hang_s``:
    the launcher's patience with a silent rank (``failstop.Coordinator``); this rank waits longer for it."""
    if die:  # once the launcher has listed this rank among the survivors: the others must supersede it
        store.wait([f"members/{gen}"], datetime.timedelta(seconds=60))
        os.kill(os.getpid(), signal.SIGKILL)
    lost = LostGroups()
    while True:
        try:
            members, group, resume, agreed = _join(store, orig, gen, step, epoch, timeout, host, lost, hang_s)
            return Rejoined(members, group, resume, gen, agreed)
        except (_Superseded, RuntimeError):  # RuntimeError: a member died after announcing itself
            pass
        lost.free()  # outside the except block, whose traceback holds the broken group: its sockets close
        gen += 1


class CommitFailed(RuntimeError):
    """``commit``'s all-reduce failed on this rank (not the copy before it)."""


def commit(group: Any, spec: dict[str, Any] | None = None, orig: int = -1, gen: int = -1) -> None:
    """End of a recovery's state copy: an all-reduce every survivor must reach. If one died during the
    copy it raises on every rank, so all of them keep the old layout and rejoin again, instead of some
    switching to a layout whose copies never arrived.

    A death inside the all-reduce itself can let it complete on some ranks and fail on others. Completing
    on one rank proves that every rank contributed, that is, finished its part of the copy, so the new
    layout is whole on every survivor. A rank whose commit failed (``CommitFailed``) therefore keeps the
    copied state as pending, and the next ``rejoin`` (whose epoch is the highest any survivor committed)
    tells it whether to adopt it (``adopt_pending``). Fault injection (``spec``, rank ``orig``, recovery
    generation ``gen``): ``commit_kills`` die once their commit completed, ``commit_misses`` see theirs
    fail although it completed; together they are the split outcome of a death inside the all-reduce."""
    try:
        group.allreduce([torch.zeros(1)]).wait()
    except RuntimeError as err:
        raise CommitFailed(str(err)) from err
    if spec is not None and injected(spec, "commit_kills", orig, gen):
        os.kill(os.getpid(), signal.SIGKILL)
    if spec is not None and injected(spec, "commit_misses", orig, gen):
        raise CommitFailed(f"rank {orig}: injected: the commit of generation {gen} is seen as failed")


def adopt_pending(agreed: int, epoch: int, pending: Any, orig: int, *, rolled_back: bool = False) -> bool:
    """After ``rejoin``: whether this rank, at layout epoch ``epoch`` with ``pending`` (the layout its last
    failed commit was for, or None), must adopt that layout because another survivor committed it
    (``agreed``). Raises when the epochs cannot be reconciled (a bug, not a fault), or when the rank has
    just ``rolled_back`` to a snapshot, which predates the copy. (Neither can happen: a committed rank
    cannot finish a step without the ranks whose commit failed.)"""
    if agreed == epoch:
        return False
    if agreed == epoch + 1 and pending is not None and not rolled_back:
        return True
    raise RuntimeError(
        f"rank {orig}: survivors committed layout epoch {agreed}, this rank is at {epoch}"
        f"{' with no pending layout' if pending is None else ''}: the recovery cannot continue consistently"
    )


class Recovery:
    """One rank's side of a fail-stop recovery: ``rejoin`` the survivors, roll back to the step they agreed
    on, adopt a layout whose commit completed on a peer only (``adopt_pending``); ``copy`` state from DP
    peers under a ``commit`` (PP, TP). Keeps this rank's layout ``epoch`` (committed copies) and
    ``pending`` layout (that of its last failed commit) across recoveries."""

    def __init__(
        self, store: Any, orig: int, spec: dict[str, Any], snapshots: Snapshots, timeout: datetime.timedelta
    ) -> None:
        self.store, self.orig, self.spec, self.snapshots, self.timeout = store, orig, spec, snapshots, timeout
        self.epoch = 0
        self.pending: Any = None

    def rejoin(
        self, gen: int, step: int, losses: dict[int, float]
    ) -> tuple[Rejoined, int, dict[int, float], Any]:
        """Rejoin as generation ``gen`` from ``step``: ``(joined, step, losses, adopted)``, where ``step`` and
        ``losses`` are rolled back to the agreed step and ``adopted`` is the pending layout a peer committed
        (None if none: keep the current one)."""
        joined = rejoin(
            self.store, self.orig, gen, step, self.timeout, epoch=self.epoch,
            die=injected(self.spec, "recovery_kills", self.orig, gen),
        )  # fmt: skip
        rolled_back = joined.resume != step
        if rolled_back:  # got further than a peer: back to the common safe point
            self.snapshots.restore(joined.resume, self.orig)
            step = joined.resume
            losses = {k: v for k, v in losses.items() if k < step}
        adopted = None
        if adopt_pending(joined.epoch, self.epoch, self.pending, self.orig, rolled_back=rolled_back):
            adopted, self.epoch = self.pending, joined.epoch
        self.pending = None
        return joined, step, losses, adopted

    def copy(self, group: Any, gen: int, new: Any, transfer: Any) -> bool:
        """Run ``transfer()`` (this rank's part of the copy to layout ``new``), then ``commit``. False when a
        survivor died during it: every rank keeps the old layout (``new`` is kept as pending when only the
        commit failed here: it may have completed on a peer)."""
        try:
            if injected(self.spec, "copy_kills", self.orig, gen):
                os.kill(os.getpid(), signal.SIGKILL)  # fault injection: a death during the copy
            transfer()
            commit(group, self.spec, self.orig, gen)
        except RuntimeError as err:
            if isinstance(err, CommitFailed):  # ... unless its commit completed elsewhere (see commit)
                self.pending = new
            return False
        self.epoch += 1
        return True


class NotListed(Exception):
    """The launcher's member list leaves this rank out (it was taken for lost): it must stop."""


class _Superseded(Exception):
    """The launcher listed the survivors again (another member died) before this generation formed."""


def _join(
    store: Any, orig: int, gen: int, step: int, epoch: int, timeout: datetime.timedelta, host: str,
    lost: LostGroups, hang_s: float | None = None,
) -> tuple[list[int], Any, int, int]:  # fmt: skip
    """One generation's rejoin. Store failures end the recovery (ConnectionError, TimeoutError: no retry
    can help); a RuntimeError means the new group broke (it is left in ``lost``), and the caller tries the
    next generation."""
    members = _listed(store, orig, gen, step, timeout, hang_s)
    group = new_gloo_group(
        store, members.index(orig), len(members), prefix=f"gen{gen}", timeout=timeout, host=host
    )
    done = torch.tensor([float(step), -float(epoch)])  # MIN of the step, MAX of the epoch
    opts = dist.AllreduceOptions()
    opts.reduceOp = dist.ReduceOp.MIN
    try:
        group.allreduce([done], opts).wait()
    except RuntimeError:
        lost.add(group)
        raise
    return members, group, int(done[0].item()), -int(done[1].item())


def _listed(
    store: Any, orig: int, gen: int, step: int, timeout: datetime.timedelta, hang_s: float | None = None
) -> list[int]:
    """The launcher's survivors for ``gen``, once every one of them has announced itself. Its waits outlast
    the launcher's patience with a silent rank (``hang_s``, default ``failstop.hang_seconds``), so that the
    launcher, not a timeout here, decides that a rank is hung."""
    patience = hang_s if hang_s is not None else max(10.0, 2 * timeout.total_seconds())
    try:
        store.set(f"alive/{gen}/{orig}", str(step))
        store.add(f"rejoining/{gen}", 1)  # the launcher's one-call test for "someone announced"
        list_s = max(60.0, patience + 30.0)
        try:
            store.wait([f"members/{gen}"], datetime.timedelta(seconds=list_s))
        except dist.DistStoreError as err:
            raise TimeoutError(
                f"rank {orig}: the launcher listed no survivors for generation {gen} within {list_s:g} s"
            ) from err
        members: list[int] = json.loads(store.get(f"members/{gen}").decode())
        if orig not in members:
            raise NotListed(
                f"rank {orig} is not among the survivors listed for generation {gen} ({members}): the "
                "launcher took it (or its host) for lost"
            )
        # Every listed member announces itself before anyone builds the group: one that died since the
        # list was written never does, and the launcher's next list supersedes this one within its poll.
        # Whether this generation forms or is superseded is one decision, the first rank's, kept in the
        # store: survivors that look at different moments must not split across generations.
        announced = [f"alive/{gen}/{m}" for m in members]
        fate_key = f"fate/{gen}"
        # Peers may reach this generation one group timeout late (a group that failed to form before).
        wait_s = max(2 * timeout.total_seconds(), patience) + 10
        deadline = time.monotonic() + wait_s
        while True:
            if store.check(announced):
                fate = store.compare_set(fate_key, "", "form")
            elif store.check([f"members/{gen + 1}"]):
                fate = store.compare_set(fate_key, "", "superseded")
            else:
                fate = store.get(fate_key) if store.check([fate_key]) else b""
            if fate == b"superseded":
                raise _Superseded
            if fate == b"form":
                break
            if time.monotonic() > deadline:
                missing = [m for m in members if not store.check([f"alive/{gen}/{m}"])]
                raise TimeoutError(
                    f"rank {orig}: survivors {missing} of generation {gen} did not rejoin within "
                    f"{wait_s:.0f} s, and the launcher reported no further death"
                )
            time.sleep(0.005)
    except (TimeoutError, _Superseded, NotListed):
        raise
    except RuntimeError as err:  # the store itself: the launcher is gone
        raise ConnectionError(f"rank {orig}: lost the launcher's store while rejoining: {err}") from err
    return members
