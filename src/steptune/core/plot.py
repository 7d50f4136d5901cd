"""Plots written to files. matplotlib is imported inside each function (Agg backend, no show)."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from steptune.core.trace import Span

__all__ = ["bars", "gantt", "lines", "pareto", "timelines"]


def _pyplot() -> Any:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _save(fig: Any, path: str | Path) -> Path:
    path = Path(path)
    if path.suffix.lower().lstrip(".") not in fig.canvas.get_supported_filetypes():
        # no image suffix ("out/step", "run.v2"): matplotlib would add .png itself or refuse the format,
        # and the path returned would not exist
        path = path.with_name(path.name + ".png")
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    _pyplot().close(fig)
    return path


def gantt(spans: Sequence[Span], path: str | Path, *, title: str = "", time_unit: str = "ms") -> Path:
    """One row per (rank, stream); a bar per span, coloured by its category. ``time_unit`` is s, ms or us
    for spans in seconds, or "units" for spans in abstract time units (shown as they are)."""
    scales = {"s": 1.0, "ms": 1e3, "us": 1e6, "units": 1.0}
    if time_unit not in scales:
        raise ValueError(f"gantt(time_unit={time_unit!r}): choose one of {', '.join(scales)}")
    if not spans:
        raise ValueError(f"gantt({str(path)!r}): no spans to draw")
    plt = _pyplot()
    scale = scales[time_unit]
    rows = sorted({(s.rank, s.stream) for s in spans})
    row_of = {r: i for i, r in enumerate(rows)}
    cats = sorted({s.category or s.stream for s in spans})
    cmap = plt.get_cmap("tab10")
    color = {c: cmap(i % 10) for i, c in enumerate(cats)}
    fig, ax = plt.subplots(figsize=(11, 0.45 * len(rows) + 1.6))
    # One collection per row, not one bar per span: a 131k-span schedule (P=64, M=1024) took 2 minutes and
    # 1.9 GB of memory as bars (a 2026-12-05 sweep)
    per_row: dict[int, tuple[list[tuple[float, float]], list[Any]]] = {i: ([], []) for i in range(len(rows))}
    for s in spans:
        xs, cs = per_row[row_of[(s.rank, s.stream)]]
        xs.append((s.start * scale, s.duration * scale))
        cs.append(color[s.category or s.stream])
    for i, (xs, cs) in per_row.items():
        ax.broken_barh(
            xs, (i - 0.4, 0.8), facecolors=cs, edgecolor="black", linewidth=0.3 if len(spans) <= 80 else 0.0
        )
    ax.set_yticks(range(len(rows)), [f"rank {r} {st}" for r, st in rows])
    ax.invert_yaxis()
    ax.set_xlabel(f"time ({time_unit})")
    handles = [plt.Rectangle((0, 0), 1, 1, color=color[c]) for c in cats]
    ax.legend(
        handles, cats, loc="upper center", bbox_to_anchor=(0.5, -0.25), fontsize=8, ncol=min(len(cats), 6)
    )
    ax.set_title(title)
    return _save(fig, path)


def pareto(
    points: Sequence[tuple[float, float, str]], path: str | Path, *, xlabel: str, ylabel: str, title: str = ""
) -> Path:
    """Scatter of labelled (x, y) points with the lower-left Pareto frontier drawn as a step line."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(7, 5))
    for x, y, label in points:
        ax.scatter([x], [y])
        ax.annotate(label, (x, y), fontsize=8, xytext=(4, 4), textcoords="offset points")
    frontier: list[tuple[float, float]] = []
    for x, y, _ in sorted(points):
        if not frontier or y < frontier[-1][1]:
            frontier.append((x, y))
    if frontier:
        xs, ys = zip(*frontier, strict=True)
        ax.step(xs, ys, where="post", color="gray", linestyle="--", label="Pareto frontier")
        ax.legend()
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    return _save(fig, path)


def bars(
    labels: Sequence[str],
    values: Sequence[float],
    path: str | Path,
    *,
    ylabel: str,
    title: str = "",
    reference: float | None = None,
) -> Path:
    """A bar per label; an optional horizontal reference line (e.g. 1.0 for ratios)."""
    if len(labels) != len(values):
        raise ValueError(f"{len(labels)} labels but {len(values)} values")
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(max(5.0, 0.7 * len(labels) + 2), 4))
    ax.bar(range(len(values)), values)
    ax.set_xticks(range(len(labels)), labels, rotation=30, ha="right")
    if reference is not None:
        ax.axhline(reference, color="gray", linestyle="--")
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    return _save(fig, path)


def lines(
    xs: Sequence[float],
    series: dict[str, Sequence[float]],
    path: str | Path,
    *,
    xlabel: str,
    ylabel: str,
    title: str = "",
) -> Path:
    """One line (with markers) per named series over the same x values."""
    for name, ys in series.items():
        if len(ys) != len(xs):
            raise ValueError(f"series {name!r} has {len(ys)} values for {len(xs)} x values")
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(6, 4))
    for name, ys in series.items():
        ax.plot(list(xs), list(ys), marker="o", label=name)
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.legend()
    ax.grid(alpha=0.3)
    return _save(fig, path)


def timelines(
    series: dict[str, tuple[Sequence[float], Sequence[float]]],
    path: str | Path,
    *,
    xlabel: str,
    ylabel: str,
    title: str = "",
    dashed: dict[str, str] | None = None,
    marks: dict[str, float] | None = None,
    ylim: tuple[float, float] | None = None,
) -> Path:
    """One line per named series, each ``(xs, ys)``. ``dashed`` maps a series to the series whose colour it
    takes, drawn dashed (a prediction next to its measurement); ``marks`` are labelled vertical lines (an
    event at x); ``ylim`` clips the y axis (e.g. to leave a warm-up outlier off the chart)."""
    dashed = dashed or {}
    for name, (xs, ys) in series.items():
        if len(xs) != len(ys):
            raise ValueError(f"series {name!r} has {len(ys)} values for {len(xs)} x values")
    for name, like in dashed.items():
        if name not in series or like not in series or like in dashed:
            raise ValueError(f"dashed series {name!r} must follow a solid series in the plot, got {like!r}")
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(8, 4.5))
    colour: dict[str, Any] = {}
    for name, (xs, ys) in series.items():
        if name not in dashed:
            (line,) = ax.plot(list(xs), list(ys), label=name, linewidth=1.2)
            colour[name] = line.get_color()
    for name, like in dashed.items():
        xs, ys = series[name]
        ax.plot(list(xs), list(ys), label=name, linestyle="--", linewidth=1.0, color=colour[like])
    for k, (label, x) in enumerate((marks or {}).items()):
        ax.axvline(x, color="gray", linestyle=":" if k % 2 else "-.", linewidth=1.0, label=label)
    if ylim is not None:
        ax.set_ylim(*ylim)
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    return _save(fig, path)
