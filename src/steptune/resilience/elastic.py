"""Fail-stop survival in your own data-parallel training loop: when a rank dies, the others rebuild their
gloo group among themselves and redo the interrupted step, without a restart.

    from steptune.resilience.elastic import Elastic, launch

    def train(ctx: Elastic, steps: int) -> dict[int, float]:
        torch.manual_seed(0)  # every rank builds the same model
        model = build_model()
        opt = torch.optim.AdamW(model.parameters())
        ctx.track(model, opt)  # what a recovery brings back (from a peer that holds it)
        losses = {}
        while ctx.step < steps:
            with ctx.attempt():  # a peer's death: the step is abandoned here and redone
                items = global_batch(ctx.step)  # the same global batch on every rank
                mine = ctx.shard(len(items))  # may be empty: fewer items than ranks
                loss = sum((loss_fn(model, items[i]) for i in mine), torch.zeros(()))
                if len(mine):  # by the global batch: the same update for any world
                    (loss / len(items)).backward()
                losses[ctx.step] = ctx.sync(model, loss)  # SUM of gradients and loss over the survivors
                opt.step()
                opt.zero_grad()
        return losses

    if __name__ == "__main__":  # spawn re-imports this file in every rank
        result = launch(train, 4, 100)  # 4 processes; train(ctx, 100) in each

Contract. ``launch`` keeps the ``TCPStore`` in the calling process, so it outlives any rank; it spawns the
ranks, sees a death, and lists the survivors (``failstop.run_failstop``). In a rank, a collective that fails
inside ``attempt`` (gloo raises ``RuntimeError`` within milliseconds of a peer's death) ends that attempt; the
next ``attempt`` rejoins the survivors (``recovery.rejoin``: a second death while rejoining is survived too),
and the survivors resume from the highest step any of them holds: one that got a step further than another
(that step's all-reduce completed on it only) sends its state to those behind (``peer_state``; nothing is
copied in a failure-free step). ``ctx.rank`` and ``ctx.world`` change then, so take each step's share from
them (``shard``). Scale each rank's loss by the global batch, not the share: the summed update is then the
same for any number of ranks, and the loss trajectory matches a failure-free run up to fp32 summation order.
Only what ``track`` was given is restored; keep per-step results keyed by ``ctx.step`` (a redone step
overwrites its entry; a rank brought a step forward does not rerun the step it missed, see ``recoveries``). DP
only: every rank holds the whole model; sharded state (FSDP, TP, PP) needs the copies of ``failstop_pipe`` /
``failstop_tp``. Collectives go through ``ctx`` (its own gloo group; there is no default process group):
``ctx.sync``, ``ctx.all_reduce``, or torch's DDP over the survivors with ``ctx.ddp(model)`` (``elastic_ddp``).
Parameters should change only through the tracked optimizers' ``step`` inside an attempt (a rank that wrote
them otherwise takes a peer's state, and if every survivor did, recovery stops with ``StateLost``);
``ctx.track(..., restore="snapshot")`` instead deep-copies the tracked state at each attempt and keeps two
copies (with AdamW about 6x the parameters' memory), and rolls back. A peer that is only slow past
``group_timeout_s`` makes its peers' collective fail, and its own once they drop the group: once every live
rank has announced itself, the launcher lists them all again and the step is redone by all. A death inside the
last step's sync can let it complete on some ranks, which return, and fail on others: the launcher then lists
the others alone and they redo that step. A death before the first group forms (a bad node at start-up) is
survived too: the ranks meet at a store barrier first (spawned ranks start seconds apart on a loaded host),
which ends when the launcher lists survivors; their first ``attempt`` then rejoins. Gradient accumulation
across attempts (backward in each, ``sync`` and the optimizer step every k-th, by ``ctx.step``) is exact
too: a recovery redoes the window from its first step. A rank that hangs instead of dying is killed by the
launcher once it stays silent ``hang_timeout_s`` while its peers rejoin, and survived like a death.
"""

from __future__ import annotations

import contextlib
import ctypes
import datetime
import math
import multiprocessing as mp
import os
import pickle
import signal
import sys
import time
import traceback
import weakref
import zlib
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch import nn

from steptune.core.dist import (
    LOOPBACK,
    LostGroups,
    cannot_pickle,
    connect_store,
    new_gloo_group,
    pack_grads,
    unpack_grads,
)
from steptune.resilience.failstop import finish, hang_seconds, run_failstop
from steptune.resilience.peer_state import EXACT, PeerState, SettleFailed
from steptune.resilience.recovery import NotListed, Snapshots, rejoin

