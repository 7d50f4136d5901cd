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

import atexit
import datetime
import gc
import io
import json
import multiprocessing as mp
import os
import pickle
import queue
import signal
import stat
import sys
import tempfile
import time
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, NoReturn

import torch
from torch import nn

from steptune.core.dist import LostGroups, connect_store, master_store, new_gloo_group, start_context
from steptune.resilience.live import global_batch, microbatch_loss, proxy_model, stage_model, sum_and_step
from steptune.resilience.recovery import Recovery, Snapshots, injected
from steptune.resilience.runtime import lpt_assign
from steptune.resilience.workload import StageModel

__all__ = [
    "EXIT_GRACE_S",
    "compare_failstop",
    "doomed",
    "finish",
    "hang_seconds",
    "reap",
    "received",
    "run_failstop",
    "split_sync",
]


def finish(out: Any, item: Any) -> NoReturn:
    """End a rank: put its result on ``out``, run the ``atexit`` handlers, and exit without tearing down
    the interpreter. Freeing the rank's gloo groups (and a DDP on them) at a normal exit has aborted the
    process ("Resource deadlock avoided") before the queue had sent the result, so that the launcher took a
    finished rank for a dead one (docs/resilience.md, 2026-12-03).

    The item goes as bytes of the plain pickler (``received`` reads it back): the queue's own pickler
    (torch's ForkingPickler) sends a tensor's storage as a file descriptor that the receiver fetches from
    this process, which has exited by then, so a result holding a tensor was lost (ConnectionResetError,
    FileNotFoundError, EOFError in ``rebuild_storage_fd``). The plain pickler copies the storage."""
    _flush_open_files()  # before the result: the launcher kills a rank still running once it has them all
    out.put(pickle.dumps(item))
    out.close()
    out.join_thread()  # the result is in the pipe
    atexit._run_exitfuncs()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


EXIT_GRACE_S = 5.0
"""How long a job that finished waits, all ranks together, for its ranks to exit on their own: ``finish``
runs the ``atexit`` handlers after the result is sent, and the launcher killed the ranks as soon as it
had every result, so a handler that took 0.5 s never finished (a sweep)."""


def reap(procs: Iterable[Any], grace_s: float) -> None:
    """Wait up to ``grace_s`` (one deadline for all) for ``procs`` to exit, then kill what is left."""
    procs = list(procs)
    deadline = time.monotonic() + grace_s
    for p in procs:
        if p.is_alive() and (left := deadline - time.monotonic()) > 0:
            p.join(left)
    for p in procs:
        if p.is_alive():
            p.kill()


def _flush_open_files() -> None:
    """Flush every open Python file object, as an interpreter's exit would (``os._exit`` does not): lines a
    training function wrote to a file it left open (a module-level log) were lost. Text files first: their
    flush writes into the binary buffer under them, flushed next. Files stay open: ``atexit`` handlers
    may still write to them, but what they write is only flushed if the launcher lets the rank live that
    long."""
    # type(o), not isinstance(o, ...): isinstance reads o.__class__, which warns for torch's deprecated
    # torch.distributed.reduce_op (a FutureWarning per rank in the demo)
    files = [o for o in gc.get_objects() if issubclass(type(o), io.IOBase) and _regular(o)]
    files.sort(key=lambda f: not isinstance(f, io.TextIOBase))
    for f in [sys.stdout, sys.stderr, *files]:
        try:
            if f is not None and not f.closed:
                f.flush()
        except Exception:  # detached, a broken pipe, a full disk: flush the others anyway
            continue


def _regular(f: io.IOBase) -> bool:
    """A file on disk: a pipe or socket whose reader stopped could block the flush, and the result with it."""
    try:
        return stat.S_ISREG(os.fstat(f.fileno()).st_mode)
    except (OSError, ValueError):  # closed, detached, or no descriptor (an in-memory buffer)
        return False


def received(out: Any, timeout: float) -> Any:
    """The next item a rank's ``finish`` put on ``out`` (``queue.Empty`` after ``timeout`` seconds)."""
    item = out.get(timeout=timeout)
    return pickle.loads(item) if isinstance(item, bytes) else item


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
    lost = LostGroups()  # a broken group, freed once its worker threads are idle
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
            lost.add(group)
            group = None
            lost.free()
            opt.zero_grad()
            joined, step, losses, _ = recovery.rejoin(gen + 1, step, losses)
            members, group, gen = joined.members, joined.group, joined.generation
            del joined  # it holds the group: when that group breaks, only `lost` may keep it (peers wait)
    finish(out, (orig, {k: losses[k] for k in sorted(losses)}, {"generation": gen}))


