"""Replay a recorded training trace through the failure detectors (the real 128-GPU ``SE`` trace).

The trace (ByteDance-Seed/StragglerAnalysis, ``../shared/data/straggler-trace-SE/``) holds one row per
recorded operation of a healthy DP 32 x PP 2 job whose slowdowns come from sequence-length imbalance.
It has no sequence lengths, so the workload-predicted time of a rank is derived from its pipeline
partner: both stages of one DP rank process the same microbatches, so the partner stage's compute
time for the same ``mb_id`` carries the workload, and the ratio between the two stages does not.

Contract:

- Units are global ranks (the ``rank`` column). Observed time of a rank in a step = sum of its
  forward-compute and backward-compute durations; waits inside communication are excluded.
- Predicted time of (dp rank, stage s) = ratio_s x its partner's compute time over the same
  microbatches. ratio_s is the median of t_s / t_partner over the microbatches of the first
  ``warmup_steps`` usable steps, pooled over DP ranks by default (smaller residuals on ``SE`` than
  one ratio per DP rank, and one slow device in the warm-up barely moves it).
- The warm-up steps stay in the returned list: the detectors run their own warm-up on them, and
  in-sample residuals are tighter, which only makes a false alarm more likely, not less.
- A step where some rank and its partner did not record the same complete microbatches (forward
  and backward) is skipped with a warning that counts the skipped steps.
- Approximate: a slowdown of a whole DP rank (both stages) is invisible to this predictor, because
  each stage is predicted from the other.
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import numpy as np

from steptune.resilience.detect import Alarm, ResiHPDetector

__all__ = [
    "StepObs",
    "TraceConfig",
    "TraceStats",
    "default_trace_path",
    "inject_fail_slow",
    "load_trace",
    "replay",
    "trace_stats",
    "trace_steps",
]

TRACE_ENV = "STEPTUNE_STRAGGLER_TRACE"
_COMPUTE = ("forward-compute", "backward-compute")
_REQUIRED = ("dp_rank", "stage", "rank", "step", "optype", "start_ts", "duration", "mb_id")


@dataclass(frozen=True, kw_only=True, slots=True)
class TraceConfig:
    warmup_steps: int = 10
    """Usable steps whose microbatches set the stage-to-partner time ratio."""
    pooled_ratio: bool = True
    """One ratio per stage pooled over DP ranks (False: one ratio per DP rank and stage)."""


@dataclass(frozen=True, kw_only=True, slots=True)
class StepObs:
    step: int
    """Training step number as recorded in the trace."""
    observed: Mapping[int, float]
    """Compute seconds per global rank."""
    predicted: Mapping[int, float]
    """Workload-predicted compute seconds per global rank (from the partner stage)."""


@dataclass(frozen=True, kw_only=True, slots=True)
class TraceStats:
    num_ranks: int
    num_steps: int
    forward_cv: float
    """CV of per-microbatch forward-compute durations over the whole trace."""
    forward_rank_cv: float
    """Mean over steps of the CV across ranks of per-rank forward-compute time in the step."""
    step_time_mean: float
    """Step time: first op start to last op end over all ranks (``start_ts`` is step-relative)."""
    step_time_cv: float
    step_max_over_median: float
    frac_steps_over_1p1: float
    """Fraction of steps slower than 1.1 x the median step: how often a fixed 10% rule would fire."""


class _Detector(Protocol):
    name: str

    def observe(
        self, step: int, observed: Mapping[int, float], predicted: Mapping[int, float] | None = None
    ) -> list[Alarm]: ...


def default_trace_path() -> Path:
    """``$STEPTUNE_STRAGGLER_TRACE`` if set, else the shared copy beside this repository."""
    env = os.environ.get(TRACE_ENV)
    if env:
        return Path(env)
    root = Path(__file__).resolve().parents[3]
    return (root / ".." / "shared" / "data" / "straggler-trace-SE" / "trace-SE.parquet").resolve()


def load_trace(path: str | os.PathLike[str] | None = None) -> dict[str, np.ndarray]:
    """Columns of a StragglerAnalysis parquet trace as numpy arrays (``optype`` as str)."""
    path = Path(path) if path is not None else default_trace_path()
    if not path.is_file():
        raise FileNotFoundError(
            f"straggler trace not found at {path}; pass its path or set {TRACE_ENV} to trace-SE.parquet "
            "(ByteDance-Seed/StragglerAnalysis, data/trace-SE.parquet)"
        )
    try:
        import pyarrow as pa
        import pyarrow.parquet as pq
    except ImportError as e:
        raise ImportError("reading parquet traces needs pyarrow: pip install steptune[data]") from e
    table = pq.read_table(path)
    columns = {}
    for name in table.column_names:
        col = table.column(name)
        if pa.types.is_dictionary(col.type) or pa.types.is_string(col.type):
            columns[name] = np.asarray(col.cast(pa.string()).to_numpy(zero_copy_only=False), dtype=str)
        else:
            columns[name] = col.to_numpy()
    return columns


def _check_columns(columns: Mapping[str, np.ndarray]) -> None:
    missing = [c for c in _REQUIRED if c not in columns]
    if missing:
        raise ValueError(f"trace lacks columns {missing}; expected the StragglerAnalysis trace format")


def trace_steps(columns: Mapping[str, np.ndarray], config: TraceConfig | None = None) -> list[StepObs]:
    """Per usable recorded step, observed and partner-predicted compute time of every rank."""
    cfg = config or TraceConfig()
    _check_columns(columns)
    if cfg.warmup_steps < 1:
        raise ValueError(f"warmup_steps must be >= 1, got {cfg.warmup_steps}")
    compute = np.isin(columns["optype"], _COMPUTE)
    steps, step_i = np.unique(columns["step"][compute], return_inverse=True)
    dps, dp_i = np.unique(columns["dp_rank"][compute], return_inverse=True)
    stages, stage_i = np.unique(columns["stage"][compute], return_inverse=True)
    if len(stages) != 2:
        raise ValueError(
            f"partner-stage prediction needs exactly 2 pipeline stages, the trace has {stages.tolist()}"
        )
    mb = columns["mb_id"][compute].astype(np.int64)
    if mb.min() < 0:
        raise ValueError("compute ops need mb_id >= 0 (microbatch id)")
    rank = columns["rank"][compute].astype(np.int64)
    ranks = np.full((len(dps), 2), -1, dtype=np.int64)
    ranks[dp_i, stage_i] = rank
    if not (ranks[dp_i, stage_i] == rank).all():
        raise ValueError("the trace maps one (dp_rank, stage) to several global ranks")

    # Dense (step, dp, stage, microbatch) tables; absent entries stay 0.
    shape = (len(steps), len(dps), 2, int(mb.max()) + 1)
    times = np.zeros(shape)
    num_fwd = np.zeros(shape, dtype=np.int64)
    num_bwd = np.zeros(shape, dtype=np.int64)
    idx = (step_i, dp_i, stage_i, mb)
    np.add.at(times, idx, columns["duration"][compute].astype(np.float64))
    is_fwd = columns["optype"][compute] == "forward-compute"
    np.add.at(num_fwd, idx, is_fwd)
    np.add.at(num_bwd, idx, ~is_fwd)
    complete = (num_fwd > 0) & (num_bwd > 0)
    seen = (num_fwd + num_bwd) > 0
    usable = (
        (seen == complete).all(axis=(1, 2, 3))
        & (complete == complete[:, :, ::-1]).all(axis=(1, 2, 3))
        & np.all(np.any(complete, axis=3), axis=(1, 2))
    )
    num_skipped = int((~usable).sum())
    if num_skipped:
        warnings.warn(
            f"skipped {num_skipped} of {len(steps)} steps where a rank and its partner stage did not "
            "record the same complete microbatches",
            stacklevel=2,
        )
    keep = np.flatnonzero(usable)
    if len(keep) < cfg.warmup_steps:
        raise ValueError(
            f"only {len(keep)} usable steps, fewer than warmup_steps={cfg.warmup_steps}; lower warmup_steps"
        )
    times, complete = times[keep], complete[keep]
    partner = times[:, :, ::-1, :]

    # Stage-to-partner ratio over the warm-up microbatches (per stage, pooled or per DP rank).
    w = cfg.warmup_steps
    per_mb = np.where(complete[:w], times[:w] / np.where(complete[:w], partner[:w], 1.0), np.nan)
    if cfg.pooled_ratio:
        ratio = np.broadcast_to(np.nanmedian(per_mb, axis=(0, 1, 3)), (len(dps), 2))
    else:
        ratio = np.nanmedian(per_mb, axis=(0, 3))
    observed = times.sum(axis=3)
    predicted = ratio * partner.sum(axis=3)

    unit = ranks.ravel().tolist()
    return [
        StepObs(
            step=int(steps[k]),
            observed=dict(zip(unit, observed[i].ravel().tolist(), strict=True)),
            predicted=dict(zip(unit, predicted[i].ravel().tolist(), strict=True)),
        )
        for i, k in enumerate(keep)
    ]


def inject_fail_slow(
    columns: Mapping[str, np.ndarray], *, rank: int, start_step: int, factor: float
) -> dict[str, np.ndarray]:
    """Copy of ``columns`` with ``rank``'s compute ops from ``start_step`` on taking ``factor`` x longer.

    Injected at the op level, so the partner's prediction (derived from this rank) rises too, as it
    would on a real cluster; the partner's own times, and so this rank's prediction, are untouched.
    """
    _check_columns(columns)
    if factor <= 0:
        raise ValueError(f"factor must be > 0, got {factor}")
    if rank not in set(columns["rank"].tolist()):
        raise ValueError(f"rank {rank} is not in the trace")
    hit = (columns["rank"] == rank) & (columns["step"] >= start_step) & np.isin(columns["optype"], _COMPUTE)
    out = dict(columns)
    duration = columns["duration"].copy()
    duration[hit] *= factor
    out["duration"] = duration
    return out


def replay(detectors: Sequence[_Detector], steps: Sequence[StepObs]) -> dict[str, list[Alarm]]:
    """Feed every step to every detector in order; alarms by detector name.

    ``ResiHPDetector`` gets the predicted times; the baselines see observed times only.
    """
    names = [d.name for d in detectors]
    if len(set(names)) != len(names):
        raise ValueError(f"detector names must be distinct to key the result, got {names}")
    alarms: dict[str, list[Alarm]] = {n: [] for n in names}
    for obs in steps:
        for det in detectors:
            predicted = obs.predicted if isinstance(det, ResiHPDetector) else None
            alarms[det.name].extend(det.observe(obs.step, obs.observed, predicted))
    return alarms


def _cv(x: np.ndarray, axis: int | None = None) -> np.ndarray:
    return np.asarray(np.std(x, axis=axis) / np.mean(x, axis=axis))


def trace_stats(columns: Mapping[str, np.ndarray]) -> TraceStats:
    """Healthy-variability statistics to calibrate simulated workloads against."""
    _check_columns(columns)
    fwd = columns["optype"] == "forward-compute"
    dur = columns["duration"].astype(np.float64)
    steps, step_i = np.unique(columns["step"], return_inverse=True)
    ranks, rank_i = np.unique(columns["rank"], return_inverse=True)
    per_rank = np.zeros((len(steps), len(ranks)))
    np.add.at(per_rank, (step_i[fwd], rank_i[fwd]), dur[fwd])
    end = np.full(len(steps), -np.inf)
    start = np.full(len(steps), np.inf)
    np.maximum.at(end, step_i, columns["start_ts"].astype(np.float64) + dur)
    np.minimum.at(start, step_i, columns["start_ts"].astype(np.float64))
    step_time = end - start
    med = float(np.median(step_time))
    return TraceStats(
        num_ranks=len(ranks),
        num_steps=len(steps),
        forward_cv=float(_cv(dur[fwd])),
        forward_rank_cv=float(np.mean(_cv(per_rank, axis=1))),
        step_time_mean=float(step_time.mean()),
        step_time_cv=float(_cv(step_time)),
        step_max_over_median=float(step_time.max() / med),
        frac_steps_over_1p1=float(np.mean(step_time > 1.1 * med)),
    )
