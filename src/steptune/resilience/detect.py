"""Failure detectors: ResiHP's workload-aware one, and the baselines it is compared with.

Every detector takes one step at a time: ``observe(step, observed, predicted)`` with per-unit
(rank or stage) observed compute times and, for workload-aware detectors, the times predicted from
each unit's workload. It returns the alarms raised at that step; each episode alarms once.

- ``ResiHPDetector``: residual r = observed / predicted - 1 per unit; an alarm needs the gate
  (observed > gate x predicted, ResiHP's 25% rule), a robust z-score against the warm-up
  residuals or a one-sided CUSUM over the limit, for ``consecutive`` steps, then an optional
  validation callback (e.g. a GEMM probe on that rank). It localizes the unit and estimates the
  slowdown.
- ``FixedThresholdDetector``: a unit's time above (1 + threshold) x the median over units of the
  step (or the trailing median of step times): what many training jobs deploy.
- ``ChangePointDetector``: Greyhound-style Bayesian online change-point detection (Adams & MacKay)
  on step time; alarm when the run-length posterior collapses and the level rises by >= 10%.
- ``HeartbeatMonitor``: fail-stop from missed heartbeats.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

import numpy as np

__all__ = [
    "Alarm",
    "ChangePointDetector",
    "FixedThresholdDetector",
    "HeartbeatMonitor",
    "ResiHPConfig",
    "ResiHPDetector",
]


@dataclass(frozen=True, kw_only=True, slots=True)
class Alarm:
    step: int
    unit: int | None
    """The rank or stage blamed (None when the detector cannot localize)."""
    kind: str
    """"fail-slow", "fail-stop" or "fail-slow-link"."""
    slowdown: float
    detector: str
    link: tuple[int, int] | None = None
    """For a link alarm: the (sender, receiver) ranks of the slowest probed link."""


@dataclass(frozen=True, kw_only=True, slots=True)
class ResiHPConfig:
    gate: float = 1.15
    """Observed must exceed gate x predicted. ResiHP validates above 1.25; to catch every slowdown
    of 1.25x despite noise the gate sits below it (the CUSUM / z-score and the consecutive-step rule
    keep false alarms away)."""
    consecutive: int = 3
    """Steps in a row the condition must hold."""
    warmup: int = 10
    """Steps used to learn each unit's healthy residual distribution."""
    z_limit: float = 4.0
    cusum_k: float = 0.10
    """CUSUM slack: half of the smallest slowdown worth acting on."""
    cusum_h: float = 0.5
    recover: float = 1.10
    """An episode ends when observed falls back under recover x predicted."""

    def __post_init__(self) -> None:
        # found in a sweep: consecutive=0 raised an alarm every step, with slowdowns under 1
        for name, low in (("consecutive", 1), ("warmup", 2)):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < low:
                raise ValueError(f"ResiHPConfig.{name} must be a whole number >= {low}, got {value!r}")
        for name, low, strict in (
            ("gate", 1.0, False), ("z_limit", 0.0, True), ("cusum_k", 0.0, False), ("cusum_h", 0.0, True),
            ("recover", 1.0, False),
        ):  # fmt: skip
            value = getattr(self, name)
            ok = isinstance(value, int | float) and not isinstance(value, bool) and value < math.inf
            if not ok or value < low or (strict and value == low):
                rule = f"{'>' if strict else '>='} {low:g}"
                raise ValueError(f"ResiHPConfig.{name} must be a finite number {rule}, got {value!r}")


@dataclass
class _Unit:
    residuals: list[float] = field(default_factory=list)
    med: float = 0.0
    mad: float = 0.0
    cusum: float = 0.0
    hits: int = 0
    alarmed: bool = False


