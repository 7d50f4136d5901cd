"""Fail-stop survival without restarting the survivors (DP), and torchrun's restart-everything baseline.

Contract. The launcher (this process) owns the ``TCPStore``; workers only connect to it, so the store
outlives any rank. Workers train data-parallel on gloo groups named by generation (``gen0``, ``gen1``, ...).
When a rank dies, its peers' next collective fails within milliseconds: they drop their group, publish
``alive/<gen>/<rank>``, and wait for ``members/<gen>``, which the launcher writes once it has seen the death
(or, when nobody died but a peer was slower than the group timeout, once every live rank has announced).
They then build a new group among the survivors and agree on the last step every survivor completed (an
all-reduce MIN). A survivor that got further rolls back to its snapshot of that step. The safe point is the
start of a step: parameters and optimizer state are snapshotted there. The interrupted step is redone with
its whole global batch re-assigned to the survivors. Losses are token-weighted sums all-reduced with SUM,
so the update does not depend on how many ranks share the batch, and the loss trajectory matches a
failure-free run up to fp32 summation order.

In DP every rank holds the full model and optimizer state, so nothing has to be copied from peers. PP and
TP (a stage's only copy in its replica lost) copy it from DP peers (``failstop_pipe``, ``failstop_tp``),
ending the copy with ``commit``; the checkpoint is the fallback.

The baseline kills every rank when one dies, as torchrun does, then starts ``N - 1`` fresh processes from
the last checkpoint (written every ``checkpoint_every`` steps) and redoes the steps since then.
"""

from __future__ import annotations

import copy
import datetime
import gc
import json
import multiprocessing as mp
import os
import queue
import signal
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, NamedTuple

import torch
import torch.distributed as dist
from torch import nn

from steptune.core.dist import abort_group, connect_store, master_store, new_gloo_group
from steptune.resilience.live import global_batch, microbatch_loss, proxy_model, stage_model, sum_and_step
from steptune.resilience.runtime import lpt_assign
from steptune.resilience.workload import StageModel

__all__ = [
    "CommitFailed",
    "Rejoined",
    "Snapshots",
    "adopt_pending",
    "commit",
    "compare_failstop",
    "doomed",
    "injected",
    "rejoin",
    "run_failstop",
    "split_sync",
]


def _train_step(model: nn.Module, opt: Any, group: Any, rank: int, world: int, seed: int, step: int,
                stage: StageModel, time_scale: float, die_before_allreduce: bool,
                synced: Any = None) -> float:  # fmt: skip
    mbs, toks = global_batch(seed, step)
    total = sum(t.shape[1] - 1 for t in toks)
    costs = [sum(stage.time(mb, p) for p in ("F", "B", "W")) for mb in mbs]
    loss_sum = torch.zeros(())
    for i in lpt_assign(costs, [1.0] * world)[rank]:
        t0 = time.perf_counter()
        loss = microbatch_loss(model, toks[i], total)
        loss.backward()
        loss_sum += loss.detach()
        rest = costs[i] * time_scale - (time.perf_counter() - t0)
        if rest > 0:
            time.sleep(rest)
    if die_before_allreduce:
        os.kill(os.getpid(), signal.SIGKILL)  # a hard failure, mid-step, before the gradients are shared
    return sum_and_step(list(model.parameters()), opt, group, loss_sum, timed=synced)