__all__ = ["Elastic", "PeerLost", "launch", "lost_reason", "recovery_text", "toy_train"]


class PeerLost(RuntimeError):
    """A collective of ``Elastic`` failed: a peer died (``attempt`` recovers from it)."""


class Elastic:
    """One rank's view of the elastic job (built by ``launch``; passed to the training function)."""

    def __init__(
        self, store: Any, orig: int, members: list[int], *, timeout_s: float = 20.0, host: str = LOOPBACK,
        fence: str | None = None, hang_s: float | None = None,
    ) -> None:  # fmt: skip
        self.orig = orig  # the rank this process was started as; never changes
        self._host = host  # the address this rank's gloo device binds to
        self._fence = fence  # a store key set when this rank's host is taken for lost (elastic_nodes)
        self._fence_read = -math.inf  # when it was last read (at most once a second: one store round trip)
        self.members = list(members)  # surviving original ranks, in group-rank order
        self._step = 0
        self.generation = 0
        self.recoveries: list[dict[str, Any]] = []
        self._store = store
        self._timeout = datetime.timedelta(seconds=timeout_s)
        self._hang_s = hang_s  # the launcher's patience with a silent rank (recovery.rejoin waits longer)
        self._state: Snapshots | PeerState | None = None
        self._tracked: tuple[Any, ...] = ()
        self._params: list[torch.Tensor] = []  # the tracked modules' and optimizers' parameters
        self._taken: tuple[int, int] | None = None  # (step, parameters' version sum) of the state's last take
        self._restore = "peer"
        self._failed = False
        self._recovering = False
        self._synced = False  # ctx.sync ran in this attempt
        self._in_attempt = False  # inside ctx.attempt()
        self._comm_failed = False  # a ctx.ddp all-reduce failed in this attempt
        self._ddps: list[weakref.ref[Any]] = []
        self._works: list[Any] = []  # ctx.ddp's all-reduces in this attempt (waited for before freeing)
        self._lost = LostGroups()  # a lost group and its DDPs, freed by _recover once its threads are idle
        self._group: Any = None
        if not _all_started(store, orig, self.members):  # a peer died at start-up: rejoin right away
            self._failed = True
            return
        try:
            self._group = new_gloo_group(
                store, members.index(orig), len(members), prefix="gen0", timeout=self._timeout, host=host
            )
        except RuntimeError:  # a peer died before the first group formed: the first attempt rejoins
            self._failed = True

    @property
    def step(self) -> int:
        """The step to run next. After a failed attempt, reading it first rejoins the survivors (the step
        they resume from is known only then; it can be one further than the step that failed), so that
        ``while ctx.step < steps`` stops where it should."""
        if self._failed and self._state is not None and not self._recovering:
            self._recover()
        return self._step

    @property
    def rank(self) -> int:
        """This rank among the survivors (0..world-1)."""
        return self.members.index(self.orig)

    @property
    def world(self) -> int:
        return len(self.members)

    def track(self, *objs: Any, restore: str = "peer", replace: bool = False) -> None:
        """Modules, optimizers and anything else with ``state_dict``/``load_state_dict``: the state a
        recovery brings back. ``restore="peer"``: nothing big is copied per step; after a death the
        survivors resume from the highest step any of them holds, and those that lack it receive it from
        one that does (``peer_state``). ``restore="snapshot"``: every step's start is deep-copied (two
        kept) and restored, which also undoes writes other than optimizer steps (``recovery.Snapshots``).
        Calls add up (``track(model); track(opt)`` tracks both); ``replace=True`` tracks only ``objs``."""
        if restore not in ("peer", "snapshot"):
            raise ValueError(f"ctx.track: restore must be 'peer' or 'snapshot', got {restore!r}")
        if replace:
            self._tracked = ()
        elif self._state is not None and restore != self._restore:
            raise ValueError(
                f"ctx.track(restore={restore!r}) after ctx.track(restore={self._restore!r}): track "
                "everything with one restore mode (or pass replace=True)"
            )
        # Calls add up: ctx.track(model); ctx.track(opt) tracks both (the second used to replace the first,
        # so a recovery restored the optimizer but not the model)
        objs = (*self._tracked, *(o for o in objs if all(o is not t for t in self._tracked)))
        if isinstance(self._state, PeerState):
            self._state.close()
        self._state = Snapshots(*objs) if restore == "snapshot" else PeerState(*objs)
        self._tracked, self._restore, self._taken = objs, restore, None
        seen: dict[int, torch.Tensor] = {}
        for o in objs:
            if isinstance(o, nn.Module):
                seen.update((id(prm), prm) for prm in o.parameters())
            elif isinstance(o, torch.optim.Optimizer):
                seen.update((id(prm), prm) for g in o.param_groups for prm in g["params"])
        self._params = list(seen.values())

    @property
    def held_bytes(self) -> int:
        """Bytes of tensors a recovery keeps between steps: with ``restore="snapshot"`` two copies of the
        tracked state, with ``"peer"`` only the buffers' clones; 0 before ``track``."""
        return 0 if self._state is None else self._state.held_bytes()

    def shard(self, n: int) -> range:
        """This rank's share of ``n`` global items: every ``world``-th, from ``rank``."""
        return range(self.rank, n, self.world)

    def sync(self, model: nn.Module, loss: torch.Tensor | float | None = None) -> float:
        """All-reduce (SUM) ``model``'s gradients and ``loss`` over the survivors; returns the summed loss
        (0.0 without one). Gradients travel in fp32 (fp64 if a parameter is; one message) and come back in
        their own dtype. Raises
        ``PeerLost`` if a peer died (``attempt`` handles it)."""
        if not self._in_attempt:
            raise RuntimeError(
                "ctx.sync outside ctx.attempt(): call it inside `with ctx.attempt():` (one attempt per step, "
                "see the module docstring), which recovers from a peer's death and ends the step"
            )
        if self._synced:
            raise RuntimeError(
                "ctx.sync ran twice in one ctx.attempt(): the second would sum the summed gradients again "
                "(one sync per step; ctx.all_reduce for other tensors)"
            )
        self._synced = True
        params = [p for p in model.parameters() if p.requires_grad]
        value = float(loss.detach()) if isinstance(loss, torch.Tensor) else float(loss or 0.0)
        # The loss rides with a signature of the parameters' shapes: all ranks equal iff n * sum(h^2) ==
        # sum(h)^2 (exact in fp64 for h < 2^20). Gradients of other shapes would make gloo abort the
        # process, which the launcher took for a death: the odd rank "survived" alone.
        h = float(zlib.crc32(repr([tuple(p.shape) for p in params]).encode()) & 0xFFFFF)
        head = torch.tensor([value, h, h * h, 1.0], dtype=torch.float64)
        self._reduce(head)
        if head[3] * head[2] != head[1] * head[1]:
            raise RuntimeError(
                f"ctx.sync on rank {self.orig}, step {self._step}: the ranks' models have different "
                "parameter shapes (or a different number of parameters that require grad); every rank must "
                "pass the same model"
            )
        flat, keep = pack_grads(params)  # local work stays outside: its errors are not a peer's death
        dtype, device = flat.dtype, flat.device
        has = torch.tensor([float(p.grad is not None) for p in params], dtype=dtype, device=device)
        flat = self._reduce(torch.cat([flat, has]))  # which parameters got a gradient on some rank
        unpack_grads(params, flat[: flat.numel() - len(params)], keep)
        for p, n in zip(params, flat[flat.numel() - len(params) :].tolist(), strict=True):
            if n == 0:  # no rank computed one: None as in one process, so AdamW skips it
                p.grad = None
        return float(head[0])

    def ddp(self, module: nn.Module, *, average: bool = True, **ddp_kwargs: Any) -> nn.Module:
        """``module`` under torch's ``DistributedDataParallel`` over the survivors, rebuilt after each death
        (``elastic_ddp``): call it once, then use the result as the model; its backward all-reduces the
        gradients, so skip ``ctx.sync``. ``average``: divide the summed gradients by ``ctx.world`` (DDP's
        convention; False keeps ``ctx.sync``'s sum). Other keywords go to ``DistributedDataParallel``."""
        from steptune.resilience.elastic_ddp import ElasticDDP

        wrapper = ElasticDDP(self, module, len(self._ddps), average=average, **ddp_kwargs)
        self._ddps.append(weakref.ref(wrapper))
        return wrapper

    def all_reduce(self, tensor: torch.Tensor) -> torch.Tensor:
        """SUM ``tensor`` in place over the survivors (for metrics or your own synchronisation). Raises
        ``PeerLost`` if a peer died. The ranks first agree on the tensor's element count, dtype and device
        (one small all-reduce more): a tensor that differs across ranks, or that gloo cannot reduce (a
        meta tensor), raises ``ValueError`` on every rank, which stops the job. Before, gloo's error was
        taken for a peer's death and every step was recovered from again, silently."""
        if not isinstance(tensor, torch.Tensor):
            raise TypeError(f"ctx.all_reduce takes a torch.Tensor, got {type(tensor).__name__}")
        if tensor.device.type not in ("cpu", "cuda"):
            raise ValueError(
                f"ctx.all_reduce on rank {self.orig}, step {self._step}: a tensor on device "
                f"{tensor.device.type!r} cannot be reduced (gloo takes cpu and cuda tensors)"
            )
        what = (tensor.numel(), str(tensor.dtype), tensor.device.type, str(tensor.layout))
        h = float(zlib.crc32(repr(what).encode()) & 0xFFFFF)
        head = self._reduce(torch.tensor([h, h * h, 1.0], dtype=torch.float64))
        if head[2] * head[1] != head[0] * head[0]:  # all ranks equal iff n * sum(h^2) == sum(h)^2
            raise ValueError(
                f"ctx.all_reduce on rank {self.orig}, step {self._step}: the ranks passed tensors that "
                f"differ in element count, dtype, device or layout (here {what[0]} elements, {what[1]}, "
                f"{what[2]}, {what[3]}); every rank must pass the same kind of tensor (pad a per-rank "
                "share to a common size, e.g. a sum and a count)"
            )
        return self._reduce(tensor)

    def _reduce(self, tensor: torch.Tensor) -> torch.Tensor:
        """SUM ``tensor`` in place over the group, unchecked (``sync`` checks its own)."""
        if self._group is None:
            raise RuntimeError(
                "the group is gone after a peer's death: call ctx.sync / ctx.all_reduce inside "
                "ctx.attempt(), which rejoins the survivors first"
            )
        try:
            self._group.allreduce([tensor]).wait()
        except RuntimeError as err:
            raise PeerLost(str(err)) from None  # no chained traceback holding the group's frames
        return tensor

    @contextmanager
    def attempt(self) -> Iterator[None]:
        """One try of step ``self.step``: on success the step advances; a failed collective inside it
        (``PeerLost``) abandons the step (the exception is swallowed), and the next read of ``ctx.step``
        or the next ``attempt`` recovers first. Any other exception is yours and propagates."""
        if self._state is None:
            raise RuntimeError("call ctx.track(model, optimizer, ...) before the first ctx.attempt()")
        if self._fenced():
            # Its agent may be only stalled (SIGSTOP, swap) and unable to stop it: this rank stops itself,
            # so the survivors' next collective fails and they regroup as the launcher listed them.
            raise NotListed(
                f"rank {self.orig}: its host was taken for lost (node 0 heard no beat from its agent) and "
                "fenced; this rank stops so that the others go on without it"
            )
        if self._failed:
            self._recover()
        if not self._accumulating():
            self._state.take(self._step)
            self._taken = (self._step, self._versions())
        with contextlib.suppress(RuntimeError):  # for the launcher: inside an attempt of this step
            self._store.set(f"attempt/{self.orig}", str(self._step))
        self._synced = self._comm_failed = False
        self._works.clear()  # the last attempt's all-reduces, all complete (it succeeded)
        self._in_attempt = True
        try:
            yield
        except PeerLost:
            self._lose_group()
        except RuntimeError:
            if not self._comm_failed:  # the user's own error
                raise
            self._lose_group()  # a ctx.ddp all-reduce failed: it surfaces from backward as a RuntimeError
        else:
            self._step += 1
            # For the launcher: a rank past its peers' failed step is not hung when it stays silent.
            with contextlib.suppress(RuntimeError):  # a lost store shows at the next rejoin
                self._store.set(f"progress/{self.orig}", str(self._step))
        finally:
            self._in_attempt = False

    def _versions(self) -> int:
        return sum(prm._version for prm in self._params)  # an optimizer step (any in-place write) bumps one

    def _accumulating(self) -> bool:
        """Whether this attempt continues a window of gradient accumulation: attempts since the state's
        last take left gradients and wrote no parameter (no optimizer step). The take is then kept, so
        that a recovery redoes the window from its first step (its gradients are lost with the dead rank:
        only a redo over the survivors gives the same sum)."""
        return (
            self._taken is not None
            and self._versions() == self._taken[1]
            and any(prm.grad is not None for prm in self._params)
        )

    def _lose_group(self) -> None:
        # The broken group (and the DDPs on it) is kept in _lost, not freed here: recovery frees it in the
        # next attempt, outside this exception, whose traceback can hold frames that reach the group.
        ddps = [wrapper.drop() for wrapper in (ref() for ref in self._ddps) if wrapper is not None]
        self._lost.add(self._group, *ddps)
        self._group = None
        self._failed = True

    def _fenced(self) -> bool:
        if self._fence is None or time.monotonic() - self._fence_read < 1.0:
            return False
        self._fence_read = time.monotonic()
        return bool(self._store.check([self._fence]))

    def _recover(self) -> None:
        self._recovering = True
        try:
            self._rejoin_and_settle()
        finally:
            self._recovering = False

    def _rejoin_and_settle(self) -> None:
        t0 = time.perf_counter()
        self._lost.free(self._works)  # ctx.ddp's all-reduces still in flight are waited for first
        self._works.clear()
        state = self._state
        assert state is not None
        # The step whose start this rank holds: this one's, or the first of a window of gradient accumulation
        # (redone from there: the window's gradients so far are lost with the dead rank's share of them).
        start = self._taken[0] if self._taken is not None and state.taken else self._step
        peer = isinstance(state, PeerState) and state.taken
        standing = state.standing(self._step) if isinstance(state, PeerState) and peer else (start, EXACT)
        state.zero_grad()  # the abandoned step's partial gradients
        gen, source = self.generation + 1, None
        while True:
            joined: Any = rejoin(
                self._store, self.orig, gen, start, self._timeout, host=self._host, hang_s=self._hang_s
            )
            self.members, self._group, self.generation = joined.members, joined.group, joined.generation
            resume = joined.resume
            joined = None  # it holds the group: only self._group (or _lost) may, once it breaks
            if not isinstance(state, PeerState):
                # Back to the safe point, always: the abandoned attempt may have stepped the optimizer
                # already (a collective after opt.step() failed), and a rank one step ahead goes back one
                # step more. Unless no attempt ran yet (the first group never formed): the state is the
                # initial one.
                if state.taken:
                    state.restore(resume, self.orig)
                break
            try:
                resume, src = state.settle(self._group, self.rank, self.world, standing)
                source = None if src is None else self.members[src]
                break
            except SettleFailed:  # a death while the survivors settled: rejoin the next generation
                self._lost.add(self._group)
                self._group = None
            self._lost.free()  # outside the except block, whose traceback holds the broken group
            gen = self.generation + 1
        self.recoveries.append(
            {"generation": self.generation, "failed_at_step": self._step, "resume_step": resume,
             "members": list(self.members), "state_from": source,
             "seconds": round(time.perf_counter() - t0, 4)}
        )  # fmt: skip
        if isinstance(state, PeerState) and state.completed:  # behind the failed collective of a STEPPED step
            self.recoveries[-1]["schedulers_stepped"] = list(state.completed)
        self._step = resume
        self._failed = False

    def _rebaseline(self) -> None:
        """A write that changed no value (ctx.ddp's DDP broadcasting the parameters when it is built)."""
        if isinstance(self._state, PeerState):
            self._state.rebaseline()


