"""Dataclass configs as CLI flags: each field becomes ``--field-name``, its attribute docstring the help.

@dataclass(kw_only=True, slots=True)
class Config:
    num_gpus: int = 8
    \"\"\"Ranks in the group.\"\"\"

add_config_args(parser, Config); config = config_from_args(Config, args)
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import inspect
import itertools
import textwrap
from typing import Any, TypeVar, get_type_hints

__all__ = ["add_config_args", "config_from_args", "field_docs"]

T = TypeVar("T")


def field_docs(cls: type) -> dict[str, str]:
    """The attribute docstrings of a dataclass (the string literal right after each field), its base
    classes' included (a subclass's own docstring wins)."""
    docs: dict[str, str] = {}
    for klass in reversed(cls.__mro__[:-1]):  # object has none; the most derived class is read last
        docs.update(_own_field_docs(klass))
    return docs


def _own_field_docs(cls: type) -> dict[str, str]:
    try:
        tree = ast.parse(textwrap.dedent(inspect.getsource(cls)))
    except (OSError, TypeError):
        return {}
    docs: dict[str, str] = {}
    body = tree.body[0].body if tree.body and isinstance(tree.body[0], ast.ClassDef) else []
    for prev, node in itertools.pairwise(body):
        if (
            isinstance(prev, ast.AnnAssign)
            and isinstance(prev.target, ast.Name)
            and isinstance(node, ast.Expr)
            and isinstance(node.value, ast.Constant)
            and isinstance(node.value.value, str)
        ):
            docs[prev.target.id] = " ".join(node.value.value.split())
    return docs


def add_config_args(parser: argparse.ArgumentParser, cls: type) -> None:
    if not dataclasses.is_dataclass(cls):
        raise TypeError(f"{cls!r} is not a dataclass")
    docs = field_docs(cls)
    hints = get_type_hints(cls)
    for f in dataclasses.fields(cls):
        typ = hints[f.name]
        flag = "--" + f.name.replace("_", "-")
        has_default = f.default is not dataclasses.MISSING or f.default_factory is not dataclasses.MISSING
        if f.default is not dataclasses.MISSING:
            default = f.default
        elif f.default_factory is not dataclasses.MISSING:
            default = f.default_factory()
        else:
            default = None
        help_text = docs.get(f.name, "")
        if has_default:
            help_text += f" (default: {default})"
        if typ is bool:
            parser.add_argument(flag, action=argparse.BooleanOptionalAction, default=default, help=help_text)
        elif typ in (int, float, str):
            parser.add_argument(flag, type=typ, default=default, required=not has_default, help=help_text)
        else:
            raise TypeError(
                f"{cls.__name__}.{f.name}: type {typ} has no CLI mapping; use int, float, str or bool"
            )


def config_from_args(cls: type[T], args: argparse.Namespace) -> T:
    fields = [f.name for f in dataclasses.fields(cls)]  # type: ignore[arg-type]
    kwargs: dict[str, Any] = {name: getattr(args, name) for name in fields}
    return cls(**kwargs)