def _worker(orig: int, world: int, port: int, spec: dict[str, Any], out: Any) -> None:
    torch.set_num_threads(1)
    seed, steps, scale = int(spec["seed"]), int(spec["steps"]), float(spec["time_scale"])
    timeout = datetime.timedelta(seconds=20)
    store = connect_store(port, timeout=datetime.timedelta(seconds=60))
    stage = stage_model()
    members, gen = list(spec.get("members", range(world))), int(spec.get("gen", 0))
    model = proxy_model(seed)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    step, losses = 0, {}
    ckpt = spec.get("checkpoint")
    if spec.get("resume") and ckpt and Path(ckpt).exists():
        state = torch.load(ckpt, weights_only=False)
        model.load_state_dict(state["model"])
        opt.load_state_dict(state["opt"])
        step, losses = state["step"], state["losses"]
    group = new_gloo_group(store, members.index(orig), len(members), prefix=f"gen{gen}", timeout=timeout)
    snapshots = Snapshots(model, opt)
    recovery = Recovery(store, orig, spec, snapshots, timeout)
    while step < steps:
        snapshots.take(step)
        die = orig == spec.get("kill_rank") and step == spec.get("kill_step") and not spec.get("resume")
        try:
            losses[step] = _train_step(
                model, opt, group, members.index(orig), len(members), seed, step, stage, scale, die,
                split_sync(spec, orig, step, gen),
            )  # fmt: skip
            step += 1
            if (
                ckpt
                and spec.get("checkpoint_every")
                and step % spec["checkpoint_every"] == 0
                and orig == members[0]
            ):
                torch.save(
                    {"model": model.state_dict(), "opt": opt.state_dict(), "step": step, "losses": losses},
                    ckpt,
                )
        except RuntimeError:
            if spec.get("mode") == "restart":
                os._exit(1)  # torchrun: a failed collective ends the worker; the agent tears everything down
            failed = True
        else:
            failed = False
        if failed:
            # Survival, outside the except block: the exception's traceback holds the step's frame, which
            # holds the broken group; peers still blocked on it only fail once its sockets close.
            abort_group(group)
            group = None
            gc.collect()
            opt.zero_grad()
            joined, step, losses, _ = recovery.rejoin(gen + 1, step, losses)
            members, group, gen = joined.members, joined.group, joined.generation
    out.put((orig, {k: losses[k] for k in sorted(losses)}, {"generation": gen}))


def doomed(spec: dict[str, Any], orig: int, step: int) -> bool:
    """Whether rank ``orig`` is to be SIGKILLed during ``step``: ``spec["kills"]`` ([[rank, step], ...],
    failures one after another) or ``kill_rank``/``kill_step``. A killed rank is never started again, so a
    restarted job cannot repeat a kill."""
    kills = [tuple(k) for k in spec.get("kills", [])]
    if spec.get("kill_rank") is not None:
        kills.append((spec["kill_rank"], spec.get("kill_step")))
    return (orig, step) in kills


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


class Snapshots:
    """The state (``state_dict``) of modules and optimizers at the start of the current step and of the one
    before. A survivor can be one step ahead of the others: that step's all-reduce completed on it but
    failed on another survivor (a death inside it, see ``split_sync``). It then goes back to the step the
    survivors agreed to resume from (``restore``)."""

    def __init__(self, *stateful: Any) -> None:
        self._objs = list(stateful)
        self._kept: dict[int, list[Any]] = {}

    def take(self, step: int) -> None:
        """At the start of ``step`` (the one before is kept too)."""
        self._kept = {k: v for k, v in self._kept.items() if k == step - 1}
        self._kept[step] = [copy.deepcopy(o.state_dict()) for o in self._objs]

    def restore(self, step: int, orig: int) -> None:
        if step not in self._kept:
            raise RuntimeError(
                f"rank {orig}: the survivors resume from step {step}, and this rank holds the start of steps "
                f"{sorted(self._kept)} only"
            )
        for o, state in zip(self._objs, self._kept[step], strict=True):
            o.load_state_dict(state)

    def clear(self) -> None:
        """After a recovery that moved state (the copies are older than it); the next ``take`` refills."""
        self._kept = {}

    def zero_grad(self) -> None:
        """Drop the gradients of the modules and optimizers (an abandoned step's partial ones)."""
        for o in self._objs:
            if isinstance(o, nn.Module):
                for prm in o.parameters():
                    prm.grad = None
            elif hasattr(o, "zero_grad"):
                o.zero_grad(set_to_none=True)


@contextmanager
def split_sync(spec: dict[str, Any], orig: int, step: int, gen: int) -> Iterator[None]:
    """Around a step's gradient all-reduce (``live.sum_and_step``'s ``timed``), fault injection of its
    split outcome, a death inside it: ``sync_kills`` ([[rank, step], ...]) die once it completed,
    ``sync_misses`` see it fail although it completed (before the optimizer step), so the survivors that
    completed it are one step ahead of those that did not. Only before any recovery (``gen`` 0): the
    step is redone after it."""
    yield
    if gen == 0 and injected(spec, "sync_kills", orig, step):
        os.kill(os.getpid(), signal.SIGKILL)
    if gen == 0 and injected(spec, "sync_misses", orig, step):
        raise RuntimeError(f"rank {orig}: injected: the all-reduce of step {step} is seen as failed")


