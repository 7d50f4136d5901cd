"""Sequence-length variability in the cluster simulator: each step's global batch of packed microbatches.

``sim.run`` prices a plan with the mean microbatch. With a ``BatchWorkload`` every step draws its own
global batch (the ``code`` length preset packed into ``tokens_per_microbatch``), and the cost of each
microbatch relative to the mean (linear in tokens, quadratic in the sum of squared sequence lengths, from
the model's FLOP coefficients) decides how much work each DP replica gets:

- dealt by count (Megatron's data sampler, and every baseline: their redistributions change counts,
  not which microbatches): replica r takes the next ``c_r`` microbatches of the batch;
- assigned by predicted cost (ResiHP's workload-aware DP step, and steptune's): longest-predicted first,
  each to the replica with the least predicted work per planned microbatch, so the split balances the
  batch's variability around the plan's counts (it never changes the counts: with equal microbatches
  every replica gets exactly its count); predictions carry the predictor's error (lognormal,
  ``Policy.assignment_error``); the oracle's are exact.

A replica's time scales with its work over its planned work (``T_r x load_r / c_r``, the pipeline's
fill and drain ignored), and the step's compute time scales by max_r(T_r x_r) / max_r(T_r), where T_r
are the plain 1F1B times of the plan's replicas under the true speeds (a replica with a dead stage,
rerouted, at the slowest priced replica's time). A policy that prices its own steps (ReCycle's
rerouting, Adaptra's rescheduling) gets the same factor on its price. The DP gradient sync does not
scale. Everything here is SIMULATED.

Opt-in (``--lengths``), not used for the bench's figures: the linear scaling misprices deep pipelines.
Checked with ``pipeline.simulate`` and per-microbatch durations at the bench's shape (16 stages, 32
microbatches per replica, 4 replicas, cost CV 0.33, 30 steps):
- The 1F1B step is 38% above the equal-microbatch one when the microbatches run in batch order.
- Balancing the replicas' totals does not shorten it: 1.380 dealt by count, 1.385 split by cost.
- Running each replica's microbatches longest first does: 1.072 dealt by count, 1.037 with equal
  counts and balanced totals.
The linear model instead gives 1.037 by count and 0.999 by cost. So in such pipelines the order of the
microbatches matters more than how their totals are split. A balanced split pays (3.3%) only
together with that ordering, which neither the paper's description nor our policies include. Pricing
batch order needs the exact per-replica schedule every step (0.58 ms per replica for plain 1F1B). The
rerouting and rescheduling prices have no per-microbatch form yet.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from steptune.core.specs import Phase, cluster_preset, model_preset
from steptune.resilience.plan import ExecutionPlan
from steptune.resilience.workload import LENGTH_PRESETS, LengthDist, StageModel, features, pack

__all__ = ["PREDICTION_SIGMA", "BatchWorkload", "replica_work", "workload_factor"]

PREDICTION_SIGMA = 0.03
"""Log-error of ResiHP's microbatch-time predictor: a lognormal sigma of 0.03 is a mean absolute error of
2.4%, the microbatch MAPE our predictor measures on healthy simulated runs (docs/resilience.md)."""

_MEAN_SAMPLES = 4096


@dataclass(frozen=True, kw_only=True)
class BatchWorkload:
    """Per-step relative costs of a global batch's packed microbatches (mean 1 over the distribution)."""

    lengths: LengthDist
    token_budget: int
    microbatches: int
    lin: float
    """FLOPs per token of the whole model (F + B + W)."""
    quad: float
    """FLOPs per squared sequence length of the whole model."""
    seed: int = 0

    @classmethod
    def for_job(
        cls,
        model: str,
        *,
        token_budget: int,
        microbatches: int,
        lengths: str | LengthDist = "code",
        seed: int = 0,
    ) -> BatchWorkload:
        dist = LENGTH_PRESETS[lengths] if isinstance(lengths, str) else lengths
        layers = model_preset(model).layers
        stage = StageModel(layers=tuple(layers), device=cluster_preset("a100-256").device)
        lin = quad = 0.0
        for ph in (Phase.F, Phase.B, Phase.W):
            a, b = stage.coefficients(ph)
            lin, quad = lin + a, quad + b
        return cls(
            lengths=dist, token_budget=token_budget, microbatches=microbatches, lin=lin, quad=quad, seed=seed
        )

    def _raw(self, rng: np.random.Generator, n: int) -> np.ndarray:
        nq = np.array([features(p) for p in pack(rng, self.lengths, self.token_budget, n)])
        return self.lin * nq[:, 0] + self.quad * nq[:, 1]

    @functools.cached_property
    def mean_cost(self) -> float:
        """The distribution's mean microbatch cost (FLOPs), from a fixed sample."""
        return float(self._raw(np.random.default_rng([self.seed, 2**31]), _MEAN_SAMPLES).mean())

    def costs(self, step: int) -> np.ndarray:
        """Step ``step``'s microbatch costs over the mean, in batch order (the same for every policy)."""
        return _costs(self, step)

    def predicted(self, step: int, sigma: float) -> np.ndarray:
        """``costs(step)`` as a predictor with log-error ``sigma`` sees them (0: exact)."""
        w = self.costs(step)
        if sigma <= 0:
            return w
        rng = np.random.default_rng([self.seed, step, 1])
        return w * np.exp(rng.normal(0.0, sigma, size=w.shape))


