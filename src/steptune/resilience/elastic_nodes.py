"""``elastic`` across hosts: one agent per host spawns that host's ranks and reports on them through the
store; the agent of node 0 also owns the store and writes the member lists.

    # on every host (node 0 first, or within a minute of each other):
    launch(train, 8, 100, nnodes=4, node_rank=K, master="node0.cluster:29400", host="<this host's address>")

Contract. Node 0's agent owns the ``TCPStore`` at ``master`` (``HOST:PORT``; or ``file:PATH``, a file on a
shared filesystem where node 0 writes the address it bound, port chosen by the OS). Node K runs original
ranks ``K * nprocs`` to ``(K + 1) * nprocs - 1``, each with its gloo device bound to ``host``. An agent
reports each of its ranks as ``finished/<rank>``, ``exit/<rank>`` (its exit code: a death) or
``error/<rank>`` (a traceback of the user's code, which stops the job), counts each report in ``events``,
and beats ``node/<K>/beat`` (a counter) every 0.25 s. Node 0 turns these into ``failstop.Coordinator``
events. A node whose beat stops for ``node_timeout_s`` is a lost host, all its unfinished ranks dead (its
ranks die with their agent: PR_SET_PDEATHSIG). It is fenced (``node/<K>/lost``): its agent, if only
stalled, and its ranks, at their next ``attempt``, stop on reading that. The ranks' side (rejoin, roll
back, redo the step) is ``elastic.Elastic``'s. At the end node 0 writes ``job/end`` (survivors, lost
ranks) and waits up to 10 s for every live agent to read it.

Limits: node 0 is not survivable (the store and the member lists live there, as torchrun's c10d rendezvous
lives on its host); gloo only.
"""

from __future__ import annotations

import datetime
import json
import math
import multiprocessing as mp
import os
import queue
import socket
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch.distributed as dist

from steptune.core.dist import DeadlineStore, StoreUnanswered
from steptune.resilience.failstop import EXIT_GRACE_S, Coordinator, reap, received

__all__ = ["launch_nodes"]

_BEAT_S = 0.25
_STARTUP_S = 60.0  # how long a node may take to send its first beat
_RESCAN_S = 1.0  # node 0 reads every rank's keys at least this often, counted or not


def _rendezvous(master: str, node_rank: int, host: str | None) -> tuple[Any, str, int, Path | None]:
    """The store (node 0 creates it), its address and, for ``file:``, the file node 0 wrote."""
    timeout = datetime.timedelta(seconds=60)
    path = Path(master[len("file:") :]) if master.startswith("file:") else None
    if path is not None and node_rank == 0:
        addr = host or _default_host(None)
        store = dist.TCPStore(addr, 0, is_master=True, wait_for_workers=False, timeout=timeout)
        tmp = path.with_name(path.name + f".tmp{os.getpid()}")
        tmp.write_text(f"{addr}:{store.port}")
        tmp.replace(path)  # atomic: a reader never sees half an address
        return store, addr, int(store.port), path
    if path is None:
        addr, port = _parse(master)
        is_master = node_rank == 0
        store = dist.TCPStore(addr, port, is_master=is_master, wait_for_workers=False, timeout=timeout)
        return store, addr, port, None
    # A file left by an earlier job may name a dead store: retry, reading it again, until node 0 rewrites it.
    deadline = time.monotonic() + 60.0
    err: Exception | None = None
    while time.monotonic() < deadline:
        if path.exists():
            addr, port = _parse(path.read_text().strip())
            try:
                short = datetime.timedelta(seconds=2)
                store = dist.TCPStore(addr, port, is_master=False, wait_for_workers=False, timeout=short)
                store.set_timeout(timeout)
                return store, addr, port, path
            except RuntimeError as exc:  # DistNetworkError: nothing listens there (yet)
                err = exc
        time.sleep(0.2)
    raise TimeoutError(f"node {node_rank}: no store at the address in {path} within 60 s ({err})")


def _parse(master: str) -> tuple[str, int]:
    addr, _, port_text = master.rpartition(":")
    if not addr or not port_text.isdigit():
        raise ValueError(f"master must be HOST:PORT or file:PATH, got {master!r}")
    return addr, int(port_text)


def _default_host(toward: str | None) -> str:
    """This host's address as the network sees it: the source address of a route to ``toward`` (node 0),
    else what the hostname resolves to. A loopback answer is refused: pass ``host``."""
    if toward is not None:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
            try:
                sock.connect((toward, 9))  # UDP: picks a route, sends nothing
                addr = str(sock.getsockname()[0])
            except OSError:
                addr = socket.gethostbyname(socket.gethostname())
    else:
        addr = socket.gethostbyname(socket.gethostname())
    if addr.startswith("127.") and not (toward or "").startswith("127."):
        raise ValueError(
            f"this host's name resolves to {addr} (loopback), which other hosts cannot reach: pass host="
            "this host's address on the network the hosts share"
        )
    return addr