def rejoin(
    store: Any, orig: int, gen: int, step: int, timeout: datetime.timedelta, *, epoch: int = 0,
    die: bool = False,
) -> Rejoined:  # fmt: skip
    """After a failed collective: announce this rank alive for generation ``gen``, wait for the launcher's
    member list, build the survivors' group and agree on the step to resume from (the lowest one any
    survivor was at) and on the layout epoch (the highest one any survivor committed: ``epoch`` is this
    rank's count of committed state copies). A member that dies during this (a second failure in the
    recovery window) never announces itself, or breaks the new group; the launcher then lists the survivors
    again as generation ``gen + 1`` and this rank joins that one. ``die``: SIGKILL this rank first (fault
    injection: a death during recovery)."""
    if die:  # once the launcher has listed this rank among the survivors: the others must supersede it
        store.wait([f"members/{gen}"], datetime.timedelta(seconds=60))
        os.kill(os.getpid(), signal.SIGKILL)
    while True:
        try:
            members, group, resume, agreed = _join(store, orig, gen, step, epoch, timeout)
            return Rejoined(members, group, resume, gen, agreed)
        except (_Superseded, RuntimeError):  # RuntimeError: a member died after announcing itself
            pass
        gc.collect()  # outside the except block, whose traceback holds a broken group: its sockets close
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


class _Superseded(Exception):
    """The launcher listed the survivors again (another member died) before this generation formed."""


def _join(
    store: Any, orig: int, gen: int, step: int, epoch: int, timeout: datetime.timedelta
) -> tuple[list[int], Any, int, int]:
    """One generation's rejoin. Store failures end the recovery (ConnectionError, TimeoutError: no retry
    can help); a RuntimeError means the new group broke, and the caller tries the next generation."""
    members = _listed(store, orig, gen, step, timeout)
    group = new_gloo_group(store, members.index(orig), len(members), prefix=f"gen{gen}", timeout=timeout)
    done = torch.tensor([float(step), -float(epoch)])  # MIN of the step, MAX of the epoch
    opts = dist.AllreduceOptions()
    opts.reduceOp = dist.ReduceOp.MIN
    try:
        group.allreduce([done], opts).wait()
    except RuntimeError:
        abort_group(group)
        raise
    return members, group, int(done[0].item()), -int(done[1].item())


def _listed(store: Any, orig: int, gen: int, step: int, timeout: datetime.timedelta) -> list[int]:
    """The launcher's survivors for ``gen``, once every one of them has announced itself."""
    try:
        store.set(f"alive/{gen}/{orig}", str(step))
        try:
            store.wait([f"members/{gen}"], datetime.timedelta(seconds=60))
        except dist.DistStoreError as err:
            raise TimeoutError(
                f"rank {orig}: the launcher listed no survivors for generation {gen} within 60 s"
            ) from err
        members: list[int] = json.loads(store.get(f"members/{gen}").decode())
        # Every listed member announces itself before anyone builds the group: one that died since the
        # list was written never does, and the launcher's next list supersedes this one within its poll.
        # Whether this generation forms or is superseded is one decision, the first rank's, kept in the
        # store: survivors that look at different moments must not split across generations.
        announced = [f"alive/{gen}/{m}" for m in members]
        fate_key = f"fate/{gen}"
        # Peers may reach this generation one group timeout late (a group that failed to form before).
        wait_s = 2 * timeout.total_seconds() + 10
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
    except (TimeoutError, _Superseded):
        raise
    except RuntimeError as err:  # the store itself: the launcher is gone
        raise ConnectionError(f"rank {orig}: lost the launcher's store while rejoining: {err}") from err
    return members


def _all_rejoining(store: Any, gen: int, alive: set[int]) -> bool:
    """Whether every live rank announced itself for generation ``gen`` and no list for it exists yet."""
    return store.check([f"alive/{gen}/{r}" for r in sorted(alive)]) and not store.check([f"members/{gen}"])


def _launch(
    world: int, spec: dict[str, Any], ctx: Any, store: Any, out: Any, members: list[int], worker: Any
) -> dict[int, Any]:
    return {
        r: ctx.Process(
            target=worker, args=(r, world, store.port, {**spec, "members": members}, out), daemon=True
        )
        for r in members
    }


