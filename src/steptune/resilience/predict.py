"""Microbatch time predictor: t = c0 + c1 * N + c2 * Q per (stage, phase), learned online.

Fitted by non-negative least squares (scipy) on a warm-up window, then updated by recursive least
squares with forgetting, but only on samples the caller marks healthy (a predictor must never learn
a failure). Iteration time is the critical path of the pipeline schedule with predicted per-action
times (``steptune.pipeline.simulate`` with per-action durations).

Contract: predictions are in the units of the observations (seconds); a key with too few warm-up
samples raises ``ValueError`` naming the key, rather than guessing.
"""

from __future__ import annotations

from collections.abc import Hashable
from dataclasses import dataclass, field

import numpy as np
from scipy.optimize import nnls

__all__ = ["PredictorConfig", "WorkloadPredictor", "mape"]


@dataclass(frozen=True, kw_only=True, slots=True)
class PredictorConfig:
    warmup: int = 20
    """Samples per key before the first NNLS fit."""
    forgetting: float = 0.99
    """RLS forgetting factor (1.0: never forget)."""
    healthy_band: float = 0.15
    """After warm-up, a sample updates the model only if |observed / predicted - 1| is within this band."""


@dataclass
class _KeyState:
    xs: list[np.ndarray] = field(default_factory=list)
    ys: list[float] = field(default_factory=list)
    coef: np.ndarray | None = None
    cov: np.ndarray | None = None


class WorkloadPredictor:
    """One linear model per key (e.g. ``(stage, phase)``) over features [1, N, Q]."""

    def __init__(self, config: PredictorConfig | None = None) -> None:
        self.config = config or PredictorConfig()
        self._keys: dict[Hashable, _KeyState] = {}

    @staticmethod
    def _x(n: float, q: float) -> np.ndarray:
        # Scale features to comparable magnitudes so the fits are well conditioned.
        return np.array([1.0, n / 1e4, q / 1e8])

    def ready(self, key: Hashable) -> bool:
        st = self._keys.get(key)
        return st is not None and st.coef is not None

    def predict(self, key: Hashable, n: float, q: float) -> float:
        st = self._keys.get(key)
        if st is None or st.coef is None:
            have = 0 if st is None else len(st.ys)
            raise ValueError(
                f"predictor key {key!r} has {have} of {self.config.warmup} warm-up samples; "
                "observe more healthy microbatches first"
            )
        return float(self._x(n, q) @ st.coef)

    def observe(self, key: Hashable, n: float, q: float, t: float) -> bool:
        """Feed one sample; returns whether it was used (warm-up, or inside the healthy band)."""
        st = self._keys.setdefault(key, _KeyState())
        x = self._x(n, q)
        if st.coef is None:
            st.xs.append(x)
            st.ys.append(t)
            if len(st.ys) >= self.config.warmup:
                a, b = np.array(st.xs), np.array(st.ys)
                st.coef, _ = nnls(a, b)
                st.cov = np.linalg.pinv(a.T @ a + 1e-9 * np.eye(3))
            return True
        pred = float(x @ st.coef)
        if pred <= 0 or abs(t / pred - 1) > self.config.healthy_band:
            return False
        # Recursive least squares with forgetting.
        lam = self.config.forgetting
        assert st.cov is not None
        px = st.cov @ x
        gain = px / (lam + x @ px)
        st.coef = np.maximum(st.coef + gain * (t - pred), 0.0)
        st.cov = (st.cov - np.outer(gain, px)) / lam
        return True


def mape(pred: np.ndarray | list[float], obs: np.ndarray | list[float]) -> float:
    p, o = np.asarray(pred, dtype=float), np.asarray(obs, dtype=float)
    return float(np.mean(np.abs(p - o) / o))
