"""Process-group helpers: explicit groups, loopback only, short timeouts, clean teardown.

Nothing here reads or sets the global default process group, except ``init_default_group`` (for
torchrun scripts and torch APIs that need one): every helper returns a group that callers pass
explicitly (``group=``) to collectives. That is what lets tests run ranks as threads
of one process, each with its own real gloo group.

Contract: the caller that creates a master ``TCPStore`` owns it and keeps it alive until every
group built on it is gone. A rank that fails calls ``abort_group`` so its peers see "connection
closed" within milliseconds instead of waiting for the timeout.
"""

from __future__ import annotations

import contextlib
import datetime
import gc
import multiprocessing as mp
import os
import pickle
import queue
import threading
import time
from collections.abc import Callable, Container, Iterable, Sequence
from typing import Any

import torch
import torch.distributed as dist

# The stubs of torch.distributed do not re-export the store classes: reach them untyped.
_c10d: Any = dist

__all__ = [
    "DEFAULT_TIMEOUT",
    "DRAIN_S",
    "LOOPBACK",
    "START_METHOD_ENV",
    "DeadlineStore",
    "LostGroups",
    "StoreUnanswered",
    "abort_group",
    "allreduce_grads",
    "as_process_group",
    "cannot_pickle",
    "connect_store",
    "default_store",
    "env_rank",
    "init_default_group",
    "irecv",
    "isend",
    "master_store",
    "new_gloo_group",
    "pack_grads",
    "print0",
    "recv",
    "send",
    "start_context",
    "unpack_grads",
]

LOOPBACK = "127.0.0.1"
DEFAULT_TIMEOUT = datetime.timedelta(seconds=30)
"""Never the 30-minute default: a hung peer should fail a test, not stall CI."""


def master_store(*, host: str = LOOPBACK, port: int = 0) -> Any:
    """A master ``TCPStore``; ``port=0`` lets the OS pick a free port (read it from ``.port``)."""
    return _c10d.TCPStore(host, port, is_master=True, wait_for_workers=False, timeout=DEFAULT_TIMEOUT)


def connect_store(port: int, *, host: str = LOOPBACK, timeout: datetime.timedelta = DEFAULT_TIMEOUT) -> Any:
    return _c10d.TCPStore(host, port, is_master=False, timeout=timeout)


class StoreUnanswered(RuntimeError):
    """A store call got no answer within its deadline."""


class DeadlineStore:
    """``store`` whose calls give up after ``seconds`` with ``StoreUnanswered``. A ``TCPStore`` client
    waits for a reply with no time limit: when the network between it and the server goes silent (a
    partition drops packets without a reset), a call blocks until TCP gives up, about 15 minutes, and
    possibly for good. The calls run one at a time on a daemon thread; a call past its deadline leaves
    that thread blocked, and every later call fails at once."""

    def __init__(self, store: Any, seconds: float) -> None:
        self._store, self._seconds = store, seconds
        self._calls: queue.Queue[tuple[Callable[[], Any], queue.Queue[tuple[bool, Any]]]] = queue.Queue()
        self._stuck: str | None = None
        threading.Thread(target=self._serve, name="store-deadline", daemon=True).start()

    def _serve(self) -> None:
        while True:
            call, reply = self._calls.get()
            try:
                reply.put((True, call()))
            except BaseException as err:  # handed to the caller, who raises it
                reply.put((False, err))

    def __getattr__(self, name: str) -> Any:
        attr = getattr(self._store, name)
        if not callable(attr):
            return attr

        def call(*args: Any, **kwargs: Any) -> Any:
            if self._stuck is not None:
                raise StoreUnanswered(
                    f"the store has not answered {self._stuck} for over {self._seconds:g} s"
                )
            reply: queue.Queue[tuple[bool, Any]] = queue.Queue(maxsize=1)
            self._calls.put((lambda: attr(*args, **kwargs), reply))
            try:
                ok, value = reply.get(timeout=self._seconds)
            except queue.Empty:
                self._stuck = name
                raise StoreUnanswered(f"the store did not answer {name} within {self._seconds:g} s") from None
            if not ok:
                raise value
            return value

        return call


def new_gloo_group(
    store: Any,
    rank: int,
    world_size: int,
    *,
    prefix: str = "pg",
    timeout: datetime.timedelta = DEFAULT_TIMEOUT,
    host: str = LOOPBACK,
) -> dist.ProcessGroup:
    """A gloo group bound to ``host`` (loopback by default), namespaced by ``prefix`` in ``store``."""
    if not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} is outside world_size {world_size}")
    gloo: Any = dist.ProcessGroupGloo
    opts = gloo._Options()
    opts._timeout = timeout
    opts._devices = [gloo.create_device(hostname=host)]
    group: dist.ProcessGroup = gloo(_c10d.PrefixStore(prefix, store), rank, world_size, opts)
    return group