def _worker(orig: int, world: int, port: int, spec: dict[str, Any], out: Any) -> None:
    _die_with_parent(spec.get("start_method", "spawn"))  # a host agent's death takes its ranks along
    torch.set_num_threads(int(spec.get("threads", 1)))
    store = connect_store(port, host=spec.get("store_host", LOOPBACK), timeout=datetime.timedelta(seconds=60))
    if orig in spec.get("kills_before_group", []):  # fault injection: a death at start-up (the tests')
        os.kill(os.getpid(), signal.SIGKILL)
    ctx = Elastic(
        store, orig, list(spec.get("members", range(world))), timeout_s=float(spec["group_timeout_s"]),
        host=spec.get("host", LOOPBACK), fence=spec.get("fence"), hang_s=spec.get("hang_timeout_s"),
    )  # fmt: skip
    finish(out, (orig, {}, _outcome(orig, spec, ctx)))


def _outcome(orig: int, spec: dict[str, Any], ctx: Any) -> dict[str, Any]:
    """Run the user's function: its result and recoveries, or ``{"error": traceback}``, which stops the job
    (not a death the others should survive). ``sys.exit(0)`` ends this rank as a return of None would
    (the others go on without it); ``sys.exit(n)`` is an error."""
    try:
        try:
            result = spec["fn"](ctx, *spec["args"])
        except SystemExit as exc:
            if exc.code not in (None, 0):
                raise RuntimeError(
                    f"rank {orig} called sys.exit({exc.code!r}) inside the training function: the job is "
                    "stopped (raise an exception to stop it with a message; return to end this rank)"
                ) from exc
            result = None
        info = {"result": result, "generation": ctx.generation, "recoveries": ctx.recoveries}
        # What finish sends: the plain pickler's bytes (tensors copied, not shared by file descriptor).
        # Checked here, where a failure becomes this rank's error that stops the job with its traceback.
        pickle.dumps(info)
    except Exception:
        return {"error": traceback.format_exc()}
    return info