class ResiHPDetector:
    name = "resihp"

    def __init__(
        self, config: ResiHPConfig | None = None, validate: Callable[[int, float], bool] | None = None
    ) -> None:
        self.config = config or ResiHPConfig()
        self.validate = validate
        self._units: dict[int, _Unit] = {}
        self.validations = 0

    def observe(
        self, step: int, observed: Mapping[int, float], predicted: Mapping[int, float] | None = None
    ) -> list[Alarm]:
        if predicted is None:
            raise ValueError("ResiHPDetector needs predicted times (it is workload-aware)")
        cfg, alarms = self.config, []
        _check_times(observed, "observed")  # none (no unit ran this step): nothing to judge
        missing = [u for u in observed if u not in predicted]
        if missing:
            raise ValueError(
                f"step {step}: no predicted time for unit(s) {missing[:5]}: give one per observed unit"
            )
        _check_times({u: predicted[u] for u in observed}, "predicted", positive=True)
        for unit, obs in observed.items():
            pred = predicted[unit]
            st = self._units.setdefault(unit, _Unit())
            r = obs / pred - 1.0
            if len(st.residuals) < cfg.warmup:
                st.residuals.append(r)
                if len(st.residuals) == cfg.warmup:
                    arr = np.array(st.residuals)
                    st.med = float(np.median(arr))
                    st.mad = float(np.median(np.abs(arr - st.med))) * 1.4826 or 1e-3
                continue
            st.cusum = max(0.0, st.cusum + (r - st.med) - cfg.cusum_k)
            z = (r - st.med) / st.mad
            hit = obs > cfg.gate * pred and (z > cfg.z_limit or st.cusum > cfg.cusum_h)
            st.hits = st.hits + 1 if hit else 0
            if st.alarmed and obs < cfg.recover * pred:
                st.alarmed, st.cusum = False, 0.0
            if st.hits >= cfg.consecutive and not st.alarmed:
                self.validations += 1
                if self.validate is None or self.validate(unit, obs / pred):
                    alarms.append(
                        Alarm(step=step, unit=unit, kind="fail-slow", slowdown=obs / pred, detector=self.name)
                    )
                    st.alarmed = True
                st.hits = 0
        return alarms


class FixedThresholdDetector:
    """Alarm when a unit's time exceeds (1 + threshold) x the median unit time of the same step."""

    name = "fixed-threshold"

    def __init__(self, threshold: float = 0.10, *, consecutive: int = 1) -> None:
        # consecutive=0 alarmed every healthy unit every step and never the slow one (a sweep)
        if not (isinstance(threshold, int | float) and math.isfinite(threshold) and threshold >= 0):
            raise ValueError(
                f"threshold must be a finite fraction >= 0 (0.10: 10% over the median), got {threshold!r}"
            )
        if isinstance(consecutive, bool) or not isinstance(consecutive, int) or consecutive < 1:
            raise ValueError(f"consecutive must be a whole number of steps >= 1, got {consecutive!r}")
        self.threshold = threshold
        self.consecutive = consecutive
        self._hits: dict[int, int] = {}

    def observe(
        self, step: int, observed: Mapping[int, float], predicted: Mapping[int, float] | None = None
    ) -> list[Alarm]:
        _check_times(observed, "observed")
        if not observed:
            return []
        med = float(np.median(list(observed.values())))
        alarms = []
        for unit, obs in observed.items():
            hit = obs > (1 + self.threshold) * med
            self._hits[unit] = self._hits.get(unit, 0) + 1 if hit else 0
            if self._hits[unit] == self.consecutive:
                alarms.append(
                    Alarm(step=step, unit=unit, kind="fail-slow", slowdown=obs / med, detector=self.name)
                )
        return alarms