def doomed(spec: dict[str, Any], orig: int, step: int) -> bool:
    """Whether rank ``orig`` is to be SIGKILLed during ``step``: ``spec["kills"]`` ([[rank, step], ...],
    failures one after another) or ``kill_rank``/``kill_step``. A killed rank is never started again, so a
    restarted job cannot repeat a kill."""
    kills = [tuple(k) for k in spec.get("kills", [])]
    if spec.get("kill_rank") is not None:
        kills.append((spec["kill_rank"], spec.get("kill_step")))
    return (orig, step) in kills


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


_MAX_IDLE_RELISTS = 3
_MAX_IDLE_STEPS = 6


def hang_seconds(group_timeout_s: float) -> float:
    """The default for how long the launcher waits for a rank that stays silent while its peers rejoin
    (``Coordinator``'s ``hang_s``). Its peers already waited one group timeout for it in the collective
    that failed; a rank that then stays silent for twice as long again (10 s at least, for a loaded host)
    is hung (SIGSTOP, a deadlock, a GPU that stopped answering), not slow."""
    return max(10.0, 2.0 * float(group_timeout_s))


class Coordinator:
    """The launcher's side of survival: which ranks are alive and finished, and the member lists it writes
    to the store (``members/<gen>``; see ``recovery.rejoin`` for the ranks' side). Fed with events by
    whoever watches the ranks: ``run_failstop`` on one host, ``elastic_nodes`` across hosts."""

    def __init__(
        self, store: Any, ranks: set[int], *, survive: bool = True, hang_s: float | None = None,
        kill: Callable[[list[int]], None] | None = None,
    ) -> None:  # fmt: skip
        """``hang_s``: a rank still silent that long after a peer announced itself for the next
        generation (see ``recovery.rejoin``) is hung: ``kill(ranks)`` ends it and it is lost (None: wait
        for it as long as the ranks do)."""
        self.store, self.survive, self.hang_s, self.kill = store, survive, hang_s, kill
        self.alive = set(ranks)  # not dead (finished ones included)
        self.finished: set[int] = set()
        self.lost: dict[int, int | None] = {}  # rank -> exit code (-9: SIGKILLed; 1: an exception)
        self.hung: dict[int, float] = {}  # rank -> seconds it stayed silent before it was killed
        self.gen = 0
        self.listed = sorted(ranks)  # the last member list written (generation ``gen``)
        self._idle: tuple[int, int] = (-1, 0)  # (step, count) of relists in a row with nobody dead
        self._idle_steps: tuple[int, int] = (-1, 0)  # (first step, count) of such relists in steps in a row
        self._formed_gen = 0  # the last generation known formed (formed is final)
        self._silent_since: tuple[int, float] | None = None  # (generation, when) a rank first announced

    @property
    def done(self) -> bool:
        return self.alive <= self.finished

    def relist(self) -> None:
        """The next generation: every live rank that has not finished."""
        self.gen += 1
        self.listed = sorted(self.alive - self.finished)
        self.store.set(f"members/{self.gen}", json.dumps(self.listed))

    def finished_rank(self, rank: int) -> None:
        self.finished.add(rank)
        pending = self.gen > 0 and rank in self.listed and not _formed(self.store, self.gen)
        if self.survive and pending and not self.done:
            # A split last step: its all-reduce completed on this rank, which is done, and failed on
            # others, which rejoin to redo it. It will never announce itself: list the rest again.
            self.relist()

    def died(self, codes: dict[int, int | None]) -> None:
        """``codes``: exit code by rank (negative: the signal that killed it; None: its host was lost). A
        rank that exited with a positive code raised (its traceback is on its stderr): in survival mode
        that is a bug, not a fail-stop death, and the job is stopped."""
        self.alive -= set(codes)
        self.lost.update(codes)
        raised = {r: c for r, c in codes.items() if c is not None and c > 0}
        if self.survive and raised:
            raise RuntimeError(
                f"ranks {sorted(raised)} exited with an exception (exit codes {raised}; the traceback is on "
                "their stderr): not a death to survive, so the job is stopped"
            )
        if self.survive:
            self._idle, self._idle_steps = (-1, 0), (-1, 0)
            self.relist()

    def tick(self) -> None:
        """Between events: a peer that was only slow past the group timeout makes every rank see a
        collective fail and rejoin although nobody died; list them all again (a death would leave one
        silent: not listed here). The same failure at the same step every time is no fail-stop: after
        ``_MAX_IDLE_RELISTS`` such relists in a row the job is stopped; so is one in each of
        ``_MAX_IDLE_STEPS`` steps in a row."""
        waiting = self.alive - self.finished
        if not self.survive or not waiting:
            return
        # Ranks count their announcements (recovery._listed): an idle poll is this one store call.
        count = int(self.store.add(f"rejoining/{self.gen + 1}", 0))
        if count < len(waiting) or not _all_rejoining(self.store, self.gen + 1, waiting):
            if self.hang_s is not None:
                self._watch_silent(waiting, count)
            return
        self._silent_since = None
        step = min(int(self.store.get(f"alive/{self.gen + 1}/{r}").decode()) for r in waiting)
        count = self._idle[1] + 1 if self._idle[0] == step else 1
        if count > _MAX_IDLE_RELISTS:
            raise RuntimeError(
                f"every rank failed a collective at step {step} {count} times in a row with no rank dead: "
                "not a fail-stop (a collective that can never complete, e.g. tensors of different shapes "
                "on different ranks, or a peer slower than the group timeout every time)"
            )
        # The same failure in every step, the step advancing each time (a collective after the optimizer
        # step that fails on every rank): one relist per step, never the same step three times.
        first, run = self._idle_steps
        if run and step == self._idle[0] + 1:  # the next step failed the same way
            run += 1
        elif not (run and step == self._idle[0]):  # (a repeat of the same step is counted above, not here)
            first, run = step, 1
        if run > _MAX_IDLE_STEPS:
            raise RuntimeError(
                f"every rank failed a collective in each of steps {first}..{step} ({run} relists in a row) "
                "with no rank dead: not a fail-stop (a collective that fails on every rank every step, "
                "e.g. a local error in it, or a peer slower than the group timeout every step)"
            )
        self._idle, self._idle_steps = (step, count), (first, run)
        self.relist()

    def _watch_silent(self, waiting: set[int], next_count: int) -> None:
        """A rank that stays silent ``hang_s`` after a peer announced itself for the pending generation
        (the listed one, not formed yet, or the next; ``next_count`` announced for the next) is hung: it is
        killed and lost, and the rest are listed."""
        gen, expect, count = self.gen + 1, waiting, next_count
        if self.gen > self._formed_gen:
            if _formed(self.store, self.gen):
                self._formed_gen = self.gen  # formed is final: not read again
            else:
                gen, expect = self.gen, waiting & set(self.listed)
                count = int(self.store.add(f"rejoining/{gen}", 0))
        silent = [] if count == 0 else sorted(r for r in expect if not self.store.check([f"alive/{gen}/{r}"]))
        if silent:
            # A rank that completed more steps than every rank rejoining, and entered no attempt since, is
            # not stuck among them: it is past their failed step (a split last step) and busy after its loop
            # (an eval, a save). One inside a later attempt would have failed its collective and announced.
            done = max((_progress(self.store, r) for r in expect if r not in silent), default=0)
            silent = [r for r in silent if not _past(self.store, r, done)]
        if not silent:
            self._silent_since = None
            return
        now = time.monotonic()
        if self._silent_since is None or self._silent_since[0] != gen:
            self._silent_since = (gen, now)
            return
        waited = now - self._silent_since[1]
        if waited < float(self.hang_s or 0.0):
            return
        self._silent_since = None
        self.hung.update({r: round(waited, 1) for r in silent})
        if self.kill is not None:
            self.kill(silent)
        self.died({r: -signal.SIGKILL for r in silent})