def run_failstop(spec: dict[str, Any], worker: Any = None) -> dict[str, Any]:
    """Run one job (``spec["mode"]``: ``survive`` or ``restart``); returns losses by step and wall time.

    ``worker(orig, world, port, spec, out)`` is the rank body (default: the DP job); it puts
    ``(orig, losses by step, info)`` on ``out`` when done.
    """
    worker = worker or _worker
    world = int(spec.get("ranks", 4))
    ctx = mp.get_context("spawn")
    store = master_store()
    out = ctx.Queue()
    procs = _launch(world, spec, ctx, store, out, list(range(world)), worker)
    t0 = time.time()
    for p in procs.values():
        p.start()
    gen, alive, finished, infos = 0, set(procs), {}, {}
    deadline = t0 + float(spec.get("timeout_s", 300))
    restarts = 0
    while len(finished) < len(alive) and time.time() < deadline:
        try:
            rank, losses, info = out.get(timeout=0.05)
            if "error" in info:  # the worker's own code raised: not a death for the others to survive
                for p in procs.values():
                    p.kill()
                raise RuntimeError(f"rank {rank} raised (the job is stopped):\n{info['error']}")
            finished[rank], infos[rank] = losses, info
            continue
        except queue.Empty:
            pass
        dead = [r for r in alive if not procs[r].is_alive() and r not in finished]
        if not dead:
            if spec.get("mode") != "restart" and _all_rejoining(store, gen + 1, alive):
                # A peer was only slow past the group timeout: nobody died, yet every rank saw a collective
                # fail and rejoins. List them all again (a death would leave one silent: not listed here).
                gen += 1
                store.set(f"members/{gen}", json.dumps(sorted(alive)))
            continue
        if spec.get("mode") == "restart":
            # Workers that saw a collective fail exit with 1 (torchrun stops them anyway); the lost one is
            # the one that did not (SIGKILLed). Polling may see both at once, so tell them apart here.
            dead = [r for r in dead if procs[r].exitcode != 1] or dead
        alive -= set(dead)
        if spec.get("mode") == "restart":  # torchrun: stop everyone, start N-1 fresh from the checkpoint
            for r in alive:
                procs[r].kill()
            for r in alive:
                procs[r].join(5)
            restarts += 1
            members = sorted(alive)
            spec = {**spec, "resume": True, "gen": 100 + restarts}
            procs.update(_launch(world, spec, ctx, store, out, members, worker))
            for r in members:
                procs[r].start()
        else:
            gen += 1
            store.set(f"members/{gen}", json.dumps(sorted(alive)))
    wall = time.time() - t0
    for p in procs.values():
        if p.is_alive():
            p.kill()
    if not finished:
        raise RuntimeError("every rank of the fail-stop run exited without finishing; their stderr says why")
    if len(finished) < len(alive):
        raise TimeoutError(
            f"fail-stop run did not finish in {spec.get('timeout_s', 300)} s ({sorted(finished)} done)"
        )
    losses = next(iter(finished.values()))
    return {
        "info": infos[min(infos)],
        "infos": infos,  # by original rank
        "mode": spec.get("mode"),
        "wall_s": wall,
        "losses": losses,
        "survivors": sorted(alive),
        "restarts": restarts,
    }


def compare_failstop(
    spec: dict[str, Any], worker: Any = None, reference: list[float] | None = None, *, restart: bool = True
) -> dict[str, Any]:
    """Failure-free reference, survival, and torchrun-style restart from a checkpoint (``restart``), same
    seeds.

    ``reference``: the failure-free losses by step when the caller has them (e.g. ``live.reference_losses``,
    one process); then no failure-free job is spawned and its wall time is not reported.
    """
    with tempfile.TemporaryDirectory() as tmp:
        base = {"ranks": 4, "steps": 20, "seed": 0, "time_scale": 0.01, **spec}
        runs = {}
        if reference is None:
            healthy = {**base, "mode": "survive", "kill_rank": None, "kills": []}
            runs["reference"] = run_failstop(healthy, worker)
        runs["survive"] = run_failstop({**base, "mode": "survive"}, worker)
        ckpt = {
            "checkpoint": str(Path(tmp) / "ckpt.pt"),
            "checkpoint_every": int(spec.get("checkpoint_every", 5)),
        }
        if restart:
            runs["restart"] = run_failstop({**base, "mode": "restart", **ckpt}, worker)
    ref = runs["reference"]["losses"] if reference is None else dict(enumerate(reference))

    def diff(run: dict[str, Any]) -> float:
        return max(abs(run["losses"][k] - ref[k]) / max(abs(ref[k]), 1e-12) for k in sorted(ref))

    return {
        "spec": base,
        "steps_completed": {"reference": len(ref), **{m: len(r["losses"]) for m, r in runs.items()}},
        "max_loss_rel_diff": {m: diff(r) for m, r in runs.items() if m != "reference"},
        "wall_s": {m: r["wall_s"] for m, r in runs.items()},
        "survivors": runs["survive"]["survivors"],
        "recovery": {m: r["info"] for m, r in runs.items() if m != "reference"},
        "losses": {"reference": ref, **{m: r["losses"] for m, r in runs.items()}},
    }