def init_default_group(backend: str = "gloo", **kwargs: Any) -> dist.ProcessGroup:
    """``torch.distributed.init_process_group(backend, **kwargs)`` with ``torch._dynamo`` imported first;
    returns ``group.WORLD``.

    Importing ``torch._dynamo`` (building a rank's first optimizer does) after the default group exists
    leaves it 10 references that ``destroy_process_group`` cannot drop (torch 2.13). The group outlives the
    script, its gloo worker threads run into interpreter shutdown, and one that frees a tensor there
    aborts the process ("terminate called without an active exception", SIGABRT; pytorch/pytorch#190489).
    Imported first, it holds none."""
    import torch._dynamo  # noqa: F401  (see above)

    dist.init_process_group(backend, **kwargs)
    group: dist.ProcessGroup = dist.group.WORLD  # type: ignore[assignment]
    return group


def default_store() -> Any:
    """The default group's store (torchrun's, or ``init_default_group``'s), or None when none exists."""
    if not dist.is_initialized():
        return None
    try:
        return dist.distributed_c10d._get_default_store()
    except (AttributeError, RuntimeError, ValueError):  # a private call: absent or refusing, no store
        return None


def as_process_group(backend: Any, store: Any, rank: int, world_size: int, *, prefix: str) -> Any:
    """``backend`` (a gloo group from ``new_gloo_group``) as the ``ProcessGroup`` that APIs such as
    ``DistributedDataParallel(process_group=...)`` take. Nothing is registered with torch.distributed's
    world: no default group is needed, and dropping the result (then aborting ``backend``) frees it."""
    group = _c10d.ProcessGroup(_c10d.PrefixStore(prefix, store), rank, world_size)
    kind = _c10d.ProcessGroup.BackendType.GLOO
    group._set_default_backend(kind)
    group._register_backend(torch.device("cpu"), kind, backend)
    return group


# P2P through the group object itself, with group-local ranks. torch.distributed.send/recv map
# group ranks to global ranks, which fails for groups built outside init_process_group (as ours are).
def isend(tensor: torch.Tensor, dst: int, group: Any, *, tag: int = 0) -> Any:
    return group.send([tensor], dst, tag)


def irecv(tensor: torch.Tensor, src: int, group: Any, *, tag: int = 0) -> Any:
    return group.recv([tensor], src, tag)


def send(tensor: torch.Tensor, dst: int, group: Any, *, tag: int = 0) -> None:
    isend(tensor, dst, group, tag=tag).wait()


def recv(tensor: torch.Tensor, src: int, group: Any, *, tag: int = 0) -> None:
    irecv(tensor, src, group, tag=tag).wait()


def pack_grads(
    params: Sequence[torch.nn.Parameter], owned: Container[int] | None = None
) -> tuple[torch.Tensor, list[bool]]:
    """The gradients of ``params`` as one flat tensor for a SUM all-reduce (fp32, or fp64 if any parameter
    is fp64), and which of them are kept (``owned``; see ``allreduce_grads``). A missing gradient or one
    not owned adds zeros."""
    keep = [owned is None or i in owned for i in range(len(params))]
    dtype = torch.float64 if any(p.dtype == torch.float64 for p in params) else torch.float32
    parts = [
        p.grad.reshape(-1).to(dtype)
        if k and p.grad is not None
        else torch.zeros(p.numel(), dtype=dtype, device=p.device)
        for p, k in zip(params, keep, strict=True)
    ]
    return torch.cat(parts), keep


def unpack_grads(params: Sequence[torch.nn.Parameter], flat: torch.Tensor, keep: Sequence[bool]) -> None:
    """Give each kept parameter its slice of the reduced ``flat`` in its own dtype; the others none."""
    off = 0
    for p, k in zip(params, keep, strict=True):
        p.grad = flat[off : off + p.numel()].view_as(p).to(p.dtype, copy=True) if k else None
        off += p.numel()


def allreduce_grads(
    params: Sequence[torch.nn.Parameter], group: Any, owned: Container[int] | None = None
) -> None:
    """SUM the gradients of ``params`` over ``group`` in one message and give each back in its own dtype
    (``pack_grads``, then ``unpack_grads``). A parameter without a gradient adds zeros and receives the
    sum. With ``owned`` (indices into ``params``) only those contribute and receive it; the others add
    zeros and are left with no gradient, so ranks holding different layers (pipeline stages) can sync
    layer-wise."""
    flat, keep = pack_grads(params, owned)
    group.allreduce([flat]).wait()
    unpack_grads(params, flat, keep)