def _past(store: Any, rank: int, done: int) -> bool:
    """Whether ``rank`` completed more than ``done`` steps and has not entered an attempt since."""
    progress = _progress(store, rank)
    return progress > done and _store_int(store, f"attempt/{rank}", -1) < progress


def _progress(store: Any, rank: int) -> int:
    """The steps ``rank`` reported complete (``progress/<rank>``, written by ``elastic.Elastic``; 0 when
    it wrote none, as the other jobs' ranks)."""
    return _store_int(store, f"progress/{rank}", 0)


def _store_int(store: Any, key: str, default: int) -> int:
    return int(store.get(key).decode()) if store.check([key]) else default


def _all_rejoining(store: Any, gen: int, ranks: set[int]) -> bool:
    """Whether every one of ``ranks`` announced itself for generation ``gen`` and no list for it exists."""
    announced = [f"alive/{gen}/{r}" for r in sorted(ranks)]
    return bool(ranks) and store.check(announced) and not store.check([f"members/{gen}"])


def _formed(store: Any, gen: int) -> bool:
    """Whether generation ``gen``'s group formed (every listed member announced itself; see rejoin)."""
    return store.check([f"fate/{gen}"]) and store.get(f"fate/{gen}") == b"form"


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
    ctx = start_context(spec.get("start_method"), preload=["torch", "steptune.resilience.elastic"])
    spec = {**spec, "start_method": ctx.get_start_method()}
    store = master_store()
    out = ctx.Queue()
    procs = _launch(world, spec, ctx, store, out, list(range(world)), worker)
    t0 = time.time()
    for p in procs.values():
        p.start()
    hang_s = spec.get("hang_timeout_s") or hang_seconds(spec.get("group_timeout_s", 20.0))

    def kill(ranks: list[int]) -> None:
        for r in ranks:
            procs[r].kill()

    coord = Coordinator(store, set(procs), survive=spec.get("mode") != "restart", hang_s=hang_s, kill=kill)
    alive, finished, infos = coord.alive, {}, {}
    deadline = t0 + float(spec.get("timeout_s", 300))
    restarts = 0
    try:
        while len(finished) < len(alive) and time.time() < deadline:
            # Exits seen before the queue is read: a rank that put its result and exited in between is
            # read from the queue first (its result was in the pipe before it exited).
            exited = [r for r in alive if not procs[r].is_alive() and r not in finished]
            try:
                rank, losses, info = received(out, 0.05)
                if rank not in alive:  # killed as hung (lost) after it had put this: not a survivor
                    continue
                if "error" in info:  # the worker's own code raised: not a death for the others to survive
                    raise RuntimeError(f"rank {rank} raised (the job is stopped):\n{info['error']}")
                finished[rank], infos[rank] = losses, info
                coord.finished_rank(rank)
                continue
            except queue.Empty:
                pass
            dead = [r for r in exited if r not in finished]
            if not dead:
                coord.tick()
                continue
            if spec.get("mode") == "restart":
                # Workers that saw a collective fail exit with 1 (torchrun stops them anyway); the lost one is
                # the one that did not (SIGKILLed). Polling may see both at once, so tell them apart here.
                dead = [r for r in dead if procs[r].exitcode != 1] or dead
            coord.died({r: procs[r].exitcode for r in dead})
            if spec.get("mode") == "restart":  # torchrun: stop everyone, start N-1 fresh from the checkpoint
                for r in alive:
                    procs[r].kill()
                for r in alive:
                    procs[r].join(5)
                restarts += 1
                members = sorted(alive)
                spec = {**spec, "resume": True, "gen": 100 + restarts, "start_method": "spawn"}
                procs.update(_launch(world, spec, mp.get_context("spawn"), store, out, members, worker))
                for r in members:
                    procs[r].start()
    except BaseException:  # a stopped job (a rank's error, the coordinator's verdict, Ctrl-C): no rank left
        for p in procs.values():
            p.kill()
        raise
    wall = time.time() - t0
    reap(procs.values(), EXIT_GRACE_S if len(finished) == len(alive) else 0.0)
    if len(finished) < len(alive) and alive:  # the deadline passed with ranks still running
        running = sorted(r for r in alive if r not in finished)
        raise TimeoutError(
            f"the run did not finish in {spec.get('timeout_s', 300)} s: ranks {running} were still running "
            f"(finished: {sorted(finished) or 'none'}); raise the timeout if the job needs longer"
        )
    if not finished:
        endings = ", ".join(f"rank {r}: {_ending(p.exitcode)}" for r, p in sorted(procs.items()))
        raise RuntimeError(
            f"no survivors: every rank exited without finishing ({endings}). A rank that raised printed its "
            "traceback above; one killed by a signal prints nothing"
        )
    losses = next(iter(finished.values()))
    return {
        "info": infos[min(infos)],
        "infos": infos,  # by original rank
        "mode": spec.get("mode"),
        "wall_s": wall,
        "losses": losses,
        "losses_by_rank": finished,
        "survivors": sorted(alive),
        "lost": coord.lost,
        "hung": coord.hung,
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


def _ending(code: int | None) -> str:
    """A rank process's exit code in words."""
    if code is None:
        return "still running"
    if code < 0:
        try:
            return f"killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exit code {code}"