def _all_started(store: Any, orig: int, members: list[int], wait_s: float = 120.0) -> bool:
    """A store barrier before the first group: spawned ranks start seconds apart on a loaded host, more
    than a group timeout that suits collectives. False when the launcher lists survivors first (a rank
    died at start-up) or ``wait_s`` passes."""
    store.set(f"started/{orig}", "1")
    keys = [f"started/{m}" for m in members]
    deadline = time.monotonic() + wait_s
    while not store.check(keys):
        if store.check(["members/1"]) or time.monotonic() > deadline:
            return False
        time.sleep(0.01)
    return not store.check(["members/1"])  # a rank that died after starting: the others rejoin too


def recovery_text(rec: dict[str, Any]) -> str:
    """Words for one entry of ``Elastic.recoveries``."""
    text = (
        f"generation {rec['generation']}: failed in step {rec['failed_at_step']}, resumed at step "
        f"{rec['resume_step']} with ranks {rec['members']}"
    )
    if rec.get("state_from") is not None:
        text += f", state from rank {rec['state_from']}"
    if rec.get("schedulers_stepped"):
        text += f", stepped {', '.join(rec['schedulers_stepped'])} (its step() was behind the failure)"
    return text if rec.get("seconds") is None else f"{text}, in {rec['seconds']:.2f} s"


