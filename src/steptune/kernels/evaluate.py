"""Validation and profiling of one candidate, run inside the sandboxed worker child (see sandbox.py).

Contract: `run_job` is called once per fresh child process, after the sandbox limits are set; it imports the
problem and the candidate from files in the child's working directory and returns a JSON-able result dict. It
never catches what it cannot classify: a crash, hang or blow-up ends the child, and the worker (which outlives
it) gives the verdict from the exit status.

Validation (KernelBench's protocol, hardened): the reference and the candidate are built from the same seed;
for each trial, fresh seeded inputs; the candidate runs FIRST, on its own copies placed between guard bytes,
under an op recorder; then the reference runs on separate copies. Checked: the floating-point mode
unchanged (no process-wide flush-to-zero from -ffast-math), output count, shape, dtype, NaN,
allclose at the problem's tolerance, inputs unmutated (bitwise), guard bytes intact (out-of-bounds writes),
output storage not an earlier output of either side (stale or stolen results), no threads left, and the
reference's op sequence not replayed by the candidate (a subsequence test over aten ops, plus the
problem's FORBIDDEN_OPS). Before the candidate is imported, the reference runs twice on one draw of inputs:
if it disagrees with itself beyond the tolerance (randomness or state in its forward, nondeterministic
atomics), the verdict is a problem error, not the candidate's (checked then, so no candidate code can cause
it).

Profiling: one validation trial first (profiling a wrong kernel is pointless), then warm-up and `rounds`
rounds in which reference and candidate are each timed over enough calls to last `round_s`, their order
alternating; speedup is the median of per-round ratios (paired: both see the same machine noise). On CUDA:
events per call with a 256 MB L2 flush between calls, as KernelBench does. Timed calls alternate between
two input draws with their version counters bumped, and a call on inputs overwritten in place follows the
rounds: a result memoized by input identity is stale there (a cache keyed by contents is not caught).
"""

from __future__ import annotations

import ast
import contextlib
import functools
import math
import os
import random
import statistics
import sys
import threading
import time
import traceback
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from steptune.kernels.agent import PROBLEM_ERROR
from steptune.kernels.problems import import_source, tolerance

__all__ = ["run_job"]

# Ops that move, view, allocate or convert data; they do not count as "calling the reference". Frozen: a
# candidate that reaches it cannot widen it.
_NON_COMPUTE = frozenset({
    "aten.empty", "aten.empty_like", "aten.empty_strided", "aten.zeros", "aten.zeros_like", "aten.ones",
    "aten.ones_like", "aten.full", "aten.full_like", "aten.fill_", "aten.zero_", "aten.copy_", "aten.clone",
    "aten.contiguous", "aten._to_copy", "aten.to", "aten.detach", "aten.alias", "aten.lift_fresh",
    "aten.view", "aten._unsafe_view", "aten.reshape", "aten.expand", "aten.permute", "aten.t",
    "aten.transpose", "aten.select", "aten.slice", "aten.unsqueeze", "aten.squeeze", "aten.as_strided",
    "aten.split", "aten.split_with_sizes", "aten.chunk", "aten.unbind", "aten.narrow", "aten.resize_",
    "aten.set_", "aten.is_same_size", "aten.sym_size", "aten.sym_stride", "aten.sym_numel",
    "aten.sym_storage_offset", "aten.size", "aten.stride", "aten.numel", "aten._local_scalar_dense",
})  # fmt: skip
_GUARD_BYTES = 4096
_KEEP_ALIVE: list[Any] = []
_perf_counter = time.perf_counter  # bound before any candidate runs: patching time cannot fake the timing