class _Watch:
    """Node 0's view of every rank and node, from the agents' store keys, fed to the ``Coordinator``. An
    idle poll costs a few store round trips whatever the number of ranks: the agents count their reports
    in ``events`` (the ranks' keys are read only when it moved) and their beats in ``node/<K>/beat`` (one
    ``multi_get`` for every node)."""

    def __init__(
        self, store: Any, world: int, nprocs: int, nnodes: int, node_timeout_s: float,
        hang_s: float | None = None,
    ) -> None:  # fmt: skip
        self.store, self.nprocs, self.node_timeout_s = store, nprocs, node_timeout_s
        self.coord = Coordinator(store, set(range(world)), hang_s=hang_s, kill=self._kill)
        self.events_seen, self.scanned = -1, -math.inf
        t0 = time.monotonic()
        self.beats: dict[int, tuple[int, float]] = {k: (0, t0) for k in range(1, nnodes)}  # count, since
        self.beat_keys = [f"node/{k}/beat" for k in self.beats]
        for key in self.beat_keys:
            store.add(key, 0)  # exists from now on, so multi_get never waits for a node that has not beaten

    def poll(self) -> str | None:
        """Feed new events to the coordinator; returns an error to stop the job with, or None."""
        coord, store = self.coord, self.store
        dead: dict[int, int | None] = {}
        events = int(store.add("events", 0))
        # A report since the last scan (agents set the key, then count it), or a while since: an agent
        # that died between the two still has its report read.
        if events != self.events_seen or time.monotonic() - self.scanned > _RESCAN_S:
            self.events_seen, self.scanned = events, time.monotonic()
            for r in sorted(coord.alive - coord.finished):
                if store.check([f"error/{r}"]):
                    return f"rank {r} raised (the job is stopped):\n{store.get(f'error/{r}').decode()}"
                if store.check([f"finished/{r}"]):
                    coord.finished_rank(r)
                elif store.check([f"exit/{r}"]):
                    dead[r] = int(store.get(f"exit/{r}").decode())
        now = time.monotonic()
        counts = store.multi_get(self.beat_keys) if self.beat_keys else []
        for (k, (seen, since)), raw in zip(list(self.beats.items()), counts, strict=True):
            count = int(raw.decode())
            if since == math.inf:  # taken for lost already: a beat from it now changes nothing
                continue
            if count != seen:
                self.beats[k] = (count, now)
                continue
            limit = self.node_timeout_s if seen > 0 else _STARTUP_S
            if now - since > limit:  # a lost host: its agent and (through PDEATHSIG) its ranks are gone
                # Fenced, in case it is only starved or cut off: its agent and its ranks stop on seeing this.
                store.set(f"node/{k}/lost", "1")
                for r in range(k * self.nprocs, (k + 1) * self.nprocs):
                    if r in coord.alive and r not in coord.finished and r not in dead:
                        dead[r] = None
                self.beats[k] = (count, math.inf)  # reported once
        try:
            if dead:
                coord.died(dead)
            else:
                coord.tick()
        except RuntimeError as err:  # the coordinator's verdict: a rank raised, or no progress is possible
            return str(err)
        return None

    def _kill(self, ranks: list[int]) -> None:
        """Hung ranks: their agents SIGKILL them (``kill/<rank>``, counted in ``node/<K>/kills``)."""
        for r in ranks:
            self.store.set(f"kill/{r}", "1")
            self.store.add(f"node/{r // self.nprocs}/kills", 1)

    def live_nodes(self) -> list[int]:
        """Nodes other than 0 not taken for lost."""
        return [k for k, (_, since) in self.beats.items() if since != math.inf]


def _wait_acks(store: Any, nodes: list[int], wait_s: float = 10.0) -> None:
    acks = [f"node/{k}/ack" for k in nodes]
    wait_until = time.monotonic() + wait_s
    while acks and time.monotonic() < wait_until and not store.check(acks):
        time.sleep(0.05)


