"""One result table, written as JSON, Markdown and a rich console table."""

from __future__ import annotations

import json
import math
import os
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

__all__ = ["Table", "plural"]


def plural(n: int, noun: str) -> str:
    """``1 thread``, ``2 threads``."""
    return f"{n} {noun}{'' if n == 1 else 's'}"


_PIPED_WIDTH = 200
"""Console width when output is not a terminal and COLUMNS is unset (rich would assume 80)."""


def _fmt(v: Any) -> str:
    if v is None:  # not measured or not defined (a ratio over a baseline that trained nothing, say)
        return "-"
    if isinstance(v, float):
        if v == 0 or 1e-3 <= abs(v) < 1e6:
            return f"{v:.4g}"
        return f"{v:.3e}"
    return str(v)


def _md_cell(text: str) -> str:
    """A Markdown table cell: a ``|`` in the text would end the cell, a newline the row."""
    return text.replace("|", "\\|").replace("\n", " ")


def _json_value(v: Any) -> Any:
    """JSON has no NaN or infinity (``JSON.parse`` rejects them): a non-finite float is written as null."""
    return None if isinstance(v, float) and not math.isfinite(v) else v


@dataclass(kw_only=True, slots=True)
class Table:
    title: str
    columns: Sequence[str]
    rows: list[list[Any]] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    """Assumptions and labels printed under the table (e.g. "simulated")."""

    def __post_init__(self) -> None:
        seen = [c for i, c in enumerate(self.columns) if c in list(self.columns)[:i]]
        if seen:  # records() and the JSON key rows by column name: a repeated name would lose a value
            raise ValueError(
                f"table {self.title!r}: column name(s) {sorted(set(seen))} repeated; names must differ"
            )

    def add(self, *values: Any) -> None:
        if len(values) != len(self.columns):
            raise ValueError(
                f"row has {len(values)} values, table {self.title!r} has {len(self.columns)} columns"
            )
        self.rows.append(list(values))

    def records(self) -> list[dict[str, Any]]:
        return [dict(zip(self.columns, map(_json_value, row), strict=True)) for row in self.rows]

    def to_json(self) -> dict[str, Any]:
        return {
            "title": self.title,
            "columns": list(self.columns),
            "rows": self.records(),
            "notes": self.notes,
        }

    def to_markdown(self) -> str:
        lines = [
            f"### {self.title}",
            "",
            "| " + " | ".join(_md_cell(str(c)) for c in self.columns) + " |",
            "|" + "|".join("---" for _ in self.columns) + "|",
        ]
        lines += ["| " + " | ".join(_md_cell(_fmt(v)) for v in row) + " |" for row in self.rows]
        lines += [""] + [f"- {n}" for n in self.notes]
        return "\n".join(lines).rstrip() + "\n"

    def print(self) -> None:
        from rich.console import Console
        from rich.table import Table as RichTable

        t = RichTable(title=self.title)
        for i, c in enumerate(self.columns):
            t.add_column(c, no_wrap=i == 0)  # row names stay whole: they tell the rows apart
        for row in self.rows:
            t.add_row(*(_fmt(v) for v in row))
        console = Console()
        if not console.is_terminal and "COLUMNS" not in os.environ:
            # piped or redirected: rich would assume 80 columns and cut the names; a file has room
            console = Console(width=_PIPED_WIDTH)
        console.print(t)
        for n in self.notes:
            console.print(f"  [dim]{n}[/dim]")

    def write(self, stem: str | Path) -> tuple[Path, Path]:
        """Write ``stem.json`` and ``stem.md``; return both paths. The suffixes are appended: a stem with
        dots in its name (``llama3.1-8b``) keeps them."""
        stem = Path(stem)
        stem.parent.mkdir(parents=True, exist_ok=True)
        js, md = stem.with_name(stem.name + ".json"), stem.with_name(stem.name + ".md")
        js.write_text(json.dumps(self.to_json(), indent=2, allow_nan=False))
        md.write_text(self.to_markdown())
        return js, md