class _OpRecorder(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.ops: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        name = str(func.overloadpacket)
        if name not in _NON_COMPUTE:
            self.ops.append(name)
        return func(*args, **(kwargs or {}))


class _FPMode:
    """The x87 control word and the SSE control bits (MXCSR without its sticky exception flags), read with
    glibc's fegetenv. A library built with -ffast-math sets flush-to-zero and denormals-are-zero for the
    whole process when it is loaded (gcc links crtfastmath.o into it), which would change the reference's
    numerics too; a candidate that changes the mode is rejected and the mode restored. x86-64 glibc only."""

    def __init__(self) -> None:
        import ctypes
        import platform

        self._libm: Any = None
        if platform.machine() in ("x86_64", "AMD64"):
            with contextlib.suppress(OSError):
                self._libm = ctypes.CDLL("libm.so.6")
        self._buf = self._raw()

    def _raw(self) -> bytes | None:
        if self._libm is None:
            return None
        import ctypes

        buf = ctypes.create_string_buffer(64)
        return buf.raw if self._libm.fegetenv(buf) == 0 else None

    @staticmethod
    def _control(raw: bytes) -> tuple[int, int]:
        return int.from_bytes(raw[0:2], "little"), int.from_bytes(raw[28:32], "little") & ~0x3F

    def check_and_restore(self, when: str) -> None:
        now = self._raw()
        if self._buf is None or now is None or self._control(now) == self._control(self._buf):
            return
        import ctypes

        self._libm.fesetenv(ctypes.create_string_buffer(self._buf, 64))
        cw, mx = self._control(now)
        raise _Verdict(
            "rejected",
            f"{when} changed the process's floating-point mode (x87 {cw:#x}, MXCSR {mx:#x}; flush-to-zero or "
            "rounding), which changes every other kernel's results: build without -ffast-math/-Ofast "
            "(use -fno-math-errno, -ffinite-math-only, -fassociative-math ... instead)",
        )


class _Verdict(Exception):
    def __init__(self, verdict: str, reason: str, **extra: Any) -> None:
        super().__init__(reason)
        self.verdict, self.reason, self.extra = verdict, reason, extra


def _outputs(out: Any) -> list[Any]:
    return list(out) if isinstance(out, tuple | list) else [out]


def _is_subsequence(needle: Sequence[str], hay: Sequence[str]) -> bool:
    it = iter(hay)
    return all(any(h == n for h in it) for n in needle)


def _guarded(t: torch.Tensor, pattern: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A copy of `t` living between two guard regions of `pattern` bytes; returns (view, whole buffer)."""
    pad = _GUARD_BYTES // t.element_size()
    buf = torch.empty(t.numel() + 2 * pad, dtype=t.dtype, device=t.device)
    raw = buf.view(torch.uint8)
    raw[:_GUARD_BYTES].copy_(pattern)
    raw[-_GUARD_BYTES:].copy_(pattern)
    view = buf[pad : pad + t.numel()].view(t.shape)
    view.copy_(t)
    return view, buf


def _guards_intact(buf: torch.Tensor, pattern: torch.Tensor) -> bool:
    raw = buf.view(torch.uint8)
    return bool(torch.equal(raw[:_GUARD_BYTES], pattern) and torch.equal(raw[-_GUARD_BYTES:], pattern))


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    # reshape(-1) first: a 0-d tensor cannot be viewed as bytes
    return torch.equal(
        a.contiguous().reshape(-1).view(torch.uint8), b.contiguous().reshape(-1).view(torch.uint8)
    )


def _same_value(a: Any, b: Any) -> bool:
    """Bitwise for tensors, element by element inside lists, tuples and dicts, == otherwise."""
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and _same_bits(a, b)
    if isinstance(a, list | tuple) or isinstance(b, list | tuple):
        return (
            type(a) is type(b)
            and len(a) == len(b)
            and all(_same_value(x, y) for x, y in zip(a, b, strict=True))
        )
    if _is_array(a) or _is_array(b):  # numpy: == is elementwise, so bool() of it raised (found in review)
        import numpy as np

        return bool(_is_array(a) and _is_array(b) and np.array_equal(a, b, equal_nan=a.dtype.kind in "fc"))
    if isinstance(a, float) and isinstance(b, float) and math.isnan(a) and math.isnan(b):
        return True
    if isinstance(a, dict) or isinstance(b, dict):
        return (
            isinstance(a, dict)
            and isinstance(b, dict)
            and a.keys() == b.keys()
            and all(_same_value(a[k], b[k]) for k in a)
        )
    try:
        return bool(a == b)
    except Exception:  # an object whose == raises or is ambiguous: not provably the same
        return False


def _is_array(x: Any) -> bool:
    return type(x).__module__ == "numpy" and hasattr(x, "dtype") and hasattr(x, "shape")


def _rebuilt(x: list[Any] | tuple[Any, ...], items: list[Any]) -> Any:
    """A list or tuple of ``x``'s type holding ``items`` (a namedtuple takes them as arguments)."""
    return type(x)(*items) if hasattr(x, "_fields") else type(x)(items)


def _to(x: Any, device: str) -> Any:
    if isinstance(x, torch.Tensor):
        return x.to(device)
    if isinstance(x, list | tuple):
        return _rebuilt(x, [_to(v, device) for v in x])
    if isinstance(x, dict):
        return {k: _to(v, device) for k, v in x.items()}
    return x


def _clone(x: Any) -> Any:
    """A deep copy of tensors, also inside lists, tuples and dicts (a list input shared between the
    candidate's copy and the reference's let a candidate change what the reference saw)."""
    if isinstance(x, torch.Tensor):
        return x.clone()
    if _is_array(x):
        return x.copy()
    if isinstance(x, list | tuple):
        return _rebuilt(x, [_clone(v) for v in x])
    if isinstance(x, dict):
        return {k: _clone(v) for k, v in x.items()}
    return x


def _clones(xs: list[Any]) -> list[Any]:
    return [_clone(x) for x in xs]


def _seed_all(seed: int) -> None:
    """Seed every RNG a problem's get_inputs may draw from: torch's, Python's and numpy's."""
    torch.manual_seed(seed)
    random.seed(seed)
    with contextlib.suppress(ImportError):
        import numpy as np

        np.random.seed(seed % 2**32)


_URANDOM = os.urandom

_WATCHED = (
    "os",
    "random",
    "torch",
    "torch.nn",
    "torch.nn.functional",
    "torch.linalg",
    "torch.fft",
    "torch.special",
    "time",
    __name__,
    "steptune.kernels.problems",
)  # this module's own checks and clock, too


class _Namespaces:
    """What the names in torch's public namespaces (and Tensor's and Module's methods) are bound to,
    taken before the candidate is imported. A candidate that rebinds one (``torch.softmax = ...``) changes
    what the reference and its timing run: rejected. Names added later (lazy submodules) are ignored."""

    def __init__(self) -> None:
        spaces = [(m, vars(sys.modules[m])) for m in _WATCHED if m in sys.modules]
        spaces += [("torch.Tensor", vars(torch.Tensor)), ("torch.nn.Module", vars(torch.nn.Module))]
        # and this module's own classes (a review: _Namespaces.check replaced on the class went unseen)
        own = [
            c
            for c in vars(sys.modules[__name__]).values()
            if isinstance(c, type) and c.__module__ == __name__
        ]
        spaces += [(f"{__name__}.{c.__qualname__}", vars(c)) for c in own]
        self._spaces = [(where, space, {k: id(v) for k, v in space.items()}) for where, space in spaces]

    def check(self, when: str) -> None:
        for where, space, ids in self._spaces:
            for name, ident in ids.items():
                now = space.get(name, _MISSING)
                # torch rebinds some names itself (torch.compile's dynamo wraps Module.__init__ and
                # manual_seed): a new binding from torch's own modules is not the candidate's patch
                if id(now) != ident and not (
                    where.startswith("torch") and str(getattr(now, "__module__", "")).startswith("torch")
                ):
                    raise _Verdict(
                        "rejected",
                        f"{when} rebinds {where}.{name}, which the reference and the timing use too: a "
                        "kernel may not patch torch",
                    )


_MISSING = object()

# torch.nn.Module's global hook registries: a hook there runs inside the reference too (and in its timing)
_GLOBAL_HOOKS = (
    "_global_forward_pre_hooks", "_global_forward_hooks", "_global_forward_hooks_with_kwargs",
    "_global_forward_hooks_always_called", "_global_backward_pre_hooks", "_global_backward_hooks",
    "_global_buffer_registration_hooks", "_global_module_registration_hooks",
    "_global_parameter_registration_hooks",
)  # fmt: skip


def _torch_state() -> dict[str, Any]:
    """Process-wide torch settings that change what the reference computes or how fast it runs."""
    import torch.nn.modules.module as module_mod

    reads: dict[str, Callable[[], Any]] = {
        "the default dtype": torch.get_default_dtype,
        "grad mode": torch.is_grad_enabled,
        "inference mode": torch.is_inference_mode_enabled,
        "the intra-op thread count": torch.get_num_threads,
        "deterministic algorithms": torch.are_deterministic_algorithms_enabled,
        "the fp32 matmul precision": torch.get_float32_matmul_precision,
        "the fp32 precision settings": lambda: (
            getattr(torch.backends, "fp32_precision", None),
            getattr(getattr(torch.backends.cuda, "matmul", None), "fp32_precision", None),
        ),
        "mkldnn": lambda: torch.backends.mkldnn.enabled,
        "the default device": lambda: str(torch.get_default_device()),
        "the torch-function mode stack": torch._C._len_torch_function_stack,
        "the dispatch mode stack": torch._C._len_torch_dispatch_stack,
    }
    if torch.cuda.is_available():
        reads |= {
            "cudnn": lambda: (torch.backends.cudnn.enabled, torch.backends.cudnn.benchmark,
                              torch.backends.cudnn.deterministic, torch.backends.cudnn.allow_tf32),
            "TF32 matmuls": lambda: torch.backends.cuda.matmul.allow_tf32,
        }  # fmt: skip
    state: dict[str, Any] = {}
    for what, read in reads.items():
        try:  # a legacy read raises once the new fp32_precision API is in use (torch 2.9+): record that
            state[what] = read()
        except RuntimeError as exc:
            state[what] = f"unreadable: {str(exc)[:120]}"
    for name in _GLOBAL_HOOKS:
        hooks = getattr(module_mod, name, None)
        if hooks is not None:
            state[f"torch.nn.modules.module.{name}"] = tuple(hooks)
    return state


def _check_state(before: dict[str, Any], when: str) -> None:
    """Reject a candidate that changed a process-wide torch setting: the reference and its timing run
    under it too (a global module hook slowed the reference 7x; a lower default dtype widened the
    tolerance of a float output)."""
    now = _torch_state()
    changed = [k for k in before if now.get(k, _MISSING) != before[k]]
    if changed:
        k = changed[0]
        raise _Verdict(
            "rejected",
            f"{when} changed {k} ({before[k]!r} -> {now.get(k)!r}), which the reference and the timing "
            "run under too: a kernel must leave torch's global settings as it found them (use a context "
            "manager)",
        )


def _check_types(out_c: Any, out_r: Any) -> None:
    """Each tensor output must be a plain ``torch.Tensor`` (or the reference's own type): a subclass's
    ``__torch_function__`` runs inside the evaluator's own checks (one answered ``allclose`` with True)."""
    outs_r = _outputs(out_r)
    for k, c in enumerate(_outputs(out_c)):
        r = outs_r[k] if k < len(outs_r) else None
        if isinstance(c, torch.Tensor) and type(c) is not torch.Tensor and type(c) is not type(r):
            raise _Verdict(
                "rejected",
                f"output {k} is a {type(c).__qualname__}, a tensor subclass: return a plain torch.Tensor "
                "(a subclass can change how the evaluator's own comparisons behave)",
            )


@dataclass
class _Prepared:
    """Everything computed before the candidate is imported: no candidate code can change it."""

    prob: Any
    ref: Any
    init: list[Any]
    trials: list[tuple[list[Any], Any]]
    """Per validation trial: (pristine inputs, the reference's output on a copy of them)."""
    ref_ops: list[str]
    """The reference's compute ops in trial 0."""
    profile: list[tuple[list[Any], Any]] | None
    """The profiling draws (``_PROFILE_DRAWS`` timed ones, then ``_UNSEEN_DRAWS`` called once each after the
    rounds) and the reference's output on each."""
    namespaces: _Namespaces


def _prepare(
    problem: dict[str, Any], workdir: Path, device: str, trials: int, profile_seed: int | None
) -> _Prepared:
    """Import the problem and run the reference on every draw of inputs the evaluation will use (the
    profiling draws, seeded ``profile_seed + 100 k``, only with a ``profile_seed``). Any failure here is
    the problem's, not the candidate's: a problem error."""
    seed = int(problem.get("seed", 0))
    try:  # the problem's own failures are not the candidate's: they say so (the CLI makes them usage errors)
        prob = import_source(problem["source"], workdir / "problem.py", "steptune_problem")
        _seed_all(seed)
        init = prob.get_init_inputs()
        ref = prob.Model(*init).to(device).eval()
        with torch.no_grad():  # warm the reference (lazy thread pools) before counting threads
            drawn = _to(list(_draw(prob, "the warm-up draw")), device)
            first = _call(ref, _clones(drawn), "the reference")
            # ... and check it is deterministic, before any candidate code runs in this process
            _check_reference_stable(problem, first, _call(ref, _clones(drawn), "the reference"))
            cases, ops = [], []
            for trial in range(trials):
                _seed_all(seed + 1000 + trial)
                inputs = _to(list(_draw(prob, f"trial {trial}'s draw")), device)
                rec = _OpRecorder()
                with rec:
                    out = _call(ref, _clones(inputs), f"the reference (trial {trial})")
                ops = ops or rec.ops
                cases.append((inputs, out))
            timed = None
            if profile_seed is not None:
                timed = _seeded_draws(
                    prob, ref, device, profile_seed, _PROFILE_DRAWS + _UNSEEN_DRAWS, "profiling"
                )
                # the RNGs keep their last seed (torch.initial_seed()), which gave the secret one away to the
                # candidate's module code (a review: a lookup of every profiling draw, 2.35x, credited)
                _seed_all(seed)
    except MemoryError:
        raise
    except _Verdict as v:
        raise _Verdict(v.verdict, f"{PROBLEM_ERROR}{v.reason}") from v
    except Exception as exc:
        raise _Verdict(
            "crashed", f"{PROBLEM_ERROR}building the reference raised {type(exc).__name__}: {exc}"
        ) from exc
    return _Prepared(prob, ref, init, cases, ops, timed, _Namespaces())


def _secret_seed() -> int:
    """63 bits from the OS, through a function bound when this module was imported: a red team fixed
    ``secrets.randbits`` by rebinding ``random._urandom`` from the candidate's module code."""
    return int.from_bytes(_URANDOM(8), "little") >> 1


def _more_draws(prep: _Prepared, device: str, count: int, seed: int) -> list[tuple[list[Any], Any]]:
    """``count`` more profiling draws from ``seed`` (secret, drawn before the candidate was imported),
    with the reference's output on each: drawn after the candidate ran (checked first for rebound
    namespaces), only to confirm a flag, so their memory is not held through every profile."""
    prep.namespaces.check("the candidate, before its second look on unseen draws,")
    with torch.no_grad():
        out = _seeded_draws(prep.prob, prep.ref, device, seed, count, "second-look")
    _seed_all(_secret_seed())
    return out


def _seeded_draws(
    prob: Any, ref: Any, device: str, seed: int, count: int, what: str
) -> list[tuple[list[Any], Any]]:
    """``count`` draws of inputs (draw k seeded ``seed + 100 k``) and the reference's output on each."""
    out = []
    for k in range(count):
        _seed_all(seed + 100 * k)
        inputs = _to(list(_draw(prob, f"{what} draw {k}")), device)
        out.append((inputs, _call(ref, _clones(inputs), f"the reference ({what} draw {k})")))
    return out


def _draw(prob: Any, what: str) -> list[Any]:
    try:
        return list(prob.get_inputs())
    except MemoryError:
        raise
    except Exception as exc:
        raise _Verdict("crashed", f"get_inputs() raised {type(exc).__name__} in {what}: {exc}") from exc


def _build(
    problem: dict[str, Any], candidate: str, workdir: Path, device: str, fp_mode: _FPMode, prep: _Prepared
) -> tuple[Any, float, tuple[int, int]]:
    # The thread baseline is taken before the candidate is imported: a library constructor that starts a
    # thread at load time must not hide in it.
    baseline = (threading.active_count(), len(os.listdir("/proc/self/task")))
    state = _torch_state()
    t0 = _perf_counter()
    try:
        cand = import_source(candidate, workdir / "candidate.py", "steptune_candidate")
    except MemoryError:
        raise
    except SyntaxError as exc:
        raise _Verdict("compile_error", f"syntax error: {exc}") from exc
    except Exception as exc:
        log = getattr(exc, "log", "")
        kind = "the C compiler failed" if log else f"importing the candidate raised {type(exc).__name__}"
        raise _Verdict("compile_error", f"{kind}: {str(exc)[-1500:]}") from exc
    compile_s = _perf_counter() - t0
    fp_mode.check_and_restore("importing the candidate")
    prep.namespaces.check("importing the candidate")
    _check_state(state, "importing the candidate")
    if not hasattr(cand, "ModelNew"):
        raise _Verdict("compile_error", "the candidate defines no ModelNew class")
    _seed_all(int(problem.get("seed", 0)))  # the same parameters as the reference (which numpy may draw)
    try:
        new = cand.ModelNew(*prep.init).to(device).eval()
    except MemoryError:
        raise
    except Exception as exc:
        raise _Verdict("crashed", f"ModelNew(...) raised {type(exc).__name__}: {exc}") from exc
    prep.namespaces.check("ModelNew(...)")
    _check_state(state, "ModelNew(...)")
    return new, compile_s, baseline


def _call(fn: Callable[..., Any], args: list[Any], what: str) -> Any:
    try:
        return fn(*args)
    except MemoryError:
        raise
    except Exception as exc:
        if "can't allocate memory" in str(exc) or "out of memory" in str(exc).lower():
            raise _Verdict("resource_limit", f"{what} ran out of memory: {str(exc)[:300]}") from exc
        raise _Verdict("crashed", f"{what} raised {type(exc).__name__}: {exc}\n{_where(exc)}") from exc


def _where(exc: BaseException) -> str:
    """The candidate's and the problem's own frames of the traceback (the evaluator's, the op recorder's
    and torch's hid the failing line), innermost last; torch's last frames if neither file is in it."""
    frames = traceback.extract_tb(exc.__traceback__)
    own = [f for f in frames if Path(f.filename).name in ("candidate.py", "problem.py")]
    return "".join(traceback.format_list(own[-6:] or frames[-3:]))[-1500:]


def _validate(
    new: Any,
    prep: _Prepared,
    problem: dict[str, Any],
    device: str,
    fp_mode: _FPMode,
    baseline: tuple[int, int],
) -> dict[str, Any]:
    seed = int(problem.get("seed", 0))
    forbidden = problem.get("forbidden_ops")
    # Every output seen, kept alive so no new tensor can reuse their memory; the reference's are all known
    # before the candidate runs, so none of them can be handed back as the candidate's.
    outs_alive: list[torch.Tensor] = [t for _, out in prep.trials for t in _outputs(out) if _is_data(t)]
    if prep.profile is not None:
        outs_alive += [t for _, out in prep.profile for t in _outputs(out) if _is_data(t)]
    ref_ptrs = {t.untyped_storage().data_ptr() for t in outs_alive}
    cand_ptrs: set[int] = set()
    ref_ops = prep.ref_ops
    max_diff = 0.0
    gen = torch.Generator().manual_seed(seed ^ 0x5EED)
    pattern = torch.randint(0, 256, (_GUARD_BYTES,), dtype=torch.uint8, generator=gen).to(device)
    with torch.no_grad():
        base_threads, base_tasks = baseline
        for trial, (pristine, out_r) in enumerate(prep.trials):
            cand_in: list[Any] = []
            guards: list[tuple[int, torch.Tensor]] = []
            for i, x in enumerate(pristine):
                if isinstance(x, torch.Tensor) and x.is_contiguous() and x.numel() > 0:
                    view, buf = _guarded(x, pattern)
                    cand_in.append(view)
                    guards.append((i, buf))
                else:
                    cand_in.append(_clone(x))
            rec = _OpRecorder()
            state = _torch_state()
            with rec:
                out_c = _call(new, cand_in, "the candidate")
            fp_mode.check_and_restore("the candidate")
            prep.namespaces.check("the candidate")
            _check_state(state, "the candidate")
            _check_types(out_c, out_r)
            if device == "cuda":
                torch.cuda.synchronize()
            for i, buf in guards:
                if not _guards_intact(buf, pattern):
                    raise _Verdict("crashed", f"out-of-bounds write: guard bytes around input {i} changed")
            if threading.active_count() > base_threads or len(os.listdir("/proc/self/task")) > base_tasks:
                # its thread may still be writing to these: keep them alive until the process ends
                _KEEP_ALIVE.append((cand_in, guards, out_c))
                raise _Verdict("rejected", "the candidate left threads running")
            for i, (x, p) in enumerate(zip(cand_in, pristine, strict=True)):
                if not _same_value(x, p):
                    raise _Verdict("incorrect", f"the candidate mutated input {i}")
            hit = sorted({op for op in rec.ops if forbidden and op in forbidden})
            if hit:
                raise _Verdict("rejected", f"the candidate calls forbidden op(s) {', '.join(hit)}")
            if forbidden is None and ref_ops and _is_subsequence(ref_ops, rec.ops):
                raise _Verdict(
                    "rejected",
                    f"the candidate replays the reference's own ops ({' -> '.join(ref_ops[:6])}"
                    f"{' ...' if len(ref_ops) > 6 else ''}) instead of implementing them",
                )
            for k, c in enumerate(_outputs(out_c)):
                if not _is_data(c):
                    continue
                ptr = c.untyped_storage().data_ptr()
                if ptr in ref_ptrs:
                    raise _Verdict("rejected", f"output {k} is one of the reference's outputs")
                if ptr in cand_ptrs:
                    raise _Verdict(
                        "rejected",
                        f"output {k} is its own output from an earlier trial (outputs must be fresh)",
                    )
            max_diff = max(max_diff, _compare(out_c, out_r, problem, f"trial {trial}"))
            for t in _outputs(out_c):
                if _is_data(t):
                    outs_alive.append(t)
                    cand_ptrs.add(t.untyped_storage().data_ptr())
    return {"max_abs_diff": max_diff, "trials": len(prep.trials), "ref_ops": ref_ops[:20]}


def _is_data(t: Any) -> bool:
    return isinstance(t, torch.Tensor) and t.numel() > 0


def _compare(out_c: Any, out_r: Any, problem: dict[str, Any], where: str) -> float:
    """Raise an ``incorrect`` verdict unless the candidate's output matches the reference's; returns the
    largest absolute difference of its floating-point outputs."""
    if isinstance(out_c, tuple | list) != isinstance(out_r, tuple | list):
        what = {True: "a sequence of outputs", False: "a single output"}
        raise _Verdict(
            "incorrect",
            f"returns {what[isinstance(out_c, tuple | list)]} ({type(out_c).__name__}) where the "
            f"reference returns {what[isinstance(out_r, tuple | list)]} ({type(out_r).__name__}): "
            "a drop-in replacement must return the same structure",
        )
    _check_types(out_c, out_r)
    outs_c, outs_r = _outputs(out_c), _outputs(out_r)
    if len(outs_c) != len(outs_r):
        raise _Verdict("incorrect", f"returned {len(outs_c)} outputs, the reference {len(outs_r)}")
    max_diff = 0.0
    for k, (c, r) in enumerate(zip(outs_c, outs_r, strict=True)):
        if isinstance(c, torch.Tensor) != isinstance(r, torch.Tensor):
            raise _Verdict(
                "incorrect", f"output {k} is a {type(c).__name__}, the reference gives a {type(r).__name__}"
            )
        if not isinstance(r, torch.Tensor):
            _compare_value(k, c, r, problem, where)
            continue
        if c.shape != r.shape:
            raise _Verdict("incorrect", f"output {k} has shape {tuple(c.shape)}, not {tuple(r.shape)}")
        if c.dtype != r.dtype:
            raise _Verdict("incorrect", f"output {k} has dtype {c.dtype}, expected {r.dtype}")
        if c.device != r.device:
            raise _Verdict("incorrect", f"output {k} is on {c.device}, expected {r.device}")
        if r.is_floating_point() or r.is_complex():
            atol, rtol = _tolerances(problem, r.dtype)
            bad_nan = torch.isnan(c) & ~torch.isnan(r)
            if bool(bad_nan.any()):
                raise _Verdict(
                    "incorrect", f"output {k} has {int(bad_nan.sum())} NaN where the reference has none"
                )
            wide = torch.complex128 if r.is_complex() else torch.float64
            diff = (c.to(wide) - r.to(wide)).abs()
            diff = diff[~(torch.isnan(c) & torch.isnan(r))]
            d = float(diff.max()) if diff.numel() else 0.0
            max_diff = max(max_diff, d)
            if not torch.allclose(c, r, atol=atol, rtol=rtol, equal_nan=True):
                raise _Verdict(
                    "incorrect",
                    f"output {k} differs from the reference in {where}: max abs diff {d:.3g} "
                    f"(atol {atol:g}, rtol {rtol:g})",
                    max_abs_diff=d,
                )
        elif not torch.equal(c, r):
            n = int((c != r).sum())
            raise _Verdict(
                "incorrect", f"output {k} differs from the reference in {where}: {n} of {r.numel()} elements"
            )
    return max_diff


def _compare_value(k: int, c: Any, r: Any, problem: dict[str, Any], where: str) -> None:
    """A non-tensor output: a Python float within the default dtype's tolerance, anything else equal."""
    numbers = (int, float)
    if isinstance(r, float) and isinstance(c, numbers) and not isinstance(c, bool):
        atol, rtol = _tolerances(problem, torch.get_default_dtype())
        if math.isclose(c, r, rel_tol=rtol, abs_tol=atol) or (math.isnan(c) and math.isnan(r)):
            return
        raise _Verdict(
            "incorrect", f"output {k} is {c!r}, the reference gives {r!r} in {where} (atol {atol:g})"
        )
    if not _same_value(c, r):
        raise _Verdict("incorrect", f"output {k} is {c!r}, the reference gives {r!r} in {where}")


def _tolerances(problem: dict[str, Any], dtype: torch.dtype) -> tuple[float, float]:
    """(atol, rtol): the problem's ATOL/RTOL (0 means exact), else the dtype's default."""
    atol, rtol = problem.get("atol"), problem.get("rtol")
    return (tolerance(dtype) if atol is None else atol, tolerance(dtype) if rtol is None else rtol)


def _check_reference_stable(problem: dict[str, Any], first: Any, second: Any) -> None:
    """The reference run twice on the same inputs must agree within the problem's tolerance (exactly, for
    integer outputs); otherwise no candidate can match it: raise (``_build`` makes it a problem error)."""
    a, b = _outputs(first), _outputs(second)
    if len(a) != len(b):
        raise _Verdict(
            "incorrect", "the reference is not deterministic: two runs returned different structures"
        )
    for k, (x, y) in enumerate(zip(a, b, strict=True)):
        if not isinstance(x, torch.Tensor) or not isinstance(y, torch.Tensor):
            same = (
                bool(x == y) if not isinstance(x, torch.Tensor) and not isinstance(y, torch.Tensor) else False
            )
            detail = "a different value"
        elif x.shape != y.shape or x.dtype != y.dtype:
            same, detail = False, "a different shape or dtype"
        elif x.is_floating_point() or x.is_complex():
            atol, rtol = _tolerances(problem, x.dtype)
            same = torch.allclose(x, y, atol=atol, rtol=rtol, equal_nan=True)
            wide = torch.complex128 if x.is_complex() else torch.float64
            d = float((x.to(wide) - y.to(wide)).abs().nan_to_num(0.0).max()) if x.numel() else 0.0
            detail = f"max abs diff {d:.3g} (atol {atol:g}, rtol {rtol:g})"
        else:
            same, detail = torch.equal(x, y), "different integers"
        if not same:
            raise _Verdict(
                "incorrect",
                f"the reference is not deterministic: run twice on the same inputs, its output {k} differs "
                f"by {detail}, so no candidate can match it. Seed or remove the randomness or state in "
                "Model.forward (dropout in training mode, torch.rand, a call counter) or set ATOL/RTOL to "
                "cover it",
            )


def _time_cpu(fn: Callable[[], Any], n: int, keep: int = -1) -> tuple[float, Any]:
    """Seconds per call over ``n`` calls, and the output of call ``keep`` (checked after the timing)."""
    kept = None
    t0 = _perf_counter()
    for i in range(n):
        out = fn()
        if i == keep:
            kept = out
    return (_perf_counter() - t0) / n, kept


def _time_cuda(fn: Callable[[], Any], n: int, flush: torch.Tensor, keep: int = -1) -> tuple[float, Any]:
    times, kept = [], None
    for i in range(n):
        flush.zero_()  # evict L2 (256 MB > any current L2), as KernelBench's cuda_event timing does
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        out = fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
        if i == keep:
            kept = out
    return statistics.median(times), kept


_PROFILE_DRAWS = 2
"""Profiling draws: timed calls alternate between them, and each call bumps its inputs' version counters
first. Candidates that memoized their output by input identity, pointer, or pointer and version were timed
returning a cached copy: "correct" at 16-46x on a matmul (a session-47 sweep)."""
_UNSEEN_DRAWS = 5
"""Draws each side is timed on once, after the rounds: a kernel far slower on values it has not seen than on
the timed draws (a result cached by the inputs' contents: "correct" at 6.5-18.8x on a matmul) has its speedup
withheld."""
_UNSEEN_SLOWDOWN = 2.5
"""How many times lower the speedup on unseen draws (median of per-draw ratios) may be than the timed one.
Honest kernels on the ten example problems: at most 1.92 over 66 profiles (two at once on two cores), 2.66
with a third process on the cores (a relu whose timed speedup was itself a noisy 2.83x); caches keyed by
the inputs' sums: 9.9-10.9, by a hash of their bytes: 3.06-3.49. Timing each side's single calls on seen
draws as well, to compare like with like, was noisier (honest up to 5.2)."""


class _Alternating:
    """``fn`` called on the profiling draws in turn (call i of a timed block on draw i mod D), each call
    preceded by a bump of that draw's tensors' version counters (no data touched)."""

    def __init__(self, fn: Any, draws: list[list[Any]]) -> None:
        self.fn, self.draws, self.next = fn, draws, 0
        self.tensors = [_tensors_in(d) for d in draws]
        try:
            torch.autograd.graph.increment_version(self.tensors[0])
        except RuntimeError:  # inference tensors have no version counter: alternation alone
            self.tensors = [[] for _ in draws]

    def restart(self) -> None:
        self.next = 0

    def __call__(self) -> Any:
        j = self.next
        self.next = (j + 1) % len(self.draws)
        if self.tensors[j]:
            torch.autograd.graph.increment_version(self.tensors[j])
        return self.fn(*self.draws[j])


def _tensors_in(x: Any) -> list[torch.Tensor]:
    if isinstance(x, torch.Tensor):
        return [x]
    if isinstance(x, list | tuple):
        return [t for item in x for t in _tensors_in(item)]
    return []


def _overwrite_in_place(dst: list[Any], src: list[Any]) -> bool:
    """Copy ``src``'s tensors into ``dst``'s (same storage, new values); False, touching nothing, unless the
    two draws have the same structure, tensor shapes and dtypes, and equal non-tensor items."""
    a, b = _tensors_in(dst), _tensors_in(src)
    same = len(a) == len(b) and all(
        x.shape == y.shape and x.dtype == y.dtype for x, y in zip(a, b, strict=True)
    )
    if not same or _rebuilt_scalars(dst) != _rebuilt_scalars(src):
        return False
    for x, y in zip(a, b, strict=True):
        x.copy_(y)
    return True


def _rebuilt_scalars(x: Any) -> Any:
    if isinstance(x, torch.Tensor):
        return None
    if isinstance(x, list | tuple):
        return [_rebuilt_scalars(item) for item in x]
    return x


def _profile(
    new: Any, prep: _Prepared, job: dict[str, Any], device: str, second_look_seed: int
) -> dict[str, Any]:
    assert prep.profile is not None
    draws, unseen = prep.profile[:_PROFILE_DRAWS], prep.profile[_PROFILE_DRAWS:]
    outs_r = [out for _, out in draws]
    new_ins = [_clones(inputs) for inputs, _ in draws]
    rounds, round_s = int(job.get("rounds", 15)), float(job.get("round_s", 0.005))
    picks = random.Random(int(job["problem"].get("seed", 0)) ^ 0x71AE)
    f_ref = _Alternating(prep.ref, [_clones(inputs) for inputs, _ in draws])
    f_new = _Alternating(new, new_ins)

    with torch.no_grad():
        flush = torch.empty(64 * 2**20, dtype=torch.int32, device=device) if device == "cuda" else None
        state = _torch_state()
        t_warm = _perf_counter()
        n_warm = 0
        while _perf_counter() - t_warm < float(job.get("warmup_s", 0.05)) or n_warm < 3:
            f_ref()
            f_new()
            n_warm += 1
        if device == "cuda":
            torch.cuda.synchronize()
        if flush is not None:  # each timed GPU call is synchronized and preceded by an L2 flush
            per_call = max(_time_cuda(f_ref, 3, flush)[0], _time_cuda(f_new, 3, flush)[0], 1e-7)
            n = max(1, min(100, math.ceil(round_s / per_call)))
        else:
            per_call = max(_time_cpu(f_ref, 3)[0], _time_cpu(f_new, 3)[0], 1e-7)
            n = max(1, min(10_000, math.ceil(round_s / per_call)))
        t_ref, t_new, ratios = [], [], []
        for r in range(rounds):
            order = [("ref", f_ref), ("new", f_new)] if r % 2 == 0 else [("new", f_new), ("ref", f_ref)]
            got: dict[str, float] = {}
            keep = picks.randrange(n)  # one timed call per round, unknown to the candidate, is checked
            kept = None
            for name, fn in order:
                k = keep if name == "new" else -1
                fn.restart()  # call i on draw i mod D: the kept call's draw is known
                got[name], out = _time_cuda(fn, n, flush, k) if flush is not None else _time_cpu(fn, n, k)
                kept = out if name == "new" else kept
            # A kernel right on the validation trials but not on the timed calls (a call counter,
            # a cached result) would be timed doing other work than the reference's
            # checked after every round: a setting the candidate changes (grad mode, threads) and puts back
            # only at the end would have slowed the reference in between
            _check_state(state, f"the candidate, while it was timed (round {r}),")
            _compare(
                kept, outs_r[keep % len(outs_r)], job["problem"], f"a timed call (round {r}, call {keep})"
            )
            t_ref.append(got["ref"])
            t_new.append(got["new"])
            ratios.append(got["ref"] / max(got["new"], 1e-12))
        # draw 1's values written into draw 0's tensors: a result cached by identity or pointer is stale
        f_new.restart()
        _call(f_new, [], "the candidate (on draw 0)")  # draw 0 last: a cache of the last inputs holds it
        if len(new_ins) > 1 and _overwrite_in_place(new_ins[0], new_ins[1]):
            out = _call(new, new_ins[0], "the candidate (on inputs overwritten in place)")
            where = (
                "a call on inputs overwritten in place with other values (a result cached by input identity?)"
            )
            _compare(out, outs_r[1], job["problem"], where)
        both = (f_new, f_ref)
        seen = _time_unseen(new, prep.ref, unseen, job["problem"], flush, both)
        second: list[float] = []
        alike = _alike(prep.profile)
        if unseen and alike and statistics.median(ratios) > _UNSEEN_SLOWDOWN * statistics.median(seen):
            # a second look on five more unseen draws before flagging: single calls are noisy on a busy box
            more = _more_draws(prep, device, _UNSEEN_DRAWS, second_look_seed)
            if _alike(prep.profile + more):
                second = _time_unseen(new, prep.ref, more, job["problem"], flush, both)
            del more
        _check_state(state, "the candidate, while it was timed on unseen draws,")
        prep.namespaces.check("the candidate, while it was timed,")
    res = {
        "ref_time_s": statistics.median(t_ref),
        "candidate_time_s": statistics.median(t_new),
        "speedup": statistics.median(ratios),
        "rounds": rounds,
        "calls_per_round": n,
        "round_ratios": [round(x, 4) for x in ratios],
    }
    if unseen:
        # median of per-draw ratios, each from two adjacent single calls, as the rounds' ratios are
        res["unseen_speedup"] = statistics.median(seen)
        res["unseen_draw_ratios"] = [round(x, 4) for x in seen]
        # how much lower the speedup was on values the candidate had not seen than on the timed draws
        slowdown = res["speedup"] / max(res["unseen_speedup"], 1e-12)
        res["unseen_slowdown"] = round(slowdown, 4)
        if second:
            res["second_look_speedup"] = statistics.median(second)
            res["second_look_draw_ratios"] = [round(x, 4) for x in second]
        # Only like with like: where shapes or non-tensor inputs differ between draws, so does the work
        # (a loop count drawn per call: an exact rewrite was 10.5x timed, 1.73x unseen, honestly)
        if not alike:
            res["unseen_note"] = "not compared: the draws differ in shapes or non-tensor inputs"
        elif slowdown > _UNSEEN_SLOWDOWN and second:
            again = res["speedup"] / max(res["second_look_speedup"], 1e-12)
            if again > _UNSEEN_SLOWDOWN:
                res["suspicious"] = True
                res["unseen_reason"] = (
                    f"{res['speedup']:.2f}x while timed but {res['unseen_speedup']:.2f}x and "
                    f"{res['second_look_speedup']:.2f}x on two sets of {len(seen)} draws it had not seen: a "
                    "result cached by the inputs' contents? Not credited by optimize"
                )
            else:
                res["unseen_note"] = (
                    f"{res['unseen_speedup']:.2f}x on the first unseen draws, "
                    f"{res['second_look_speedup']:.2f}x on a second look: single-call noise, not flagged"
                )
        elif slowdown > _UNSEEN_SLOWDOWN:
            res["unseen_note"] = "not confirmed: the second-look draws differ in shapes or non-tensor inputs"
    return res


def _alike(draws: list[tuple[list[Any], Any]]) -> bool:
    """Whether every draw sets the same work besides tensor values: non-tensor items, shapes and dtypes."""
    shapes = {
        repr((_rebuilt_scalars(inputs), [(tuple(t.shape), t.dtype) for t in _tensors_in(inputs)]))
        for inputs, _ in draws
    }
    return len(shapes) == 1


def _time_unseen(
    new: Any,
    ref: Any,
    unseen: list[tuple[list[Any], Any]],
    problem: dict[str, Any],
    flush: Any,
    seen: tuple[_Alternating, _Alternating],
) -> list[float]:
    """For each unseen draw k, each side (the order alternating) makes an untimed call on its next timed
    draw, as in the rounds (versions bumped: a red team told the unbumped warm call apart), then one timed
    call on a fresh copy of unseen draw k, the candidate's output on it checked. Returns the
    reference-to-candidate time ratio per k."""
    alt_new, alt_ref = seen
    ratios = []
    for k, (inputs, want) in enumerate(unseen):
        sides = [("ref", ref, alt_ref), ("new", new, alt_new)]
        took: dict[str, float] = {}
        for name, fn, alt in sides if k % 2 == 0 else sides[::-1]:
            alt()
            call = functools.partial(fn, *_clones(inputs))
            took[name], out = _time_cuda(call, 1, flush, 0) if flush is not None else _time_cpu(call, 1, 0)
            if name == "new":
                _compare(out, want, problem, f"a call on a draw it had not seen (unseen draw {k})")
        ratios.append(took["ref"] / max(took["new"], 1e-12))
    return ratios


def _uses_triton(source: str) -> bool:
    try:
        tree = ast.parse(source)
    except SyntaxError:
        return False
    for node in ast.walk(tree):
        if isinstance(node, ast.Import) and any(a.name.split(".")[0] == "triton" for a in node.names):
            return True
        if isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "triton":
            return True
    return False


def run_job(job: dict[str, Any], workdir: Path) -> dict[str, Any]:
    """Validate (and, for kind "profile", time) one candidate; returns the result dict."""
    device = str(job.get("device", "cpu"))
    interpreted = device == "cpu" and _uses_triton(job["candidate"])
    # Triton on CPU tensors runs under its interpreter (the pool sets TRITON_INTERPRET for CPU workers):
    # results are real, times are not.
    torch.set_num_threads(int(job.get("threads", 1)))
    t0 = _perf_counter()
    out: dict[str, Any] = {"kind": job["kind"]}
    try:
        fp_mode = _FPMode()
        trials = int(job.get("trials", 5)) if job["kind"] == "validate" else 1
        profiled = job["kind"] == "profile" and not interpreted
        # profiling draws from seeds the candidate cannot know (it could precompute the public one's), both
        # drawn before its code can touch the RNGs
        pseed, second = job.get("profile_seed"), _secret_seed()
        pseed = (_secret_seed() if pseed is None else int(pseed)) if profiled else None
        prep = _prepare(job["problem"], workdir, device, trials, pseed)
        new, compile_s, baseline = _build(job["problem"], job["candidate"], workdir, device, fp_mode, prep)
        out["compile_s"] = compile_s
        out.update(_validate(new, prep, job["problem"], device, fp_mode, baseline))
        out.update(verdict="correct", reason="")
        if job["kind"] == "profile" and interpreted:
            out["reason"] = "not timed: the Triton interpreter checks correctness only"
        elif job["kind"] == "profile":
            out.update(_profile(new, prep, job, device, second), profile_seed=pseed)
        if job["kind"] == "profile" and out.get("speedup", 0.0) > float(job.get("excessive_speedup", 10.0)):
            out["reason"] = f"speedup {out['speedup']:.1f}x is suspiciously high: check the kernel by hand"
            out["suspicious"] = True
        if "unseen_reason" in out:
            out["reason"] = "; ".join(r for r in (out["reason"], out.pop("unseen_reason")) if r)
    except _Verdict as v:
        out.update(v.extra, verdict=v.verdict, reason=v.reason)
    except MemoryError:
        out.update(verdict="resource_limit", reason="the candidate exceeded the memory limit (MemoryError)")
    except RecursionError:
        out.update(verdict="crashed", reason="the candidate recursed too deeply")
    out["run_s"] = _perf_counter() - t0
    return out
