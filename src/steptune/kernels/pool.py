"""The evaluation pool: candidates in, verdicts out, on a set of sandboxed workers with roles and priorities.

Contract: `EvalPool` owns its workers (one `python -m steptune.kernels.sandbox` process each, forked from the
pool's pre-imported template unless `fork_workers=False`: spawn.py) and a scratch folder; `close()` (or
leaving the `with` block) kills the workers and the template and removes the folder. Requests carry a
kind (`validate`, `profile`) and a priority (higher runs first; ties in arrival order). A worker has a role
(`validate`, `profile` or `any`) that `set_roles` may change while the pool runs: a worker finishes the job
it holds and takes its next job by its new role, so a timing run is never preempted. If a worker process
dies (it should not: candidates run in its children) its job is reported as crashed and the worker restarts.
`submit` returns a `concurrent.futures.Future[Result]`; `evaluate` validates and, if correct, profiles.
Static checks run in the caller before a request is queued: they are cheap and never execute candidate code.
"""

from __future__ import annotations

import itertools
import json
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import warnings
import weakref
from concurrent.futures import Future
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Literal

from steptune.kernels.checks import static_check
from steptune.kernels.problems import Problem, load_problem
from steptune.kernels.spawn import ForkedWorker, Template, can_fork_workers

__all__ = ["VERDICTS", "EvalPool", "PoolConfig", "Result"]

VERDICTS = ("correct", "incorrect", "rejected", "crashed", "timeout", "compile_error", "resource_limit")
Kind = Literal["validate", "profile"]
Role = Literal["validate", "profile", "any"]


@dataclass(frozen=True, slots=True, kw_only=True)
class PoolConfig:
    """How many workers, what they may use, and how they check and time."""

    num_workers: int = 2
    """Worker processes (each runs one candidate at a time)."""
    roles: tuple[str, ...] | None = None
    """Initial role per worker (`validate`, `profile`, `any`); None means all `any`."""
    timeout_s: float = 60.0
    """Wall-clock limit per request, compile included."""
    cpu_s: int | None = None
    """CPU-time limit per request; default timeout_s + 5."""
    memory_bytes: int = 2 * 2**30
    """Memory a candidate may add above the worker's own footprint."""
    file_bytes: int = 256 * 2**20
    """Largest file a candidate may write."""
    isolate_network: bool = True
    """As root: run candidates in a new network namespace (no interfaces up)."""
    drop_privileges: bool = True
    """As root: run candidates as uid/gid `nobody` with no-new-privs and a process cap."""
    pin_cores: bool = True
    """Pin each worker's candidates to one core (worker i on core i mod the cores this process may use)."""
    static_checks: bool = True
    """Reject known cheats before running (turn off only to test the run-time checks)."""
    trials: int = 5
    """Validation trials, each with fresh seeded inputs."""
    rounds: int = 15
    """Profiling rounds (median of per-round reference/candidate ratios)."""
    round_s: float = 0.005
    """Time each side of a profiling round should last."""
    device: str = "cpu"
    """`cpu`, or `cuda` where a GPU is present (CUDA events and L2 flush)."""
    seed: int = 0
    """Seed of the validation draws (trial k: seed + 1000 + k)."""
    profile_seed: int | None = None
    """Seed of the profiling draws; None: a fresh secret per job (63 bits, in ``Result.extra``'s
    ``profile_seed`` to reproduce a run). A public one let a candidate precompute every draw's answer in
    its constructor and look it up while timed (about 6x on a matmul, past every other check)."""
    fork_workers: bool = True
    """Fork workers from one pre-imported template process (about 20 ms each, a dead worker replaced as
    fast) instead of starting each as a fresh interpreter (seconds: it imports torch). Linux only; where
    it cannot work the pool starts fresh interpreters."""

    def __post_init__(self) -> None:
        week, big = 7 * 86400, 2**48

        def bad(name: str, value: Any, ok: bool, rule: str) -> None:
            if not ok:
                raise ValueError(f"PoolConfig.{name} must be {rule}, got {value!r}")

        bad("num_workers", self.num_workers, self.num_workers >= 1, ">= 1")
        bad("timeout_s", self.timeout_s, 0 < self.timeout_s <= week, "in (0, 604800] seconds")
        bad("cpu_s", self.cpu_s, self.cpu_s is None or 1 <= self.cpu_s <= week, "None or 1..604800 seconds")
        bad("memory_bytes", self.memory_bytes, 1 <= self.memory_bytes <= big, "1 byte to 256 TiB")
        bad("file_bytes", self.file_bytes, 1 <= self.file_bytes <= big, "1 byte to 256 TiB")
        bad("trials", self.trials, self.trials >= 1, ">= 1 (0 would judge any candidate correct)")
        bad("rounds", self.rounds, self.rounds >= 1, ">= 1 (a profile is a median over rounds)")
        bad("round_s", self.round_s, 0 < self.round_s <= 60, "in (0, 60] seconds")