class ChangePointDetector:
    """Bayesian online change-point detection on one series (step time), Gaussian, known variance."""

    name = "change-point"

    def __init__(
        self,
        *,
        hazard: float = 1 / 200,
        level_change: float = 0.10,
        collapse: float = 0.9,
        warmup: int = 10,
        max_run: int = 300,
    ) -> None:
        self.hazard = hazard
        self.level_change = level_change
        self.collapse = collapse
        self.warmup = warmup
        self.max_run = max_run
        self._xs: list[float] = []
        self._probs = np.array([1.0])
        self._sums = np.array([0.0])
        self._counts = np.array([0.0])
        self._sigma = 0.0
        self._base = 0.0
        self._alarmed = False

    def observe(
        self, step: int, observed: Mapping[int, float], predicted: Mapping[int, float] | None = None
    ) -> list[Alarm]:
        _check_times(observed, "observed")
        if not observed:  # no unit ran this step ("max() arg is an empty sequence" before)
            return []
        x = max(observed.values())  # the step is as slow as its slowest unit
        self._xs.append(x)
        if len(self._xs) <= self.warmup:
            if len(self._xs) == self.warmup:
                arr = np.array(self._xs)
                self._base = float(np.median(arr))
                self._sigma = float(np.std(arr)) or 1e-6 * self._base
            return []
        # Predictive probability of x under each run length (posterior mean of the segment).
        prior_mean = self._base
        means = np.where(self._counts > 0, (self._sums + prior_mean) / (self._counts + 1), prior_mean)
        var = self._sigma**2 * (1 + 1 / (self._counts + 1))
        # in log space: a step many sigmas away (a 1.5x slowdown at 1% noise) underflowed every likelihood
        # to 0, and the all-zero posterior then never alarmed again (a 2026-12-05 sweep)
        log_like = -0.5 * (x - means) ** 2 / var - 0.5 * np.log(2 * math.pi * var)
        with np.errstate(divide="ignore"):
            joint = np.log(self._probs) + log_like
        top = float(joint.max())
        change = top + math.log(float(np.exp(joint - top).sum())) + math.log(self.hazard)
        logs = np.concatenate([[change], joint + math.log(1 - self.hazard)])
        probs = np.exp(logs - logs.max())
        probs /= probs.sum()
        self._probs = probs[: self.max_run]
        self._sums = np.concatenate([[0.0], self._sums + x])[: self.max_run]
        self._counts = np.concatenate([[0.0], self._counts + 1])[: self.max_run]
        short = float(self._probs[:3].sum())
        alarms = []
        if short > self.collapse and x > (1 + self.level_change) * self._base and not self._alarmed:
            unit = max(observed, key=lambda u: observed[u])
            alarms.append(
                Alarm(step=step, unit=unit, kind="fail-slow", slowdown=x / self._base, detector=self.name)
            )
            self._alarmed = True
        elif self._alarmed and x < (1 + self.level_change / 2) * self._base:
            self._alarmed = False
        return alarms


class HeartbeatMonitor:
    """Fail-stop: a unit whose last heartbeat is older than ``timeout`` seconds is declared dead (once)."""

    name = "heartbeat"

    def __init__(self, timeout: float = 10.0) -> None:
        if not (
            isinstance(timeout, int | float) and math.isfinite(timeout) and timeout > 0
        ):  # nan never alarmed
            raise ValueError(f"timeout must be a finite number of seconds > 0, got {timeout!r}")
        self.timeout = timeout
        self._dead: set[int] = set()

    def check(self, step: int, now: float, last_beat: Mapping[int, float]) -> list[Alarm]:
        alarms = []
        for unit, t in last_beat.items():
            if now - t > self.timeout and unit not in self._dead:
                self._dead.add(unit)
                alarms.append(
                    Alarm(step=step, unit=unit, kind="fail-stop", slowdown=math.inf, detector=self.name)
                )
        return alarms


def _check_times(times: Mapping[int, float], what: str, positive: bool = False) -> None:
    """Every time a finite number >= 0 (> 0 with ``positive``): one NaN in a unit's
    warm-up made its baseline NaN, and no slowdown of it was ever found after (a sweep)."""
    for unit, t in times.items():
        ok = isinstance(t, numbers.Real) and not isinstance(t, bool) and math.isfinite(t)
        if not ok or t < 0 or (positive and t == 0):
            bound = "> 0" if positive else ">= 0"
            raise ValueError(
                f"{what} time of unit {unit} must be a finite number of seconds {bound}, got {t!r}"
            )