def abort_group(group: Any) -> None:
    """Abort ``group``'s pending work. Safe to call twice.

    On gloo this alone does not close the sockets: drop the last reference to the group too
    (its destructor closes them), so that peers blocked on this rank fail within milliseconds.
    """
    for name in ("abort", "shutdown"):
        fn = getattr(group, name, None)
        if fn is not None:
            try:
                fn()
            except Exception:  # already closed, or a backend without the method body
                continue
            return


DRAIN_S = 0.05
"""How long ``LostGroups.free`` releases the GIL before the free: a gloo worker's last step needs it."""


class LostGroups:
    """Groups lost to a failed collective, and what holds them (a DDP, a wrapper), kept until their worker
    threads are idle, then freed.

    ``ProcessGroupGloo``'s destructor joins its worker threads while the freeing thread holds the GIL, and
    a worker that lets go of a finished collective's tensors takes the GIL (torch 2.13 decrefs a tensor's
    Python object when its C++ count falls to one). Freeing a group just after one of its collectives
    failed can therefore deadlock the two threads for good (a CI hang of a ctx.ddp death test: 5 of 30
    reproductions with random delays; 0 of 40 once freed this way, docs/resilience.md). ``add`` aborts a
    group and keeps it; ``free`` collects cycles (the failed step's frames), waits for the works still in
    flight (``Work.wait`` releases the GIL), releases the GIL for ``DRAIN_S``, and only then drops the
    group, whose sockets close so that peers blocked on it fail. Call ``free`` outside the ``except``
    block that caught the failure: that block's traceback holds the failed step's frames, and with them
    the group."""

    def __init__(self) -> None:
        self._held: list[Any] = []

    def __len__(self) -> int:
        return len(self._held)

    def add(self, group: Any, *holders: Any) -> None:
        """Abort ``group`` (if not None) and keep it, and ``holders``, until ``free``."""
        if group is not None:
            abort_group(group)
        self._held.extend(x for x in (group, *holders) if x is not None)

    def free(self, works: Iterable[Any] = ()) -> None:
        """Wait for ``works`` (their failures ignored), let the worker threads finish, drop what is held."""
        works = list(works)
        if not self._held and not works:
            return
        gc.collect()
        for work in works:
            with contextlib.suppress(RuntimeError):  # failed, as a broken group's work does: done either way
                work.wait()
        time.sleep(DRAIN_S)
        self._held.clear()
        gc.collect()


START_METHOD_ENV = "STEPTUNE_START_METHOD"
"""Environment variable naming how ranks start when no method is given: ``spawn`` (the default) or
``forkserver``."""


def start_context(method: str | None = None, *, preload: Sequence[str] = ("torch",)) -> Any:
    """The ``multiprocessing`` context ranks start from: ``method``, else ``$STEPTUNE_START_METHOD``, else
    ``spawn`` (a fresh interpreter per rank, as torchrun starts them: each imports torch, seconds of CPU).
    ``forkserver`` forks each rank from a server that imported ``preload`` once (read when the server
    starts, once per process), so a rank starts in milliseconds; the test suite uses it
    (``tests/conftest.py``). The server also imports ``torch._dynamo``: a rank's first optimizer call
    imports it (``torch._disable_dynamo``), 2.3 s of CPU on a 2-core box, paid by every rank otherwise."""
    method = method or os.environ.get(START_METHOD_ENV) or "spawn"
    if method not in ("spawn", "forkserver"):
        raise ValueError(
            f"rank start method must be 'spawn' or 'forkserver', got {method!r} "
            f"(the argument, or ${START_METHOD_ENV})"
        )
    if method == "forkserver":
        mp.set_forkserver_preload(list(dict.fromkeys([*preload, "torch._dynamo"])))
    return mp.get_context(method)


def env_rank() -> tuple[int, int, int]:
    """``(rank, local_rank, world_size)`` from torchrun's environment; ``(0, 0, 1)`` outside it."""
    return (
        int(os.environ.get("RANK", 0)),
        int(os.environ.get("LOCAL_RANK", 0)),
        int(os.environ.get("WORLD_SIZE", 1)),
    )


def print0(*args: Any, rank: int | None = None, **kwargs: Any) -> None:
    """``print`` on rank 0 only (rank from the argument, else from the environment)."""
    if (env_rank()[0] if rank is None else rank) == 0:
        print(*args, **kwargs)


def cannot_pickle(obj: Any) -> str | None:
    """Why ``obj`` cannot go to a spawned process or through a multiprocessing queue, or None. Check before
    ``Queue.put``: the queue pickles in a feeder thread whose failure reaches only stderr, so the receiver
    would just wait."""
    try:
        pickle.dumps(obj)
    except Exception as exc:
        return f"{type(exc).__name__}: {exc}"
    return None