def lost_reason(code: int | None) -> str:
    """Words for a lost rank's exit code in ``launch``'s ``lost``."""
    return {-signal.SIGKILL: "SIGKILL", None: "its host was lost"}.get(code, f"exit code {code}")


def _die_with_parent(start_method: str = "spawn") -> None:
    """Linux: SIGKILL this process when the one that spawned it dies (prctl PR_SET_PDEATHSIG). A rank
    forked by a forkserver has that server for parent, which exits when the launcher does."""
    spawner = mp.parent_process()
    parent = spawner.pid if spawner is not None else os.getppid()  # the spawner's pid, known at spawn
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):  # not Linux: a dead agent's ranks linger until their peers drop them
        return
    if start_method == "spawn" and os.getppid() != parent:  # the parent died before the prctl
        os.kill(os.getpid(), signal.SIGKILL)


def launch(
    fn: Callable[..., Any], nprocs: int, *args: Any, timeout_s: float | None = None,
    group_timeout_s: float = 20.0, threads: int = 1, nnodes: int = 1, node_rank: int = 0,
    master: str | None = None, host: str | None = None, node_timeout_s: float = 5.0,
    start_method: str | None = None, hang_timeout_s: float | None = None,
) -> dict[str, Any]:  # fmt: skip
    """Run ``fn(ctx, *args)`` in ``nprocs`` spawned processes on loopback gloo (``fn`` and ``args`` must
    pickle: a module-level function). Returns ``{"results": {orig rank: fn's return value}, "survivors",
    "lost": {orig rank: exit code}, "hung": {orig rank: seconds silent}, "recoveries": {orig rank: [...]},
    "wall_s"}``. Raises
    ``RuntimeError`` with the traceback when ``fn`` raises on a rank (or returns something that does not
    pickle), ``TimeoutError`` past ``timeout_s`` (default: no limit). ``group_timeout_s``: how long a
    collective waits for a silent peer. ``hang_timeout_s``: how long a rank may stay silent once its peers
    are rejoining before the launcher takes it for hung, SIGKILLs it and goes on without it (default:
    twice the group timeout, 10 s at least; ``failstop.hang_seconds``). A rank that calls ``sys.exit(0)``
    is done (its result is None); ``sys.exit(n)`` stops the job. ``start_method``: ``spawn`` (default) or
    ``forkserver`` (``core.dist.start_context``; one host only).

    Across hosts: call it on each of ``nnodes`` hosts with its ``node_rank`` and the same ``master``
    (``HOST:PORT`` of node 0, or ``file:PATH`` on a shared filesystem), ``host`` this host's address
    (default: the source address of the route to node 0); ``nprocs`` ranks per host; a host silent for
    ``node_timeout_s`` is lost (``elastic_nodes``). Results and recoveries are then this host's ranks'
    only."""
    if nprocs < 1:
        raise ValueError(f"nprocs must be >= 1, got {nprocs}")
    if hang_timeout_s is None:
        hang_timeout_s = hang_seconds(group_timeout_s) if isinstance(group_timeout_s, int | float) else 0.0
    named = (("group_timeout_s", group_timeout_s), ("node_timeout_s", node_timeout_s),
             ("hang_timeout_s", hang_timeout_s))  # fmt: skip
    for name, value in named:
        if isinstance(value, bool) or not isinstance(value, int | float) or not 0 < value < math.inf:
            raise ValueError(f"launch: {name} must be a finite number of seconds > 0, got {value!r}")
    if isinstance(threads, bool) or not isinstance(threads, int) or threads < 1:
        raise ValueError(
            f"launch: threads (intra-op threads per rank) must be a whole number >= 1, got {threads!r}"
        )
    why = cannot_pickle((fn, args))
    if why:
        raise ValueError(
            f"launch: fn and args must pickle, since the spawned ranks import them by name (make fn a "
            f"module-level function): {why}"
        )
    if nnodes < 1 or not 0 <= node_rank < nnodes:
        raise ValueError(
            f"node_rank must be in 0..{nnodes - 1} (one per host of nnodes={nnodes}), got {node_rank}"
        )
    if nnodes > 1 or master is not None:
        if master is None:
            raise ValueError("an elastic job across hosts needs master (HOST:PORT of node 0, or file:PATH)")
        from steptune.resilience.elastic_nodes import launch_nodes

        return launch_nodes(
            fn, nprocs, *args, nnodes=nnodes, node_rank=node_rank, master=master, host=host,
            timeout_s=timeout_s, group_timeout_s=group_timeout_s, threads=threads,
            node_timeout_s=node_timeout_s, hang_timeout_s=hang_timeout_s,
        )  # fmt: skip
    if timeout_s is None:
        timeout_s = math.inf
    spec = {"ranks": nprocs, "mode": "survive", "timeout_s": timeout_s, "fn": fn, "args": args,
            "group_timeout_s": group_timeout_s, "threads": threads, "start_method": start_method,
            "hang_timeout_s": hang_timeout_s}  # fmt: skip
    res = run_failstop(spec, _worker)
    return {
        "results": {r: info["result"] for r, info in sorted(res["infos"].items())},
        "survivors": res["survivors"],
        "lost": res["lost"],  # rank -> exit code: -9 SIGKILLed, 1 an exception (its traceback on stderr)
        "hung": res["hung"],  # rank -> seconds it stayed silent before the launcher killed it (also lost)
        "recoveries": {r: info["recoveries"] for r, info in sorted(res["infos"].items())},
        "wall_s": res["wall_s"],
    }