@dataclass(slots=True, kw_only=True)
class Result:
    """A verdict with its evidence. `speedup` is reference time / candidate time (profiled requests only)."""

    verdict: str
    reason: str = ""
    kind: str = "validate"
    speedup: float | None = None
    ref_time_s: float | None = None
    candidate_time_s: float | None = None
    max_abs_diff: float | None = None
    compile_s: float | None = None
    wall_s: float | None = None
    worker: int | None = None
    problem: str = ""
    extra: dict[str, Any] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(order=True)
class _Request:
    sort_key: tuple[int, int]
    kind: str = field(compare=False)
    problem: Problem = field(compare=False)
    source: str = field(compare=False)
    future: Future[Result] = field(compare=False)


_FIELDS = {
    "verdict", "reason", "kind", "speedup", "ref_time_s", "candidate_time_s", "max_abs_diff", "compile_s",
}  # fmt: skip


class _Worker:
    def __init__(self, pool: EvalPool, index: int, role: str) -> None:
        self.pool, self.index, self.role = pool, index, role
        self.proc: subprocess.Popen[str] | ForkedWorker | None = None
        self.template: Template | None = None
        """The template that forked ``proc`` (None for a fresh interpreter)."""
        self.busy = False
        self.jobs_done = 0
        self.thread = threading.Thread(target=self._loop, name=f"steptune-eval-{index}", daemon=True)

    def _start(self) -> subprocess.Popen[str] | ForkedWorker:
        proc: subprocess.Popen[str] | ForkedWorker | None = None
        failed: Template | None = None
        for _ in range(2):  # a template killed since it started gets one successor
            template = self.pool._template_for_workers(failed)
            if template is None:
                break
            try:
                proc = template.spawn()
                self.template = template
                break
            except RuntimeError as exc:
                if failed is not None:  # a new template fails too: fresh interpreters from now on
                    self.pool._stop_forking(f"a new evaluation template could not fork a worker ({exc})")
                failed = template
        if proc is None:
            proc, self.template = self._start_fresh(), None
        assert proc.stdout is not None
        ready = proc.stdout.readline()
        if not ready.startswith('{"ready"'):
            proc.kill()
            proc.wait()
            raise RuntimeError(f"evaluation worker {self.index} failed to start (got {ready!r})")
        self.pool.can_drop_privileges = bool(json.loads(ready).get("can_drop_privileges"))
        return proc

    def _start_fresh(self) -> subprocess.Popen[str]:
        return subprocess.Popen(
            [sys.executable, "-m", "steptune.kernels.sandbox", str(self.pool.root)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            text=True,
            env=self.pool._worker_env(),
            start_new_session=True,
        )

    def _loop(self) -> None:
        while True:
            req = self.pool._next(self)
            if req is None:
                return
            if not req.future.set_running_or_notify_cancel():  # the caller cancelled it while queued
                continue
            self.busy = True
            try:
                req.future.set_result(self._run(req))
            except BaseException as exc:
                req.future.set_exception(exc)
            finally:
                self.busy = False
                self.jobs_done += 1

    def _run(self, req: _Request, retried: bool = False) -> Result:
        if self.proc is None or self.proc.poll() is not None:
            self.proc = self._start()
        job = self.pool._job(req, self.index)
        if retried:
            job["id"] += "-again"
        assert self.proc.stdin is not None and self.proc.stdout is not None
        try:
            self.proc.stdin.write(json.dumps(job) + "\n")
            self.proc.stdin.flush()
            line = self.proc.stdout.readline()
        except (BrokenPipeError, OSError):
            line = ""
        if not line:  # the worker itself died: report, restart on the next request
            self.proc.kill()
            self.proc.wait()
            self.proc, template = None, self.template
            shutil.rmtree(self.pool.root / f"job-{job['id']}", ignore_errors=True)  # the dead worker's
            if not retried and template is not None and not template.alive():
                # It died with the pool's template (killed, or out of memory), which takes every busy
                # worker: run the request once more on a new one. A candidate that kills the template
                # itself does it again and is reported crashed.
                res = self._run(req, retried=True)
                res.extra["retried"] = "its first worker died with the pool's template"
                return res
            why = "the evaluation worker died"
            return Result(verdict="crashed", reason=why, kind=req.kind, worker=self.index)
        raw = json.loads(line)
        if raw.get("id") != job["id"]:  # a line the worker did not write for this job: trust nothing more
            self.proc.kill()
            self.proc.wait()
            self.proc = None
            why = f"the worker's result channel was tampered with (got a result for {raw.get('id')!r})"
            return Result(verdict="rejected", reason=why, kind=req.kind, worker=self.index)
        res = Result(**{k: raw[k] for k in _FIELDS if k in raw and raw[k] is not None})
        res.wall_s, res.worker, res.problem = raw.get("wall_s"), self.index, req.problem.name
        res.extra = {k: v for k, v in raw.items() if k not in _FIELDS and k not in ("id",)}
        return res

    def stop(self) -> None:
        proc = self.proc  # the worker's thread may be replacing it
        if proc is not None and proc.poll() is None:
            proc.kill()
            proc.wait()


class EvalPool:
    """Sandboxed evaluation workers with roles and a priority queue. Use as a context manager."""

    def __init__(self, config: PoolConfig | None = None) -> None:
        self.config = cfg = config or PoolConfig()
        if cfg.num_workers < 1:
            raise ValueError("num_workers must be at least 1")
        roles = list(cfg.roles or ["any"] * cfg.num_workers)
        if len(roles) != cfg.num_workers or any(r not in ("validate", "profile", "any") for r in roles):
            raise ValueError(f"roles must be {cfg.num_workers} of 'validate', 'profile', 'any'; got {roles}")
        self.root = Path(tempfile.mkdtemp(prefix="steptune-eval-"))
        # Removed by close(), and again when the pool is collected or the interpreter exits: for a pool
        # never closed, and after a Ctrl-C whose dying workers wrote into it after close() removed it
        weakref.finalize(self, shutil.rmtree, self.root, ignore_errors=True)
        self.build_dir = self.root / "build"
        self.build_dir.mkdir()
        os.chmod(self.root, 0o755)
        os.chmod(self.build_dir, 0o1777)  # sticky: unprivileged children share compiled kernels
        self._cores = sorted(os.sched_getaffinity(0))
        self._cv = threading.Condition()
        self._queue: list[_Request] = []
        self._seq = itertools.count()
        self._closed = False
        self.can_drop_privileges: bool | None = None
        """Known once a worker has started: False where uid `nobody` cannot read this Python (then
        candidates run with the caller's uid; docs/kernels.md)."""
        self._template: Template | None = None
        self._retired: list[Template] = []
        self._template_lock = threading.Lock()
        self._fork_error: str | None = None
        """Why this pool stopped forking workers from a template (None while it does)."""
        self.workers = [_Worker(self, i, r) for i, r in enumerate(roles)]
        for w in self.workers:
            w.thread.start()
        if cfg.fork_workers and can_fork_workers():
            # The template imports torch while the caller prepares its first candidates (an LLM is still
            # writing them): the first request then waits for a fork, not for an interpreter.
            threading.Thread(
                target=self._template_for_workers, name="steptune-eval-prestart", daemon=True
            ).start()

    # -- worker processes ----------------------------------------------------------------------------------
    def _worker_env(self) -> dict[str, str]:
        env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONDONTWRITEBYTECODE="1")
        if self.config.device == "cpu":
            # Triton on CPU tensors runs under its interpreter. It must be set before triton is imported,
            # and the worker imports it (through torch._dynamo) before any candidate runs.
            env["TRITON_INTERPRET"] = "1"
        src = str(Path(__file__).resolve().parents[2])  # so a source-tree run (PYTHONPATH=src) works too
        env["PYTHONPATH"] = os.pathsep.join([src, *filter(None, [env.get("PYTHONPATH")])])
        return env

    def _template_for_workers(self, failed: Template | None = None) -> Template | None:
        """The pool's template (started on first use; replaced when it is `failed` or dead), or None to
        start fresh interpreters."""
        if not self.config.fork_workers or self._fork_error is not None or not can_fork_workers():
            return None
        with self._template_lock:
            if self._closed:
                return None
            if self._template is not None and (self._template is failed or not self._template.alive()):
                if self._template.alive():  # it did not answer, but its workers may be busy: keep them
                    self._retired.append(self._template)
                else:
                    self._template.close()
                self._template = None
            if self._template is None:
                try:  # listed as soon as its process exists (template_pid), before it has imported
                    self._template = Template(self.root, self._worker_env(), on_start=self._set_template)
                except RuntimeError as exc:
                    self._template = None
                    if not self._closed:  # close() kills a template that is still importing
                        self._stop_forking(str(exc))
                    return None
            return self._template

    def _set_template(self, template: Template) -> None:
        self._template = template

    def _stop_forking(self, why: str) -> None:
        if self._fork_error is None:
            self._fork_error = why
            warnings.warn(
                f"{why}; this pool starts each worker as a fresh interpreter from now on (seconds each; "
                "PoolConfig(fork_workers=False) asks for that from the start)",
                RuntimeWarning,
                stacklevel=2,
            )

    @property
    def template_pid(self) -> int | None:
        """The template process's pid while it runs (None with fresh-interpreter workers)."""
        t = self._template
        return t.proc.pid if t is not None and t.alive() and t.proc is not None else None

    # -- queue -------------------------------------------------------------------------------------------
    def _next(self, worker: _Worker) -> _Request | None:
        with self._cv:
            while True:
                if self._closed:
                    return None
                fits = [r for r in self._queue if worker.role in ("any", r.kind)]
                if fits:
                    req = min(fits)
                    self._queue.remove(req)
                    return req
                self._cv.wait()

    def _job(self, req: _Request, index: int) -> dict[str, Any]:
        cfg = self.config
        p = req.problem
        return {
            "id": f"{index}-{req.sort_key[1]}",
            "kind": req.kind,
            "candidate": req.source,
            "problem": {
                "name": p.name,
                "source": p.source,
                "atol": p.atol,
                "rtol": p.rtol,
                "forbidden_ops": list(p.forbidden_ops) if p.forbidden_ops is not None else None,
                "seed": cfg.seed,
            },
            "trials": cfg.trials,
            "rounds": cfg.rounds,
            "profile_seed": cfg.profile_seed,
            "round_s": cfg.round_s,
            "device": cfg.device,
            "limits": {
                "timeout_s": cfg.timeout_s,
                "cpu_s": cfg.cpu_s or int(cfg.timeout_s) + 5,
                "memory_bytes": cfg.memory_bytes,
                "file_bytes": cfg.file_bytes,
                "isolate_network": cfg.isolate_network,
                "drop_privileges": cfg.drop_privileges,
                "build_dir": str(self.build_dir),
                "core": self._cores[index % len(self._cores)] if cfg.pin_cores else None,
            },
        }

    # -- public --------------------------------------------------------------------------------------------
    def submit(
        self, problem: Problem | str, source: str, *, kind: Kind = "validate", priority: int = 0
    ) -> Future[Result]:
        """Queue one request; the future resolves to its Result (never raises for a bad candidate)."""
        if kind not in ("validate", "profile"):
            raise ValueError(f"kind must be 'validate' or 'profile', got {kind!r}")
        prob = load_problem(problem) if isinstance(problem, str) else problem
        fut: Future[Result] = Future()
        if self.config.static_checks:
            findings = static_check(source)
            if findings:
                reason = "static check: " + "; ".join(map(str, findings[:5]))
                fut.set_result(Result(verdict="rejected", reason=reason, kind=kind, problem=prob.name))
                return fut
        with self._cv:
            if self._closed:
                raise RuntimeError("the pool is closed")
            self._queue.append(_Request((-priority, next(self._seq)), kind, prob, source, fut))
            self._cv.notify_all()
        return fut

    def evaluate(self, problem: Problem | str, source: str, *, priority: int = 0) -> Result:
        """Validate, then (if correct) profile; the profile's result carries the validation's max diff."""
        val = self.submit(problem, source, kind="validate", priority=priority).result()
        if val.verdict != "correct":
            return val
        prof = self.submit(problem, source, kind="profile", priority=priority).result()
        if prof.verdict == "correct":
            prof.max_abs_diff, prof.compile_s = val.max_abs_diff, val.compile_s
        return prof

    @property
    def roles(self) -> list[str]:
        return [w.role for w in self.workers]

    def set_roles(self, roles: list[str] | tuple[str, ...]) -> None:
        """Change worker roles while running; a busy worker keeps its current job."""
        if len(roles) != len(self.workers) or any(r not in ("validate", "profile", "any") for r in roles):
            n = len(self.workers)
            raise ValueError(f"roles must be {n} of 'validate', 'profile', 'any'; got {roles}")
        with self._cv:
            for w, r in zip(self.workers, roles, strict=True):
                w.role = r
            self._cv.notify_all()

    def queued(self) -> int:
        with self._cv:
            return len(self._queue)

    def worker_pids(self) -> list[int]:
        return [w.proc.pid for w in self.workers if w.proc is not None and w.proc.poll() is None]

    def close(self, *, wait: bool = True) -> None:
        """Stop the workers (after their current job; with ``wait=False``, as on Ctrl-C, at once), fail queued
        requests, remove the scratch folder."""
        with self._cv:
            self._closed = True
            pending, self._queue = self._queue, []
            self._cv.notify_all()
        for r in pending:
            if not r.future.cancelled():
                r.future.set_exception(RuntimeError("the pool was closed before this request ran"))
        if not wait:  # interrupted: end the running candidates instead of waiting out their timeouts
            for w in self.workers:
                w.stop()
        for w in self.workers:
            w.thread.join(timeout=self.config.timeout_s + 10 if wait else 10)
            w.stop()
        starting = self._template  # still importing if no worker needed it: killed, not waited for (the
        if starting is not None:  # thread that starts it holds the lock until it has imported)
            starting.close()
        with self._template_lock:
            for template in [*self._retired, *filter(None, [self._template])]:
                template.close()
            self._template, self._retired = None, []
        shutil.rmtree(self.root, ignore_errors=True)  # (the finalizer removes it once more, for a worker
        # killed on Ctrl-C that was still writing into it)

    def __enter__(self) -> EvalPool:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, *exc: object) -> None:
        interrupted = exc_type is not None and issubclass(exc_type, KeyboardInterrupt | SystemExit)
        self.close(wait=not interrupted)
