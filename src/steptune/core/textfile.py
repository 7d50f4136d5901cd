"""Reading a user's text file (a schedule, a scenario CSV, a kernel candidate) with an error that names
the file when it is not UTF-8, instead of a bare codec message."""

from __future__ import annotations

from pathlib import Path

__all__ = ["NotTextError", "read_text"]


class NotTextError(ValueError):
    """The file is not UTF-8 text."""


def read_text(path: str | Path, what: str = "file") -> str:
    """``path``'s text; raises ``NotTextError`` (a ``ValueError``: the CLI reports it as a usage error)
    naming the file, ``what`` it should be, and the first bad byte."""
    path = Path(path)
    try:
        return path.read_text(encoding="utf-8")
    except UnicodeDecodeError as exc:
        raise NotTextError(
            f"{path}: not a UTF-8 text {what} (byte 0x{exc.object[exc.start]:02x} at offset {exc.start})"
        ) from None
