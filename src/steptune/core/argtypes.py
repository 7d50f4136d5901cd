"""argparse ``type=`` converters shared by the areas' CLIs: a bad number fails at parse time with a
message that says what the flag needs."""

from __future__ import annotations

import argparse
import math
import os
import sys
import tempfile
from collections.abc import Callable, Iterable
from pathlib import Path

__all__ = [
    "byte_size",
    "distinct_paths",
    "non_negative_float",
    "non_negative_int",
    "output_dir",
    "output_file",
    "plot_file",
    "positive_float",
    "positive_int",
    "seed",
    "warn_ignored",
]


def _number(
    text: str, parse: Callable[[str], float], ok: Callable[[float], bool], kind: str, rule: str
) -> float:
    try:
        value = parse(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected {kind} {rule}, got {text!r}") from None
    if not (math.isfinite(value) and ok(value)):
        raise argparse.ArgumentTypeError(f"must be {rule}, got {text}")
    return value


def positive_int(text: str) -> int:
    """A whole number >= 1 (counts: steps, ranks, GPUs)."""
    return int(_number(text, int, lambda v: v >= 1, "a whole number", ">= 1"))


def positive_float(text: str) -> float:
    """A finite number > 0 (seconds, scales)."""
    return _number(text, float, lambda v: v > 0, "a number", "> 0 and finite")


_BYTE_UNITS = {"KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40, "KB": 1e3, "MB": 1e6, "GB": 1e9,
               "TB": 1e12, "B": 1}  # fmt: skip


def byte_size(text: str) -> float:
    """Bytes, > 0 and finite: a number (80e9) or a number with a unit (80GB, 141GiB, 300MiB)."""
    upper = text.strip().upper()
    unit = next((u for u in _BYTE_UNITS if upper.endswith(u)), None)
    number = upper[: -len(unit)].strip() if unit else upper
    try:
        value = float(number) * (_BYTE_UNITS[unit] if unit else 1)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected bytes such as 80e9, 80GB or 141GiB, got {text!r}"
        ) from None
    if not 0 < value < math.inf:
        raise argparse.ArgumentTypeError(f"must be > 0 and finite bytes, got {text}")
    return value


def non_negative_int(text: str) -> int:
    """A whole number >= 0 (a rank, a step index)."""
    return int(_number(text, int, lambda v: v >= 0, "a whole number", ">= 0"))


def seed(text: str) -> int:
    """A random seed: a whole number in [0, 2**63) (torch's and numpy's generators take no other)."""
    return int(_number(text, int, lambda v: 0 <= v < 2**63, "a whole number", ">= 0 and below 2**63"))


def non_negative_float(text: str) -> float:
    """A finite number >= 0 (a budget where 0 means "only the fixed part")."""
    return _number(text, float, lambda v: v >= 0, "a number", ">= 0 and finite")


def output_file(text: str) -> Path:
    """A file path the command can write when it ends (checked before any work is done): not a
    directory, and its nearest existing ancestor a writable directory (missing ones are created)."""
    path = Path(text)
    if path.is_dir():
        raise argparse.ArgumentTypeError(f"{text} is a directory; give a file path inside it")
    _writable_ancestor(path.parent, text)
    return path


_PLOT_SUFFIXES = (".png", ".pdf", ".svg", ".svgz", ".jpg", ".jpeg", ".webp", ".tif", ".tiff", ".eps", ".ps")
"""What matplotlib's default backends write (a subset of ``FigureCanvasBase.get_supported_filetypes()``)."""


def plot_file(text: str) -> Path:
    """An ``output_file`` for a plot, checked before the run: its suffix must be an image format
    matplotlib writes (a ``.txt`` path failed only after the whole run, with matplotlib's own error)."""
    path = output_file(text)
    if path.suffix.lower() not in _PLOT_SUFFIXES:
        raise argparse.ArgumentTypeError(
            f"{text}: a plot is written as {', '.join(s[1:] for s in _PLOT_SUFFIXES)}; "
            f"give a path ending in .png, say {path.with_suffix('.png')}"
        )
    return path


def output_dir(text: str) -> Path:
    """A directory the command can write into: an existing directory, or one it can create."""
    path = Path(text)
    if path.exists() and not path.is_dir():
        raise argparse.ArgumentTypeError(f"{text} is a file, not a folder")
    _writable_ancestor(path, text)
    return path


def _writable_ancestor(folder: Path, text: str) -> None:
    here = folder.absolute()
    while not here.exists():
        here = here.parent
    if not here.is_dir():
        raise argparse.ArgumentTypeError(f"cannot write {text}: {here} is a file, not a folder")
    if not os.access(here, os.W_OK | os.X_OK):
        raise argparse.ArgumentTypeError(f"cannot write {text}: no write permission in {here}")
    try:  # root passes os.access everywhere, and /proc or a read-only mount refuse files anyway: try one
        fd, probe = tempfile.mkstemp(dir=here, prefix=".steptune-write-check-")
    except OSError as err:
        raise argparse.ArgumentTypeError(
            f"cannot write {text}: {here} does not take new files ({err.strerror})"
        ) from err
    os.close(fd)
    os.unlink(probe)


def warn_ignored(args: argparse.Namespace, dests: Iterable[str], why: str) -> list[str]:
    """Warn on stderr for each option in ``dests`` (argparse dest names) that was set to something other
    than its default although ``why`` (e.g. "with --lane cpu") gives it no effect. The verb's parser is
    ``args._parser`` (``steptune.cli.build_parser`` sets it on every verb). Returns the flags warned of."""
    parser = getattr(args, "_parser", None)
    if parser is None:
        return []
    flags = []
    for dest in dests:
        if getattr(args, dest) != parser.get_default(dest):
            flags.append("--" + dest.replace("_", "-"))
            print(f"{parser.prog}: warning: {flags[-1]} has no effect {why}", file=sys.stderr)
    return flags


def distinct_paths(**paths: Path | str | None) -> None:
    """Refuse two flags that name the same file (``--json x.csv`` over the ``--scenario x.csv`` it reads, or
    ``--json`` and ``--plot`` on one path): the later write would replace the earlier, silently. Keyword
    names are the flags without dashes (``plot=args.plot``); None is skipped."""
    seen: dict[Path, str] = {}
    for flag, path in paths.items():
        if path is None:
            continue
        key = Path(path).expanduser().resolve()
        name = "--" + flag.replace("_", "-")
        if key in seen:
            raise ValueError(f"{seen[key]} and {name} name the same file ({path}): give each its own path")
        seen[key] = name
