"""Failure scenarios for the cluster simulator: a seeded generator, named presets and CSV traces.

Kinds (rates as in ResiHP's evaluation, which injects a failure every 30 minutes, and Greyhound's
fail-slow statistics):
- ``fail-stop``: device deaths, exponential gaps with mean ``stop_every_s`` (default 30 min).
- ``fail-slow-weak|medium|strong``: compute slowdowns of 1.25x, 1.5x, 2.5x (speed factors 0.8, 0.667,
  0.4); onsets with exponential gaps of mean ``slow_every_s`` (20 min), lognormal durations with
  median ``slow_median_s`` (15 min) and sigma 1 (a heavy tail into hours), truncated to [2 min, 3 h];
  ``slow_median_s=inf``: persistent fail-slows (ResiHP's evaluation setting).
- ``fail-slow-link``: a device's links (NVLink and NIC) at ``LINK_FACTORS`` (0.3-0.7) of their
  bandwidth, same arrivals and durations as the compute fail-slows (needs ``SimJob(comm=True)``).
- ``mixed``: fail-stops every hour plus medium fail-slows every 20 minutes.

CSV traces have one row per failure: ``kind,device,start_s,duration_s,factor`` (duration ``inf``
for a fail-stop or a persistent fail-slow), as in Oobleck's simulator traces but per device, and an
optional sixth column ``target`` ("compute" or "link"; written only when a trace has link fail-slows).
``kind`` is ``fail-stop`` or ``fail-slow``. ``factor`` is the device's *speed* in (0, 1] (0.5 = half
speed, a 2x slowdown; a fail-stop's is ignored, write 1), unlike ``--inject ...,factor=`` of the live
runs, which is a slowdown >= 1. A fail-stop row: ``fail-stop,3,600,inf,1``.
"""

from __future__ import annotations

import csv
import io
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from steptune.core.textfile import read_text
from steptune.resilience.sim import FailureEvent

__all__ = ["KINDS", "LINK_FACTORS", "SEVERITY", "Rates", "generate", "read_csv", "write_csv"]

SEVERITY = {"weak": 1 / 1.25, "medium": 1 / 1.5, "strong": 1 / 2.5}
"""Speed factor of a fail-slow of each severity."""
LINK_FACTORS = (0.3, 0.7)
"""Range of a link fail-slow's bandwidth factor (uniform; congestion or a degraded NIC/NVLink)."""
KINDS = ("fail-stop", "fail-slow-weak", "fail-slow-medium", "fail-slow-strong", "fail-slow-link", "mixed")
_FIELDS = ("kind", "device", "start_s", "duration_s", "factor")
_TARGET = "target"
"""Optional sixth CSV column: "compute" (default) or "link"."""


@dataclass(frozen=True, kw_only=True, slots=True)
class Rates:
    stop_every_s: float = 1800.0
    slow_every_s: float = 1200.0
    slow_median_s: float = 900.0
    mixed_stop_every_s: float = 3600.0


def _arrivals(rng: np.random.Generator, mean_gap: float, duration_s: float) -> list[float]:
    out, t = [], 0.0
    while True:
        t += float(rng.exponential(mean_gap))
        if t >= duration_s:
            return out
        out.append(t)


def generate(
    kind: str, *, num_devices: int, duration_s: float, seed: int = 0, rates: Rates | None = None
) -> tuple[FailureEvent, ...]:
    """Failures of one ``kind`` (``KINDS``) over ``duration_s`` on devices ``0..num_devices-1``."""
    if kind not in KINDS:
        raise ValueError(f"unknown scenario kind {kind!r}; choose one of {KINDS}")
    if num_devices < 1 or not 0 < duration_s < math.inf:
        raise ValueError("need num_devices >= 1 and a finite duration_s > 0")
    rates = rates or Rates()
    rng = np.random.default_rng(seed)
    out: list[FailureEvent] = []
    dead: set[int] = set()

    def stops(every: float) -> None:
        for t in _arrivals(rng, every, duration_s):
            alive = [d for d in range(num_devices) if d not in dead]
            if len(alive) <= 1:
                return
            d = int(rng.choice(alive))
            dead.add(d)
            out.append(FailureEvent(kind="fail-stop", device=d, start_s=round(t, 1)))

    def slows(factor: float | None) -> None:
        """Compute fail-slows of ``factor``; None: link fail-slows of a factor drawn per episode."""
        for t in _arrivals(rng, rates.slow_every_s, duration_s):
            # Drawn even when persistent, so that scenarios differing only in durations share onsets.
            raw = float(rng.lognormal(math.log(min(rates.slow_median_s, 1e12)), 1.0))
            dur = math.inf if math.isinf(rates.slow_median_s) else float(np.clip(raw, 120.0, 3 * 3600.0))
            d = int(rng.integers(num_devices))
            link = factor is None
            f = round(float(rng.uniform(*LINK_FACTORS)), 3) if link else factor
            out.append(
                FailureEvent(
                    kind="fail-slow",
                    device=d,
                    start_s=round(t, 1),
                    duration_s=round(dur, 1),
                    factor=f,
                    target="link" if link else "compute",
                )
            )

    if kind == "fail-stop":
        stops(rates.stop_every_s)
    elif kind == "fail-slow-link":
        slows(None)
    elif kind == "mixed":
        stops(rates.mixed_stop_every_s)
        slows(SEVERITY["medium"])
    else:
        slows(SEVERITY[kind.removeprefix("fail-slow-")])
    return tuple(sorted(out, key=lambda f: (f.start_s, f.device)))


