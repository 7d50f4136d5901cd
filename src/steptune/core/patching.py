"""Process-wide attribute patches shared by threads: installed while anyone holds them, refcounted.

A patched function is process-wide (a class's method, a module's function), while the code that wants it
patched runs in one thread (a recorder, a block's forward). ``SharedPatch`` installs the replacements when
the first holder enters and puts the originals back when the last one leaves; each replacement finds out
for itself whether the calling thread is a holder (a thread-local stack in the caller's module) and
otherwise calls through to ``original``.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

__all__ = ["MISSING", "SharedPatch"]

MISSING: Any = object()  # the owner had no attribute of its own by that name (it was inherited, or absent)


class SharedPatch:
    """``targets()`` (called at each install) gives ``(owner, name, replacement)`` triples."""

    def __init__(self, targets: Callable[[], list[tuple[Any, str, Any]]]) -> None:
        self._targets = targets
        self._lock = threading.Lock()
        self._users = 0
        self._saved: dict[tuple[int, str], tuple[Any, Any]] = {}  # (id(owner), name) -> (owner, own value)
        self._installed: list[tuple[int, str]] = []  # what this install replaced (targets() may vary)

    def original(self, owner: Any, name: str) -> Any:
        """What ``owner`` itself held under ``name`` before the install (its ``__dict__`` entry, so a
        classmethod comes back as the descriptor), or ``MISSING``."""
        return self._saved[(id(owner), name)][1]

    @property
    def installed(self) -> bool:
        return self._users > 0

    @contextmanager
    def held(self) -> Iterator[None]:
        with self._lock:
            if self._users == 0:
                self._installed = []
                targets = self._targets()
                keys = [(id(owner), name) for owner, name, _ in targets]
                if len(set(keys)) < len(keys):
                    raise ValueError(f"SharedPatch targets one attribute twice: {[t[:2] for t in targets]}")
                for (owner, name, replacement), key in zip(targets, keys, strict=True):
                    self._saved[key] = (owner, vars(owner).get(name, MISSING))
                    self._installed.append(key)
                    setattr(owner, name, replacement)
            self._users += 1
        try:
            yield
        finally:
            with self._lock:
                self._users -= 1
                if self._users == 0:
                    for key in self._installed:
                        owner, value = self._saved[key]
                        name = key[1]
                        if value is MISSING:
                            delattr(owner, name)
                        else:
                            setattr(owner, name, value)
                    # _saved stays: a thread may still be inside a replacement it looked up just before