def toy_train(
    ctx: Elastic, steps: int, kills: list[list[int]] | None = None, errors: list[list[int]] | None = None,
    seed: int = 0, late_kills: list[list[int]] | None = None, stalls: list[list[float]] | None = None,
    sync_kills: list[list[int]] | None = None, sync_misses: list[list[int]] | None = None,
    agent_kills: list[list[int]] | None = None, ddp: str | None = None,
    forward_kills: list[list[int]] | None = None, restore: str = "peer", lr_decay: float | None = None,
    hangs: list[list[int]] | None = None, exits: list[list[int]] | None = None, accumulate: int = 1,
) -> dict[int, float]:  # fmt: skip
    """The loop of the module docstring on a small MLP (the tests' training function): every step a
    global batch of 24 items from ``seed`` and the step, this rank's share of it, AdamW. Fault injection
    ([[rank, step], ...]): ``kills`` SIGKILL that rank mid-step, after its backward and before the sync;
    ``errors`` raise a ``RuntimeError`` there (a bug in the loop, which must stop the job). With
    ``late_kills`` each step ends with a metric all-reduce after the optimizer step, and those ranks die
    just before it: the survivors' attempt fails after they have stepped. ``stalls`` ([[rank, step,
    seconds], ...], before any recovery only) sleep before the sync: a peer slower than the group timeout.
    The split outcome of a death inside the sync (before any recovery only): ``sync_kills`` die once it
    completed, ``sync_misses`` see it fail although it completed. ``agent_kills`` SIGKILL the process that
    spawned this rank (a host agent of ``elastic_nodes``: the whole host is lost) before the sync.

    ``ddp``: the model runs under ``ctx.ddp`` instead of ``ctx.sync``, its gradients all-reduced in the
    backward: ``"sum"`` with the loss scaled by the global batch (``average=False``), ``"mean"`` with each
    rank's mean loss (DDP's averaging; 24 items split evenly over 1-4 ranks give the same update). The
    ``kills`` and ``errors`` then strike before the backward, so the peers' backward all-reduce fails. The
    model has a buffer, which DDP broadcasts in each forward; ``forward_kills`` die before the forward, so
    that broadcast fails on the peers. ``restore``: ``ctx.track``'s recovery mode. ``lr_decay``: a tracked
    ``StepLR`` with that gamma, stepped at each step's very end (after the metric of ``late_kills``).
    ``hangs`` SIGSTOP that rank before the sync (hung, not dead); ``exits`` ([[rank, step, code], ...])
    call ``sys.exit(code)`` there. ``accumulate``: gradients add up over that many attempts (steps), and
    only the last of each window syncs and steps the optimizer (``losses`` has those steps only)."""
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 1))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    if ddp:
        model.register_buffer("steps_seen", torch.zeros(1))  # broadcast by DDP in every forward
    net = ctx.ddp(model, average=ddp == "mean") if ddp else model
    sched = None if lr_decay is None else torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=lr_decay)
    ctx.track(model, opt, *filter(None, [sched]), restore=restore)
    losses: dict[int, float] = {}
    while ctx.step < steps:
        with ctx.attempt():
            g = torch.Generator().manual_seed(seed * 100_003 + ctx.step)
            x = torch.randn(24, 16, generator=g)
            y = torch.sin(x.sum(1, keepdim=True))
            mine = list(ctx.shard(len(x)))
            if [ctx.orig, ctx.step] in (forward_kills or []):
                os.kill(os.getpid(), signal.SIGKILL)
            err = (net(x[mine]) - y[mine]) ** 2
            loss = err.mean() if ddp == "mean" else err.sum() / len(x)
            if ddp:
                _strike(ctx, kills, errors)
            loss.backward()
            if not ddp:
                _strike(ctx, kills, errors)
            if [ctx.orig, ctx.step] in (agent_kills or []):
                os.kill(os.getppid(), signal.SIGKILL)
                time.sleep(60)  # the agent's death kills this rank too (PR_SET_PDEATHSIG)
            if [ctx.orig, ctx.step] in (hangs or []):
                os.kill(os.getpid(), signal.SIGSTOP)
            for rank, step, code in exits or []:
                if (rank, step) == (ctx.orig, ctx.step):
                    sys.exit(code)
            for rank, step, seconds in stalls or []:
                if (rank, step) == (ctx.orig, ctx.step) and ctx.generation == 0:
                    time.sleep(seconds)
            if (ctx.step + 1) % accumulate:
                continue  # the attempt succeeds: its gradients stay for the window's last step
            if ddp:
                total = ctx.all_reduce(loss.detach().reshape(1).clone())
                losses[ctx.step] = float(total) / (ctx.world if ddp == "mean" else 1)
            else:
                losses[ctx.step] = ctx.sync(model, loss)
            if [ctx.orig, ctx.step] in (sync_kills or []) and ctx.generation == 0:
                os.kill(os.getpid(), signal.SIGKILL)
            if [ctx.orig, ctx.step] in (sync_misses or []) and ctx.generation == 0:
                raise PeerLost(f"injected: rank {ctx.orig} sees step {ctx.step}'s sync fail")
            opt.step()
            opt.zero_grad()
            if late_kills is not None:
                if [ctx.orig, ctx.step] in late_kills:
                    os.kill(os.getpid(), signal.SIGKILL)
                ctx.all_reduce(torch.ones(1))  # a metric, after the update
            if sched is not None:
                sched.step()
    return losses


def _strike(ctx: Elastic, kills: list[list[int]] | None, errors: list[list[int]] | None) -> None:
    if [ctx.orig, ctx.step] in (kills or []):
        os.kill(os.getpid(), signal.SIGKILL)
    if [ctx.orig, ctx.step] in (errors or []):
        raise RuntimeError(f"injected: a bug in rank {ctx.orig}'s step {ctx.step}")