def launch_nodes(
    fn: Callable[..., Any], nprocs: int, *args: Any, nnodes: int, node_rank: int, master: str,
    host: str | None = None, timeout_s: float | None = None, group_timeout_s: float = 20.0, threads: int = 1,
    node_timeout_s: float = 5.0, hang_timeout_s: float | None = None,
) -> dict[str, Any]:  # fmt: skip
    """This host's part of an elastic job of ``nnodes`` hosts x ``nprocs`` ranks (see ``elastic.launch``,
    which calls this when ``nnodes > 1`` or ``master`` is given). Returns ``{"results": {orig rank: fn's
    return value} for this host's finished ranks, "survivors", "lost" and "hung" (the whole job's),
    "recoveries" (this host's), "wall_s"}``."""
    from steptune.resilience import elastic

    if not 0 <= node_rank < nnodes:
        raise ValueError(f"node_rank must be in 0..{nnodes - 1}, got {node_rank}")
    store, store_host, port, rdzv_file = _rendezvous(master, node_rank, host)
    answer_s = max(10.0, 2 * node_timeout_s)
    if node_rank != 0:  # a TCPStore client never gives up on a silent server (a partition): we do
        store = DeadlineStore(store, answer_s)
    host = host or (store_host if node_rank == 0 else _default_host(store_host))
    world = nnodes * nprocs
    mine = list(range(node_rank * nprocs, (node_rank + 1) * nprocs))
    spec = {"ranks": world, "mode": "survive", "fn": fn, "args": args, "group_timeout_s": group_timeout_s,
            "threads": threads, "store_host": store_host, "host": host,
            "fence": f"node/{node_rank}/lost", "hang_timeout_s": hang_timeout_s}  # fmt: skip
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    procs = {
        r: ctx.Process(target=elastic._worker, args=(r, world, port, spec, out), daemon=True) for r in mine
    }
    t0 = time.time()
    for p in procs.values():
        p.start()
    watch = _Watch(store, world, nprocs, nnodes, node_timeout_s, hang_timeout_s) if node_rank == 0 else None
    kills_seen = 0
    deadline = math.inf if timeout_s is None else time.monotonic() + timeout_s
    infos: dict[int, Any] = {}
    reported: set[int] = set()
    next_beat = 0.0
    ended = False
    try:
        while not store.check(["job/end"]):
            if time.monotonic() >= next_beat:
                store.add(f"node/{node_rank}/beat", 1)
                next_beat = time.monotonic() + _BEAT_S
            # Exits seen before the queue is read: a rank that put its result and exited in between is
            # then read from the queue first (its result was in the pipe before it exited).
            exited = [r for r, p in procs.items() if r not in reported and not p.is_alive()]
            try:
                rank, _, info = received(out, 0.05)
                if "error" in info:
                    store.set(f"error/{rank}", info["error"])
                else:
                    infos[rank] = info
                    store.set(f"finished/{rank}", "1")
                store.add("events", 1)
                reported.add(rank)
                continue
            except queue.Empty:
                pass
            for r in exited:
                store.set(f"exit/{r}", str(procs[r].exitcode))
                reported.add(r)
            if exited:
                store.add("events", 1)
            kills = int(store.add(f"node/{node_rank}/kills", 0))
            if kills != kills_seen:  # node 0 took some of this host's ranks for hung
                kills_seen = kills
                for r, p in procs.items():
                    if p.is_alive() and store.check([f"kill/{r}"]):
                        p.kill()
            if store.check(["job/stop"]):
                stop = json.loads(store.get("job/stop").decode())
                store.set(f"node/{node_rank}/ack", "1")
                raise (TimeoutError if stop["kind"] == "timeout" else RuntimeError)(stop["message"])
            if store.check([f"node/{node_rank}/lost"]):
                raise RuntimeError(
                    f"node {node_rank} was taken for lost (no beat reached node 0 for {node_timeout_s} s) "
                    "and its ranks were stopped; the others went on without them"
                )
            if watch is not None:
                stop = watch.poll()
                kind = "error"
                if stop is None and time.monotonic() > deadline:
                    stop, kind = f"the elastic job did not finish in {timeout_s} s", "timeout"
                if stop is None and watch.coord.done and not watch.coord.alive:
                    stop = f"every rank was lost ({watch.coord.lost}): nothing survived"
                if stop is not None:
                    store.set("job/stop", json.dumps({"kind": kind, "message": stop}))
                    _wait_acks(store, watch.live_nodes())
                    raise (TimeoutError if kind == "timeout" else RuntimeError)(stop)
                if watch.coord.done:
                    end = {"survivors": sorted(watch.coord.alive), "lost": watch.coord.lost,
                           "hung": watch.coord.hung}  # fmt: skip
                    store.set("job/end", json.dumps(end))
        end = json.loads(store.get("job/end").decode())
        ended = True
        if watch is None:
            store.set(f"node/{node_rank}/ack", "1")
    except (dist.DistError, StoreUnanswered) as err:  # cut off from node 0, or node 0 is gone
        if node_rank == 0:
            raise
        why = (
            f"got no answer from the store at {store_host}:{port}, node 0's agent, for {answer_s:g} s (cut "
            "off from node 0, or node 0 is stalled)"
            if isinstance(err, StoreUnanswered)
            else f"lost the store at {store_host}:{port}, node 0's agent ({str(err).splitlines()[0]})"
        )
        raise RuntimeError(
            f"node {node_rank} {why}; this host's ranks were stopped. Node 0 takes a host silent for "
            f"{node_timeout_s:g} s for lost and goes on without it"
        ) from None
    finally:  # a job that ended well lets its ranks finish their atexit handlers (failstop.EXIT_GRACE_S)
        reap(procs.values(), EXIT_GRACE_S if ended else 0.0)
        if rdzv_file is not None and node_rank == 0:
            rdzv_file.unlink(missing_ok=True)  # a later job must not find this store's address
    if watch is not None:  # the store dies with this process: let every live agent read the end first
        _wait_acks(store, watch.live_nodes())
    return {
        "results": {r: info["result"] for r, info in sorted(infos.items())},
        "survivors": end["survivors"],
        "lost": {int(r): code for r, code in end["lost"].items()},
        "hung": {int(r): s for r, s in end["hung"].items()},
        "recoveries": {r: info["recoveries"] for r, info in sorted(infos.items())},
        "wall_s": time.time() - t0,
    }