def write_csv(failures: tuple[FailureEvent, ...] | list[FailureEvent], path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    links = any(f.target != "compute" for f in failures)
    with path.open("w", newline="") as fh:
        w = csv.writer(fh)
        w.writerow(_FIELDS + ((_TARGET,) if links else ()))
        for f in failures:
            w.writerow((f.kind, f.device, f.start_s, f.duration_s, f.factor) + ((f.target,) if links else ()))


def _cell(column: str, text: str, convert: type, what: str) -> Any:
    try:
        return convert(text)
    except ValueError:
        raise ValueError(f"column {column}: expected {what}, got {text!r}") from None


def read_csv(path: Path, *, num_devices: int | None = None) -> tuple[FailureEvent, ...]:
    """Failures from a CSV trace; a bad row raises ``ValueError`` naming the file and line."""
    text = read_text(path, "scenario CSV").removeprefix("\ufeff")  # a BOM, as spreadsheets save CSV
    rows = list(csv.reader(io.StringIO(text, newline="")))
    header = tuple(x.strip() for x in rows[0]) if rows else ()
    if header not in (_FIELDS, (*_FIELDS, _TARGET)):
        raise ValueError(
            f"{path}: the first line must be the header {','.join(_FIELDS)} (optionally ,{_TARGET})"
        )
    out = []
    stopped: dict[int, int] = {}  # device -> line of its fail-stop
    for line, row in enumerate(rows[1:], start=2):
        if not row or not "".join(row).strip():
            continue
        try:
            if len(row) != len(header):
                fill = (
                    f" (with a {_TARGET} column every row names one: compute or link)"
                    if _TARGET in header
                    else ""
                )
                raise ValueError(f"expected {len(header)} fields, got {len(row)}{fill}")
            if row[0].strip() == "fail-slow-link":  # the generated scenario's name, not a row kind
                raise ValueError(
                    f"column kind: {row[0].strip()!r} is a scenario name; write the row as fail-slow with a "
                    f"{_TARGET} column of link"
                )
            kind, dev, start, dur, factor, *target = (x.strip() for x in row)
            ev = FailureEvent(
                kind=kind,
                device=_cell("device", dev, int, "an integer"),
                start_s=_cell("start_s", start, float, "seconds"),
                duration_s=_cell("duration_s", dur, float, "seconds, or inf"),
                factor=_cell(
                    "factor", factor, float, "a speed in (0, 1]: 0.5 = half speed; 1 for a fail-stop"
                ),
                target=target[0] if target else "compute",
            )
        except ValueError as e:
            field = str(e).split(":")[0]  # FailureEvent's range errors name their field first
            raise ValueError(f"{path}:{line}: {'column ' if field in header else ''}{e}") from e
        if num_devices is not None and ev.device >= num_devices:
            raise ValueError(
                f"{path}:{line}: column device: device {ev.device} is not among the job's {num_devices} "
                f"devices (0..{num_devices - 1})"
            )
        if ev.kind == "fail-stop" and ev.device in stopped:
            raise ValueError(
                f"{path}:{line}: device {ev.device} already fails (fail-stop) at line {stopped[ev.device]}; "
                "a device stops once"
            )
        if ev.kind == "fail-stop":
            stopped[ev.device] = line
        out.append(ev)
    return tuple(out)
