"""How the evaluation pool starts its worker processes: forked from a pre-imported template, or fresh.

A fresh worker is a new interpreter (`python -m steptune.kernels.sandbox`) that imports torch and
torch._dynamo: about 4 s of CPU on a 2-core box, paid again by every replacement of a dead worker. The
pool therefore starts one template per pool (`... sandbox ROOT --template FD`), which imports once and
forks each worker on request (about 20 ms): the pool makes the worker's two pipes, passes their ends over
a Unix socket, and receives the worker's pid and a pidfd, through which it polls, kills and waits on a
process that is not its child. Where that cannot work (no pidfd, the template fails to start) the pool
falls back to fresh interpreters, as `PoolConfig(fork_workers=False)` asks.

Contract:
- `Template` owns the template process and a thread that started it and lives until `close()`: the
  template's death signal fires when the thread that started it ends, so it is not started from a worker
  thread, which may end first. The template dies with that thread, the workers with the template.
- `Template.spawn` is thread-safe; each worker is a `ForkedWorker` with the slice of `subprocess.Popen`'s
  interface the pool uses (`pid`, `stdin`, `stdout`, `poll`, `kill`, `wait`). The template reaps workers;
  `poll` and `wait` read exit through the pidfd, so no exit status is known (`returncode` is -1).
- Both kinds of worker inherit the environment the pool gives them (`TRITON_INTERPRET` must be set
  before triton is imported, so a template serves one environment).
"""

from __future__ import annotations

import contextlib
import functools
import json
import os
import select
import signal
import socket
import subprocess
import sys
import threading
from collections.abc import Callable
from pathlib import Path
from typing import IO

__all__ = ["ForkedWorker", "Template", "can_fork_workers"]


@functools.cache
def can_fork_workers() -> bool:
    """Whether this platform has what the template needs (Linux pidfds, kernel 5.3+, and fd passing)."""
    needs = ((os, "pidfd_open"), (signal, "pidfd_send_signal"), (socket, "send_fds"))
    if not all(hasattr(module, name) for module, name in needs):
        return False
    try:
        os.close(os.pidfd_open(os.getpid()))
    except OSError:  # ENOSYS on kernels before 5.3, EPERM under some seccomp profiles
        return False
    return True


class ForkedWorker:
    """A worker forked by the template: pipes to it and a pidfd on it. Thread-safe like ``Popen``: the pidfd
    is closed only when the object is freed (never while another thread may poll or signal through it, and
    a pidfd never names another process), the pipes likewise (as ``Popen`` leaves them)."""

    def __init__(self, pid: int, pidfd: int, stdin: IO[str], stdout: IO[str]) -> None:
        self.pid, self._pidfd, self.stdin, self.stdout = pid, pidfd, stdin, stdout
        self.returncode: int | None = None

    def _wait_fd(self, timeout: float | None) -> bool:
        if self.returncode is None:
            poller = select.poll()  # not select.select: fd numbers above 1024 in a busy process
            poller.register(self._pidfd, select.POLLIN)
            if not poller.poll(None if timeout is None else int(timeout * 1000)):
                return False
            self.returncode = -1  # exited; the template reaps it, so the status is not known here
        return True

    def poll(self) -> int | None:
        self._wait_fd(0)
        return self.returncode

    def kill(self) -> None:
        if self.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                signal.pidfd_send_signal(self._pidfd, signal.SIGKILL)

    def wait(self, timeout: float | None = None) -> int:
        if not self._wait_fd(timeout):
            raise subprocess.TimeoutExpired(f"worker {self.pid}", timeout or 0.0)
        assert self.returncode is not None
        return self.returncode

    def __del__(self) -> None:
        with contextlib.suppress(OSError, AttributeError):
            os.close(self._pidfd)


