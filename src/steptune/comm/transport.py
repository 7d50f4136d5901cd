"""Point-to-point transports behind one protocol, with wire accounting.

A transport moves a contiguous tensor view to a peer's contiguous tensor view: ``isend(src, peer, tag)`` and
``irecv(dst, peer, tag)`` return a handle with ``wait()``. Messages between a pair with the same tag match in
posting order. The caller owns both views and must keep them alive (and unmodified) until ``wait()`` returns.

- ``ProcessGroupP2P``: the group's own ``send``/``recv`` with group-local ranks (gloo on CPU, the CI path;
  NCCL on CUDA tensors, guarded by ``select_transport``). No global process group is read.
- ``LoopbackHub`` / ``Loopback``: ranks as threads of one process, rendezvous matching, one copy per message
  (for property tests at world sizes a 2-core box cannot spawn).

Every transport counts the bytes it puts on the wire, by dtype (``WireStats``).
"""

from __future__ import annotations

import threading
from collections import defaultdict, deque
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

__all__ = [
    "Loopback",
    "LoopbackHub",
    "ProcessGroupP2P",
    "Transport",
    "WireStats",
    "nccl_version",
    "select_transport",
]


@dataclass
class WireStats:
    """Bytes and messages sent by one rank, by dtype name."""

    bytes_by_dtype: dict[str, int] = field(default_factory=lambda: defaultdict(int))
    messages: int = 0

    def add(self, t: torch.Tensor) -> None:
        self.bytes_by_dtype[str(t.dtype).removeprefix("torch.")] += t.numel() * t.element_size()
        self.messages += 1

    @property
    def total_bytes(self) -> int:
        return sum(self.bytes_by_dtype.values())

    def reset(self) -> None:
        self.bytes_by_dtype.clear()
        self.messages = 0


class Work(Protocol):
    def wait(self) -> Any: ...


class Transport(Protocol):
    rank: int
    world_size: int
    stats: WireStats

    def isend(self, src: torch.Tensor, peer: int, tag: int) -> Work: ...

    def irecv(self, dst: torch.Tensor, peer: int, tag: int) -> Work: ...


def _check_view(t: torch.Tensor, what: str) -> None:
    if not t.is_contiguous():
        raise ValueError(f"{what}: transports move contiguous views only; got strides {t.stride()}")


class ProcessGroupP2P:
    """P2P through a ``ProcessGroup`` object (group-local ranks), zero-copy on tensor views."""

    def __init__(self, group: Any) -> None:
        self.group = group
        self.rank: int = group.rank()
        self.world_size: int = group.size()
        self.stats = WireStats()

    def isend(self, src: torch.Tensor, peer: int, tag: int) -> Work:
        _check_view(src, "isend")
        self.stats.add(src)
        work: Work = self.group.send([src], peer, tag)
        return work

    def irecv(self, dst: torch.Tensor, peer: int, tag: int) -> Work:
        _check_view(dst, "irecv")
        work: Work = self.group.recv([dst], peer, tag)
        return work


class _Done:
    def __init__(self, timeout: float) -> None:
        self.event = threading.Event()
        self.timeout = timeout
        self.waited = False

    def wait(self) -> None:
        # gloo blocks forever on a second wait of the same work: make that bug loud here too.
        if self.waited:
            raise RuntimeError("a transport work was waited twice (gloo would block forever)")
        self.waited = True
        if not self.event.wait(self.timeout):
            raise TimeoutError(
                f"loopback message not matched within {self.timeout} s (a peer never posted it)"
            )


class LoopbackHub:
    """Shared state of one in-process world; make one ``Loopback`` per rank with ``hub.rank(r)``."""

    def __init__(self, world_size: int, *, timeout: float = 30.0) -> None:
        if world_size < 1:
            raise ValueError(f"world_size must be >= 1, got {world_size}")
        self.world_size = world_size
        self.timeout = timeout
        self._lock = threading.Lock()
        self._sends: dict[tuple[int, int, int], deque[tuple[torch.Tensor, _Done]]] = defaultdict(deque)
        self._recvs: dict[tuple[int, int, int], deque[tuple[torch.Tensor, _Done]]] = defaultdict(deque)

    def rank(self, rank: int) -> Loopback:
        return Loopback(self, rank)

    def _post(self, key: tuple[int, int, int], t: torch.Tensor, is_send: bool) -> _Done:
        done = _Done(self.timeout)
        mine, theirs = (self._sends, self._recvs) if is_send else (self._recvs, self._sends)
        with self._lock:
            if theirs[key]:
                other, other_done = theirs[key].popleft()
                src, dst = (t, other) if is_send else (other, t)
                if src.shape != dst.shape or src.dtype != dst.dtype:
                    raise ValueError(
                        f"loopback message {key}: sent {src.dtype}{tuple(src.shape)}, "
                        f"receiver posted {dst.dtype}{tuple(dst.shape)}"
                    )
                dst.copy_(src)
                done.event.set()
                other_done.event.set()
            else:
                mine[key].append((t, done))
        return done


class Loopback:
    """One rank of a ``LoopbackHub`` world."""

    def __init__(self, hub: LoopbackHub, rank: int) -> None:
        if not 0 <= rank < hub.world_size:
            raise ValueError(f"rank {rank} is outside world_size {hub.world_size}")
        self.hub = hub
        self.rank = rank
        self.world_size = hub.world_size
        self.stats = WireStats()

    def isend(self, src: torch.Tensor, peer: int, tag: int) -> Work:
        _check_view(src, "isend")
        self.stats.add(src)
        return self.hub._post((self.rank, peer, tag), src, True)

    def irecv(self, dst: torch.Tensor, peer: int, tag: int) -> Work:
        _check_view(dst, "irecv")
        return self.hub._post((peer, self.rank, tag), dst, False)


MIN_NCCL = (2, 18)
"""Grouped P2P on tensor views works from here on; the paper's zero-SM APIs (2.29-2.31+) are not used."""


def nccl_version() -> tuple[int, ...]:
    """NCCL's version as a tuple, ``(0,)`` without CUDA or NCCL."""
    try:
        v = torch.cuda.nccl.version()
    except Exception:  # a CPU build has no NCCL
        return (0,)
    return tuple(v) if isinstance(v, tuple) else (v // 10000, v // 100 % 100, v % 100)


def select_transport(group: Any, device: torch.device) -> ProcessGroupP2P:
    """The P2P transport for ``group`` on ``device``; says what to change when the pair is unsupported."""
    backend = str(group.name() if hasattr(group, "name") else "").lower()
    if device.type == "cpu":
        if "gloo" not in backend:
            raise ValueError(f"CPU tensors need a gloo group for TIDE's P2P, got backend {backend!r}")
        return ProcessGroupP2P(group)
    if device.type == "cuda":
        if "nccl" not in backend:
            raise ValueError(f"CUDA tensors need an NCCL group for TIDE's P2P, got backend {backend!r}")
        if not torch.cuda.is_available():
            raise ValueError("an NCCL group without CUDA: TIDE's GPU path needs a CUDA build and device")
        version = nccl_version()
        if version < MIN_NCCL:
            raise ValueError(f"NCCL {version} is older than {MIN_NCCL}, the oldest TIDE's P2P path supports")
        return ProcessGroupP2P(group)
    raise ValueError(
        f"TIDE has no transport for device type {device.type!r} (supported: cpu+gloo, cuda+nccl)"
    )
