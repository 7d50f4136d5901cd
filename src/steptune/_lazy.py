"""Lazy package exports (PEP 562): an area's public names load on first use, so that ``steptune --help``
and one area's verbs do not import torch, scipy or matplotlib for the other areas.

Trap handled here: importing a submodule binds it on its package under its own name, which would then
shadow an exported name equal to it (``steptune.pipeline.tune`` the function vs the module); the package's
class rebinds such a name to the exported object."""

from __future__ import annotations

import importlib
import sys
import types
from collections.abc import Callable
from typing import Any

__all__ = ["lazy_exports"]


class _LazyPackage(types.ModuleType):
    _lazy_exports: dict[str, str]

    def __setattr__(self, name: str, value: Any) -> None:
        exports = self.__dict__.get("_lazy_exports", {})
        if (
            name in exports
            and isinstance(value, types.ModuleType)
            and value.__name__ == f"{self.__name__}.{name}"
        ):
            value = getattr(importlib.import_module(exports[name]), name)
        super().__setattr__(name, value)


def lazy_exports(
    package: str, exports: dict[str, str]
) -> tuple[Callable[[str], Any], Callable[[], list[str]]]:
    """``(__getattr__, __dir__)`` for ``package``: ``exports`` maps each public name to its module."""
    module = sys.modules[package]
    module.__class__ = _LazyPackage
    module._lazy_exports = exports

    def getattr_(name: str) -> Any:
        where = exports.get(name)
        if where is None:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(where), name)
        setattr(module, name, value)
        return value

    def dir_() -> list[str]:
        return sorted({*vars(module), *exports})

    return getattr_, dir_
