"""C kernels for CPU candidates: compile a C source with the system compiler and load it with ctypes.

A candidate written for the CPU lane calls `load_c(SOURCE)` at import time and passes tensor pointers from
`ptr(t)` to the exported functions. Compiled libraries are cached by a hash of source and flags under
`$STEPTUNE_KERNELS_BUILD` (the evaluation pool points it at a per-pool folder), else a per-user temp folder.
Compilation runs in the caller's process: inside the evaluation pool that is the sandboxed worker child, so a
compiler that hangs is bounded by the worker's time limit.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import shutil
import subprocess
import tempfile
from collections.abc import Sequence
from pathlib import Path

import torch

__all__ = ["DEFAULT_CFLAGS", "CompileError", "compiler", "load_c", "ptr"]

# gnu11, not c11: strict ISO mode turns off FMA contraction. No -ffast-math: it would set flush-to-zero for
# the whole process on load (the evaluator rejects candidates that change the floating-point mode).
DEFAULT_CFLAGS: tuple[str, ...] = ("-O3", "-march=native", "-std=gnu11", "-fPIC", "-shared")

_CTYPES = {
    torch.float32: ctypes.c_float,
    torch.float64: ctypes.c_double,
    torch.int32: ctypes.c_int32,
    torch.int64: ctypes.c_int64,
    torch.uint8: ctypes.c_uint8,
    torch.int8: ctypes.c_int8,
    torch.int16: ctypes.c_int16,
    torch.float16: ctypes.c_uint16,
    torch.bfloat16: ctypes.c_uint16,
}


class CompileError(RuntimeError):
    """The C compiler rejected a candidate; `.log` holds its diagnostics."""

    def __init__(self, message: str, log: str) -> None:
        super().__init__(message)
        self.log = log


def compiler() -> str:
    """The C compiler to use: $CC, else cc/gcc/clang on PATH."""
    for name in (os.environ.get("CC"), "cc", "gcc", "clang"):
        if name and shutil.which(name):
            return name
    raise CompileError("no C compiler found: install gcc or clang, or set $CC", "")


def _build_dir() -> Path:
    root = os.environ.get("STEPTUNE_KERNELS_BUILD")
    path = Path(root) if root else Path(tempfile.gettempdir()) / f"steptune-cext-{os.getuid()}"
    path.mkdir(parents=True, exist_ok=True)
    return path


def load_c(source: str, *, flags: Sequence[str] = DEFAULT_CFLAGS, timeout_s: float = 60.0) -> ctypes.CDLL:
    """Compile `source` into a shared library (cached by content) and return it loaded with ctypes."""
    cc = compiler()
    key = hashlib.sha256("\0".join([cc, *flags, source]).encode()).hexdigest()[:20]
    out = _build_dir() / f"k_{key}.so"
    if not out.exists():
        src = out.with_suffix(".c")
        src.write_text(source)
        tmp = out.with_suffix(f".{os.getpid()}.tmp")
        try:
            proc = subprocess.run(
                [cc, *flags, "-o", str(tmp), str(src), "-lm"],
                capture_output=True,
                text=True,
                timeout=timeout_s,
            )
        except subprocess.TimeoutExpired as exc:
            raise CompileError(f"{cc} took longer than {timeout_s:.0f} s", "") from exc
        if proc.returncode != 0:
            tmp.unlink(missing_ok=True)
            log = (proc.stderr or proc.stdout).strip()
            raise CompileError(f"{cc} failed (exit {proc.returncode}): {log[-2000:]}", log)
        os.replace(tmp, out)  # atomic: a concurrent worker never loads a half-written library
    return ctypes.CDLL(str(out))


def ptr(t: torch.Tensor) -> ctypes._Pointer:  # type: ignore[type-arg]
    """A ctypes pointer to a contiguous CPU tensor's first element (typed by its dtype)."""
    if t.device.type != "cpu":
        raise ValueError(f"ptr() needs a CPU tensor, got one on {t.device}")
    if not t.is_contiguous():
        raise ValueError("ptr() needs a contiguous tensor: call .contiguous() first")
    ctype = _CTYPES.get(t.dtype)
    if ctype is None:
        raise ValueError(f"ptr() does not map dtype {t.dtype}; use one of {sorted(map(str, _CTYPES))}")
    return ctypes.cast(t.data_ptr(), ctypes.POINTER(ctype))
