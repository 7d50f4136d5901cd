"""The worker process of the evaluation pool, and the sandbox each candidate runs in.

Process tree, per pool worker::

    pool (caller) --pipes--> worker  (`python -m steptune.kernels.sandbox`: torch imported once, child
                                      subreaper, dies with the pool; by default forked from the pool's
                                      template, `... sandbox ROOT --template FD`: see spawn.py)
                               └── fork per candidate --> child (own session, fresh working dir, rlimits,
                                      no network, unprivileged uid, pinned core) runs evaluate.run_job

Contract:
- The worker never runs candidate code itself; it forks a child per job (copy-on-write, ~30 ms, so torch is
  not re-imported) and judges the child from outside: its result file, exit status, signal, rusage, and the
  time and memory it used. A segfault, abort, hang, `os._exit`, or memory blow-up ends only that child.
- The worker is a child subreaper (PR_SET_CHILD_SUBREAPER), so every process a candidate starts, even a
  double-forked daemon in a new session, is re-parented to it when the child ends; they are all SIGKILLed and
  reaped before the next job, and a candidate that left any is rejected.
- The worker must not run a torch op before forking (OpenMP/CUDA state does not survive fork), and it writes
  nothing to stdout but one JSON line per job: the child's fds 0-2 point at files in its working directory.
- Limits: wall time (SIGKILL), CPU time (RLIMIT_CPU), address space (RLIMIT_AS, CPU only: CUDA reserves huge
  virtual ranges) plus a resident-set check, file size, open files, core dumps off, and, as root, a new
  network namespace (no interfaces up) and uid/gid `nobody` with no-new-privs and a process cap.
What it does not give (see docs/kernels.md): no seccomp filter, no mount/PID namespace, no cgroup; the
child can read any file `nobody` can read.
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import os
import resource
import shutil
import signal
import sys
import time
from pathlib import Path
from typing import Any

__all__ = ["descendants", "main"]

_PR_SET_PDEATHSIG = 1
_PR_SET_CHILD_SUBREAPER = 36
_PR_SET_NO_NEW_PRIVS = 38
_PR_SET_DUMPABLE = 4
_PR_CAPBSET_DROP = 24
_CLONE_NEWNET = 0x40000000
_SYS_CAPSET = 126  # x86-64
_CLONE_NEWPID = 0x20000000
_NOBODY = 65534
_libc = ctypes.CDLL(None, use_errno=True)


def _ppids() -> dict[int, int]:
    out: dict[int, int] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    stat = f.read()
            except OSError:
                continue
            out[int(entry)] = int(stat.rsplit(")", 1)[1].split()[1])
    return out


def descendants(pid: int) -> list[int]:
    """Every live process below `pid` (from /proc's parent links)."""
    children: dict[int, list[int]] = {}
    for p, pp in _ppids().items():
        children.setdefault(pp, []).append(p)
    out, todo = [], list(children.get(pid, []))
    while todo:
        p = todo.pop()
        out.append(p)
        todo.extend(children.get(p, []))
    return out


def _rss_bytes(pid: int) -> int:
    try:
        with open(f"/proc/{pid}/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, IndexError, ValueError):
        return 0


def _tree_rss(pid: int) -> int:
    return max([_rss_bytes(pid), *(_rss_bytes(p) for p in descendants(pid))])


def _vm_size() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[0]) * os.sysconf("SC_PAGE_SIZE")


def _kill_leftovers() -> int:
    """SIGKILL and reap every process below this worker; returns how many there were."""
    me, seen = os.getpid(), set()
    deadline = time.monotonic() + 5.0
    while time.monotonic() < deadline:
        left = [p for p in descendants(me) if p not in seen or _alive(p)]
        for p in left:
            seen.add(p)
            with contextlib.suppress(ProcessLookupError):
                os.kill(p, signal.SIGKILL)
        with contextlib.suppress(ChildProcessError):
            while os.waitpid(-1, os.WNOHANG)[0] > 0:
                pass
        if not descendants(me):
            break
        time.sleep(0.005)
    return len(seen)


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def _drop_capabilities() -> None:
    """Keep uid 0 but drop every capability: without CAP_SYS_PTRACE the child cannot reopen the
    (non-dumpable) worker's result pipe through /proc, without CAP_SYS_ADMIN it cannot leave its
    namespaces."""
    for cap in range(64):
        _libc.prctl(_PR_CAPBSET_DROP, cap, 0, 0, 0)
    header = (ctypes.c_uint32 * 2)(0x20080522, 0)  # _LINUX_CAPABILITY_VERSION_3, this process
    data = (ctypes.c_uint32 * 6)()  # effective, permitted, inheritable x 2 words, all zero
    _libc.syscall(_SYS_CAPSET, header, data)


def _sandbox_child(job: dict[str, Any], workdir: Path) -> None:
    """In the forked child: isolate, limit, run the job, write result.json. Never returns."""
    code = 0
    try:
        os.setsid()
        _libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
        os.chdir(workdir)
        fd_in = os.open(os.devnull, os.O_RDONLY)
        fd_out = os.open(workdir / "output.log", os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        os.dup2(fd_in, 0)
        os.dup2(fd_out, 1)
        os.dup2(fd_out, 2)
        sys.stdout = open(1, "w", buffering=1, closefd=False)  # noqa: SIM115
        sys.stderr = sys.stdout
        lim = job["limits"]
        os.environ.update(
            TMPDIR=str(workdir),
            HOME=str(workdir),
            STEPTUNE_KERNELS_BUILD=lim["build_dir"],
            # load_inline builds are cached per pool, so a profile run reuses its validation's build
            TORCH_EXTENSIONS_DIR=os.path.join(lim["build_dir"], "torch_extensions"),
            # Triton resolved its home when the template imported it (as the pool's user): point its cache
            # at the pool's build dir, which the candidate's uid can write, and which a profile run reuses
            TRITON_HOME=lim["build_dir"],
            TRITON_CACHE_DIR=os.path.join(lim["build_dir"], "triton_cache"),
        )
        if lim.get("core") is not None:
            with contextlib.suppress(OSError):
                os.sched_setaffinity(0, {int(lim["core"])})
        is_root = os.geteuid() == 0
        if lim.get("isolate_network") and is_root and _libc.unshare(_CLONE_NEWNET) != 0:
            raise OSError(ctypes.get_errno(), "unshare(CLONE_NEWNET) failed")
        resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
        cpu = int(lim["cpu_s"])
        resource.setrlimit(resource.RLIMIT_CPU, (cpu, cpu + 1))
        resource.setrlimit(resource.RLIMIT_FSIZE, (lim["file_bytes"], lim["file_bytes"]))
        resource.setrlimit(resource.RLIMIT_NOFILE, (256, 256))
        if job.get("device", "cpu") == "cpu" and lim.get("memory_bytes"):
            cap = _vm_size() + int(lim["memory_bytes"])
            resource.setrlimit(resource.RLIMIT_AS, (cap, cap))
        if lim.get("drop_privileges") and is_root and _NOBODY_OK:
            _libc.prctl(_PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0)
            resource.setrlimit(resource.RLIMIT_NPROC, (64, 64))
            os.setgroups([])
            os.setgid(_NOBODY)
            os.setuid(_NOBODY)
        elif is_root:
            _libc.prctl(_PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0)
            _drop_capabilities()
        from steptune.kernels.evaluate import run_job

        result = run_job(job, workdir)
        # Processes the candidate started and left (in a PID namespace the kernel would kill them silently
        # when this process ends, so they are counted here, while they still exist).
        left = [p for p in descendants(int(os.readlink("/proc/self"))) if _alive(p)]
        if left:
            note = f"left {len(left)} process(es) running (killed)"
            if result.get("verdict") in ("correct", "incorrect"):
                result.update(verdict="rejected", reason=note)
            else:
                result["reason"] = f"{result.get('reason', '')}; {note}".lstrip("; ")
            result["leftover_processes"] = len(left)
        isolated = bool(lim.get("isolate_network") and is_root)
        result["sandbox"] = {"uid": os.getuid(), "network_isolated": isolated}
        tmp = workdir / "result.json.tmp"
        tmp.write_text(json.dumps(result))
        os.replace(tmp, workdir / "result.json")
    except BaseException as exc:  # the sandbox's own failure: report it, the worker turns it into a verdict
        with contextlib.suppress(BaseException):
            (workdir / "sandbox_error.txt").write_text(f"{type(exc).__name__}: {exc}")
        code = 70
    finally:
        os._exit(code)


def _launch_in_pid_namespace(job: dict[str, Any], workdir: Path) -> None:
    """As root: this launcher process puts the sandbox child in a new PID namespace, as its process 1, and
    mirrors its exit. When the child ends, or the launcher or the worker is killed (death signals chain
    down), the kernel kills every process left in the namespace, daemons in new sessions included. Returns
    only if the namespace cannot be made (the caller then runs the child here, with the subreaper alone)."""
    _libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    if _libc.unshare(_CLONE_NEWPID) != 0:
        return
    child = os.fork()
    if child == 0:
        _sandbox_child(job, workdir)
    status = os.waitpid(child, 0)[1]
    if os.WIFSIGNALED(status):
        sig = os.WTERMSIG(status)
        signal.signal(sig, signal.SIG_DFL)
        os.kill(os.getpid(), sig)
    os._exit(os.WEXITSTATUS(status) if os.WIFEXITED(status) else 70)


def _tail(path: Path, n: int = 1500) -> str:
    try:
        data = path.read_bytes()
    except OSError:
        return ""
    return data[-n:].decode(errors="replace")


def _run(job: dict[str, Any], root: Path) -> dict[str, Any]:
    lim = job["limits"]
    workdir = Path(root) / f"job-{job['id']}"
    workdir.mkdir(parents=True)
    if lim.get("drop_privileges") and os.geteuid() == 0 and _NOBODY_OK:
        os.chown(workdir, _NOBODY, _NOBODY)
    t0 = time.monotonic()
    pid = os.fork()
    if pid == 0:
        # CUDA cannot initialise in a new PID namespace (cudaGetDeviceCount: error 304, seen on an H200):
        # a CUDA job keeps the subreaper alone
        if os.geteuid() == 0 and job.get("device", "cpu") != "cuda":
            _launch_in_pid_namespace(job, workdir)
        _sandbox_child(job, workdir)
    base_rss = _rss_bytes(os.getpid())
    deadline, killed = t0 + float(lim["timeout_s"]), ""
    status, usage = 0, None
    while True:
        got, status, usage = os.wait4(pid, os.WNOHANG)
        if got == pid:
            break
        now = time.monotonic()
        if now > deadline and not killed:
            killed = "timeout"
        elif lim.get("memory_bytes") and _tree_rss(pid) > base_rss + int(lim["memory_bytes"]) and not killed:
            killed = "memory"
        if killed:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(pid, signal.SIGKILL)
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
            _, status, usage = os.wait4(pid, 0)
            break
        time.sleep(0.002 if now - t0 < 0.5 else 0.01)
    wall = time.monotonic() - t0
    leftovers = _kill_leftovers()
    result_file = workdir / "result.json"
    output = _tail(workdir / "output.log")
    exited_cleanly = os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0
    if result_file.exists() and not killed and exited_cleanly:
        out = json.loads(result_file.read_text())
    elif killed == "timeout":
        out = {"verdict": "timeout", "reason": f"still running after {lim['timeout_s']:g} s (killed)"}
    elif killed == "memory":
        why = f"resident memory above {lim['memory_bytes'] / 2**20:.0f} MiB over the worker's (killed)"
        out = {"verdict": "resource_limit", "reason": why}
    elif os.WIFSIGNALED(status):
        sig = os.WTERMSIG(status)
        name = signal.Signals(sig).name if sig in signal.Signals.__members__.values() else str(sig)
        maxrss = usage.ru_maxrss * 1024 if usage else 0
        if sig == signal.SIGXCPU:
            out = {"verdict": "timeout", "reason": f"used more than {lim['cpu_s']} s of CPU time (SIGXCPU)"}
        elif lim.get("memory_bytes") and maxrss > 0.9 * (base_rss + int(lim["memory_bytes"])):
            why = f"killed by {name} at {maxrss / 2**20:.0f} MiB resident"
            out = {"verdict": "resource_limit", "reason": why}
        else:
            out = {"verdict": "crashed", "reason": f"killed by {name}"}
    else:
        code = os.WEXITSTATUS(status)
        err = _tail(workdir / "sandbox_error.txt")
        why = f"the sandbox failed: {err}" if err else f"exited with status {code} before reporting a result"
        if "MemoryError" in err:
            out = {"verdict": "resource_limit", "reason": f"ran out of memory: {err}"}
        else:
            out = {"verdict": "crashed", "reason": why}
    if leftovers and not killed:  # after our kill, what is left is the candidate dying, not a daemon
        note = f"left {leftovers} process(es) running (killed)"
        if out.get("verdict") in ("correct", "incorrect"):
            out.update(verdict="rejected", reason=note)
        else:
            out["reason"] = f"{out.get('reason', '')}; {note}".lstrip("; ")
    leftovers = max(leftovers, int(out.get("leftover_processes", 0)))
    out.update(id=job["id"], wall_s=wall, leftover_processes=leftovers, output_tail=output[-800:])
    out.setdefault("kind", job["kind"])
    if usage is not None:
        out["max_rss_bytes"] = usage.ru_maxrss * 1024
        out["cpu_s"] = usage.ru_utime + usage.ru_stime
    shutil.rmtree(workdir, ignore_errors=True)
    return out


_NOBODY_OK = False  # set by main(): whether uid `nobody` can read this interpreter and its packages


def _nobody_can_import() -> bool:
    """Fork a probe that becomes `nobody` and checks every import path is readable (a Python installed
    under /root, as on some build boxes, is not: dropping privileges there would break lazy imports)."""
    if os.geteuid() != 0:
        return False
    paths = [p for p in sys.path if p and os.path.exists(p)]
    pid = os.fork()
    if pid == 0:
        ok = False
        with contextlib.suppress(BaseException):
            os.setgroups([])
            os.setgid(_NOBODY)
            os.setuid(_NOBODY)
            ok = all(os.access(p, os.R_OK | os.X_OK) for p in paths)
        os._exit(0 if ok else 1)
    return os.waitpid(pid, 0)[1] == 0


def _become_worker() -> None:
    _libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    _libc.prctl(_PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)
    _libc.prctl(_PR_SET_DUMPABLE, 0, 0, 0, 0)  # its /proc/<pid>/fd (the result pipe) closed to children


def _import_once() -> None:
    global _NOBODY_OK
    import torch  # imported once here, shared copy-on-write by every child
    import torch._dynamo  # noqa: F401  (the first op under a dispatch mode imports it: 1.3 s per child)

    import steptune.kernels.evaluate  # noqa: F401

    _NOBODY_OK = _nobody_can_import()


def _serve(root: Path) -> None:
    """Worker loop: one JSON job per stdin line, one JSON result per stdout line."""
    print(json.dumps({"ready": os.getpid(), "can_drop_privileges": _NOBODY_OK}), flush=True)
    for line in sys.stdin:
        if not line.strip():
            continue
        job = json.loads(line)
        try:
            out = _run(job, root)
        except Exception as exc:  # a worker bug must not silently drop a job
            out = {"id": job.get("id"), "verdict": "crashed", "reason": f"worker error: {exc!r}"}
        print(json.dumps(out), flush=True)


def _reap(*_: object) -> None:
    with contextlib.suppress(ChildProcessError):
        while os.waitpid(-1, os.WNOHANG)[0] > 0:
            pass


def _template(root: Path, sock_fd: int) -> None:
    """Template loop: each message on the socket carries a worker's stdin (read end) and stdout (write
    end); fork a worker onto them and answer with its pid and a pidfd. Ends when the pool closes the
    socket; dies with the pool's template thread (death signal) and its workers die with it."""
    import socket

    _libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    _libc.prctl(_PR_SET_DUMPABLE, 0, 0, 0, 0)
    _import_once()
    sock = socket.socket(fileno=sock_fd)
    signal.signal(signal.SIGCHLD, _reap)
    print(json.dumps({"template": os.getpid(), "can_drop_privileges": _NOBODY_OK}), flush=True)
    while True:
        msg, fds, _, _ = socket.recv_fds(sock, 64, 2)
        if not msg or len(fds) != 2:
            return
        # SIGCHLD blocked until the pidfd is open: a worker that dies at once is not reaped (and its pid
        # reused) before then.
        signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGCHLD})
        try:
            pid = os.fork()
        except OSError as exc:  # EAGAIN, ENOMEM: this request fails, the template and its workers live on
            for fd in fds:
                os.close(fd)
            signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGCHLD})
            sock.send(f"fork failed: {exc}".encode())
            continue
        if pid == 0:
            code = 0
            try:
                signal.signal(signal.SIGCHLD, signal.SIG_DFL)
                signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGCHLD})
                sock.close()
                os.setsid()
                os.dup2(fds[0], 0)
                os.dup2(fds[1], 1)
                for fd in fds:
                    os.close(fd)
                _become_worker()
                _serve(root)
            except BaseException:
                code = 70
            finally:
                os._exit(code)
        pidfd = os.pidfd_open(pid)
        for fd in fds:
            os.close(fd)
        socket.send_fds(sock, [str(pid).encode()], [pidfd])
        os.close(pidfd)
        signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGCHLD})


def main() -> None:
    """`python -m steptune.kernels.sandbox ROOT` serves jobs on stdin/stdout;
    `python -m steptune.kernels.sandbox ROOT --template FD` forks such workers on request (pool.py)."""
    root = Path(sys.argv[1])
    if sys.argv[2:3] == ["--template"]:
        _template(root, int(sys.argv[3]))
        return
    _become_worker()
    _import_once()
    _serve(root)


if __name__ == "__main__":
    main()