@functools.lru_cache(maxsize=4096)
def _costs(wl: BatchWorkload, step: int) -> np.ndarray:
    out = wl._raw(np.random.default_rng([wl.seed, step]), wl.microbatches) / wl.mean_cost
    out.flags.writeable = False
    return out


def replica_work(
    counts: Sequence[int], costs: np.ndarray, predicted: np.ndarray | None = None
) -> list[float]:
    """Per replica, its work over its planned work (x_r; 1.0 for an empty replica).

    ``predicted`` None: dealt by count in batch order. Else longest-predicted first, each microbatch to
    the replica whose predicted load per planned microbatch is lowest: the cost-aware split balances
    the batch's variability around the plan's counts and never changes what the counts themselves say
    about speeds (with equal microbatches it gives every replica exactly its count)."""
    n = len(counts)
    used = [r for r in range(n) if counts[r] > 0]
    load = [0.0] * n
    if predicted is None:
        start = 0
        for r in range(n):
            load[r] = float(costs[start : start + counts[r]].sum())
            start += counts[r]
    else:
        guess = [0.0] * n
        for i in np.argsort(-predicted, kind="stable"):
            r = min(used, key=lambda q: (guess[q] + predicted[i]) / counts[q])
            guess[r] += float(predicted[i])
            load[r] += float(costs[i])
    return [load[r] / counts[r] if counts[r] > 0 else 1.0 for r in range(n)]


def workload_factor(
    plan: ExecutionPlan,
    times: Sequence[float],
    costs: np.ndarray,
    predicted: np.ndarray | None = None,
) -> float:
    """max_r(T_r x x_r) / max_r(T_r), with ``times`` the replicas' plain times under the true speeds.

    A replica the plain model cannot price (a dead stage whose work a rerouting mechanism spreads over
    its peers) still runs its own microbatches through its live stages and those peers: it counts at
    the slowest priced replica's time. 1.0 when no replica is priced."""
    if len(costs) != sum(plan.microbatches):  # a plan that runs fewer or more microbatches: cycle the batch
        costs = np.resize(costs, sum(plan.microbatches))
        predicted = None if predicted is None else np.resize(predicted, len(costs))
    x = replica_work(plan.microbatches, costs, predicted)
    finite = [t for t, m in zip(times, plan.microbatches, strict=True) if m and math.isfinite(t)]
    if not finite or max(finite) <= 0:
        return 1.0
    plain = max(finite)
    return (
        max(
            (t if math.isfinite(t) else plain) * xr
            for t, xr, m in zip(times, x, plan.microbatches, strict=True)
            if m
        )
        / plain
    )