class Template:
    """One pre-imported process per pool that forks its workers (see the module docstring)."""

    def __init__(
        self,
        root: Path,
        env: dict[str, str],
        start_timeout_s: float = 120.0,
        on_start: Callable[[Template], None] | None = None,
    ) -> None:
        """Start the template and wait until it has imported; ``on_start(self)`` runs before the wait (the
        pool lists the process as its own from then on)."""
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._started = threading.Event()
        self._error: BaseException | None = None
        self.proc: subprocess.Popen[str] | None = None
        self.can_drop_privileges = False
        self._sock: socket.socket | None = None
        self._broken = False
        self._thread = threading.Thread(
            target=self._own, args=(root, env), name="steptune-eval-template", daemon=True
        )
        self._thread.start()
        if on_start is not None:
            on_start(self)
        if not self._started.wait(start_timeout_s):
            if self.proc is not None:  # its thread is reading the ready line: EOF ends it
                self.proc.kill()
            self._stop.set()
            raise RuntimeError(f"the evaluation template did not start within {start_timeout_s:g} s")
        if self._error is not None:
            self._thread.join()
            raise RuntimeError(f"the evaluation template failed to start: {self._error}") from self._error

    def _own(self, root: Path, env: dict[str, str]) -> None:
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        fd = theirs.fileno()
        try:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "steptune.kernels.sandbox", str(root), "--template", str(fd)],
                stdin=subprocess.DEVNULL,
                stdout=subprocess.PIPE,
                stderr=subprocess.DEVNULL,
                text=True,
                env=env,
                pass_fds=[fd],
                start_new_session=True,
            )
            theirs.close()
            if self._stop.is_set():  # closed while Popen ran: close() may not have seen the process
                raise RuntimeError("closed while starting")
            assert self.proc.stdout is not None
            ready = self.proc.stdout.readline()
            if not ready.startswith('{"template"'):
                raise RuntimeError(f"got {ready!r}")
            self.can_drop_privileges = bool(json.loads(ready).get("can_drop_privileges"))
            self._sock = ours
        except BaseException as exc:
            self._error = exc
            ours.close()
            theirs.close()
            if self.proc is not None:
                self.proc.kill()
                self.proc.wait()
            self._started.set()
            return
        self._started.set()
        self._stop.wait()  # the template's death signal is tied to this thread: it ends at close()
        ours.close()
        self.proc.kill()
        self.proc.wait()

    def alive(self) -> bool:
        return self._error is None and not self._broken and self.proc is not None and self.proc.poll() is None

    def spawn(self, timeout_s: float = 30.0) -> ForkedWorker:
        """Fork one worker; raises RuntimeError when the template is gone or does not answer (then it is
        marked broken: a late answer must not be read as the next request's)."""
        w_in_r, w_in_w = os.pipe()
        w_out_r, w_out_w = os.pipe()
        fds: list[int] = []
        try:
            with self._lock:
                if self._sock is None or not self.alive():
                    raise RuntimeError("the evaluation template is not running")
                try:
                    self._sock.settimeout(timeout_s)
                    socket.send_fds(self._sock, [b"spawn"], [w_in_r, w_out_w])
                    msg, fds, _, _ = socket.recv_fds(self._sock, 64, 1)
                except OSError as exc:
                    self._broken = True
                    raise RuntimeError(f"the evaluation template did not answer: {exc!r}") from exc
                if not msg.isdigit() or len(fds) != 1:
                    self._broken = msg == b""
                    why = msg.decode(errors="replace") or "it closed its socket"
                    raise RuntimeError(f"the evaluation template could not fork a worker: {why}")
            os.set_inheritable(fds[0], False)
            pipes = open(w_in_w, "w"), open(w_out_r)  # noqa: SIM115  (the worker owns them)
            worker = ForkedWorker(int(msg), fds[0], *pipes)
        except BaseException:
            for fd in (w_in_w, w_out_r, *fds):
                with contextlib.suppress(OSError):
                    os.close(fd)
            raise
        finally:
            os.close(w_in_r)
            os.close(w_out_w)
        return worker

    def close(self) -> None:
        """Stop the template (its workers die with it); one still importing is killed, not waited for."""
        self._stop.set()
        proc = self.proc
        if proc is not None and not self._started.is_set():
            proc.kill()  # its thread is reading the ready line: EOF ends it
        self._thread.join(timeout=30)
