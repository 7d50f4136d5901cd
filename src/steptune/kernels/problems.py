"""Kernel problems in the KernelBench format, and the built-in CPU set.

A problem is a Python source file defining `class Model(nn.Module)` (the reference), `get_inputs()` (a list of
CPU tensors, freshly drawn from torch's global RNG) and `get_init_inputs()` (constructor arguments). A
candidate defines `class ModelNew(nn.Module)` with the same constructor and forward signature. Optional
module-level constants, read without executing the file:

- `DESCRIPTION`: one line for listings.
- `ATOL`, `RTOL`: tolerances (default per output dtype, see `tolerance`).
- `FORBIDDEN_OPS`: aten op names (e.g. `["aten.mm", "aten.addmm"]`) a candidate may not dispatch. Without
  it, a candidate is rejected when the reference's whole sequence of compute ops (views and allocations
  excluded) appears, in order, among the ops it dispatches: that is what stops "optimizing" by calling the
  reference, while a torch candidate composing other ops stays legal. With it, only the list applies, so
  include the reference's own ops in it.

Problems are data: loading one never imports it. The evaluation worker imports it in its sandbox.
"""

from __future__ import annotations

import ast
import importlib.util
import math
import re
import sys
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import TYPE_CHECKING

from steptune.core.textfile import read_text

if TYPE_CHECKING:  # torch loads where a tolerance is asked for: the CLI's help does not need it
    import torch

__all__ = ["Problem", "builtin_problems", "import_source", "load_problem", "tolerance"]

BUILTIN_DIR = Path(__file__).with_name("builtin_problems")

# fp32 1e-4 and fp16/bf16 1e-2 follow KernelBench's get_tolerance_for_precision.
_TOLERANCE = {"float32": 1e-4, "float64": 1e-7, "float16": 1e-2, "bfloat16": 1e-2}
_TOLERANCE.update(complex64=1e-4, complex128=1e-7, complex32=1e-2)  # as their real and imaginary parts


def tolerance(dtype: torch.dtype) -> float:
    """Default atol = rtol for an output dtype; exact for integer and bool outputs."""
    return _TOLERANCE.get(str(dtype).removeprefix("torch."), 0.0)


@dataclass(frozen=True, slots=True, kw_only=True)
class Problem:
    """A reference to optimize: its source and the constants read from it."""

    name: str
    """Built-in name, or the file's stem."""
    source: str
    """The whole Python source (sent to the sandboxed worker, never imported by the caller)."""
    path: str | None = None
    """The file it came from, when it came from one."""
    description: str = ""
    atol: float | None = None
    """Absolute tolerance; None means the per-dtype default."""
    rtol: float | None = None
    forbidden_ops: tuple[str, ...] | None = None
    """aten ops a candidate may not call; None means the reference's own compute ops."""


def builtin_problems() -> list[str]:
    """Names of the built-in CPU problems, sorted."""
    return sorted(p.stem for p in BUILTIN_DIR.glob("*.py") if not p.stem.startswith("_"))


def _constants(tree: ast.Module) -> dict[str, object]:
    out: dict[str, object] = {}
    for node in tree.body:
        if isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.targets[0], ast.Name):
            name = node.targets[0].id
            if name in ("DESCRIPTION", "ATOL", "RTOL", "FORBIDDEN_OPS"):
                try:
                    out[name] = ast.literal_eval(node.value)
                except ValueError as exc:
                    raise ValueError(f"{name} must be a literal (it is read without running it)") from exc
    return out


def _parse(name: str, source: str, path: str | None) -> Problem:
    try:
        tree = ast.parse(source, filename=path or name)
    except SyntaxError as exc:
        raise ValueError(f"problem {name!r} does not parse: {exc}") from exc
    defined = {n.name for n in tree.body if isinstance(n, ast.ClassDef | ast.FunctionDef)}
    missing = [s for s in ("Model", "get_inputs", "get_init_inputs") if s not in defined]
    if missing:
        raise ValueError(
            f"problem {name!r} lacks {', '.join(missing)}: a KernelBench-format problem defines "
            "class Model(nn.Module), get_inputs() and get_init_inputs()"
        )
    c = _constants(tree)
    return Problem(
        name=name,
        source=source,
        path=path,
        description=str(c.get("DESCRIPTION", "")),
        atol=_tolerance_constant(name, "ATOL", c.get("ATOL")),
        rtol=_tolerance_constant(name, "RTOL", c.get("RTOL")),
        forbidden_ops=_forbidden_ops(name, c.get("FORBIDDEN_OPS")),
    )


def _tolerance_constant(name: str, key: str, value: object) -> float | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int | float) or not 0 <= value < math.inf:
        raise ValueError(
            f"problem {name!r}: {key} = {value!r}; write a finite number >= 0 (0: exact), e.g. {key} = 1e-3"
        )
    return float(value)


_ATEN_NAME = re.compile(r"aten\.[A-Za-z_][A-Za-z0-9_]*")


def _forbidden_ops(name: str, value: object) -> tuple[str, ...] | None:
    """FORBIDDEN_OPS as the op recorder names them (``aten.mm``): any other spelling would match nothing,
    and setting the list turns the default rule (no replaying the reference's ops) off."""
    if value is None:
        return None
    if not isinstance(value, list | tuple) or not all(isinstance(o, str) for o in value):
        raise ValueError(f"problem {name!r}: FORBIDDEN_OPS must be a list of op names, e.g. ['aten.mm']")
    bad = [o for o in value if not _ATEN_NAME.fullmatch(o)]
    if bad:
        hint = bad[0].replace("aten::", "aten.").replace("torch.", "aten.").split(".default")[0]
        raise ValueError(
            f"problem {name!r}: FORBIDDEN_OPS {bad} would match nothing: name aten ops as the recorder "
            f"sees them, aten.<op> without an overload (e.g. {hint!r})"
        )
    return tuple(value)


def load_problem(name_or_path: str | Path) -> Problem:
    """A built-in problem by name, or a problem file by path."""
    text = str(name_or_path)
    path = Path(text)
    builtin = BUILTIN_DIR / f"{text}.py"
    if path.suffix == ".py" or path.is_file() or (path.exists() and not builtin.is_file()):
        if not path.is_file():
            what = "is a directory, not a problem file" if path.is_dir() else "not found"
            raise ValueError(f"problem file {text!r} {what}")
        return _parse(path.stem, read_text(path, "problem file"), str(path))
    if not builtin.is_file():
        names = ", ".join(builtin_problems())
        raise ValueError(f"unknown problem {text!r}: use a .py file or one of {names}")
    return _parse(text, builtin.read_text(), str(builtin))


def import_source(source: str, path: Path, module_name: str) -> ModuleType:
    """Write `source` to `path` and import it as `module_name` (a real file: triton.jit needs one)."""
    path.write_text(source)
    spec = importlib.util.spec_from_file_location(module_name, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[module_name] = module
    spec.loader.exec_module(module)
    return module
