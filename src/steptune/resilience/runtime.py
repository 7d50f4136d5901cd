"""``Runtime``: ResiHP's detector and DP rebalancing inside a real torch.distributed training loop.

A loop adds four calls (docs/resilience.md shows the whole loop)::

    rt = Runtime(group, stage_model, RuntimeConfig(), faults=[SlowFault(rank=1, factor=1.6, start=20)])
    for step in range(steps):
        for i in rt.assign(lengths):                     # this rank's microbatches under the current plan
            with rt.timed(lengths[i]):                   # forward + backward of microbatch i
                loss_sum(model, batch[i]).backward()
        all_reduce_grads(...)                            # the loop's own collective
        report = rt.end_step()                           # gather timings -> predictor -> detector -> plan

Contract. Every rank passes the same global list of microbatches (lengths) each step, so the assignment,
which is a deterministic function of gathered data, is identical everywhere without extra messages.
``end_step`` all-gathers each rank's measured microbatch times on ``group`` (gloo or NCCL). The predictor
and detector then run on identical inputs on every rank, and a new plan (per-rank speeds) takes effect at
the next step. That step boundary is the safe point.

Emulated device time (``RuntimeConfig.emulate``): on a box where ranks share a few CPU cores, real compute
times are contention noise. Each microbatch therefore lasts the cost model's time (``StageModel``) x the
rank's injected slowdown x lognormal noise, scaled by ``time_scale`` to wall seconds. Real compute fills the
first part of that interval and a sleep fills the rest. Observed times are measured around the block
(``perf_counter``), so a slow real computation shows up too. With ``emulate=False`` the real times are used
as they are (GPUs).
"""

from __future__ import annotations

import contextlib
import math
import statistics
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from steptune.resilience.detect import Alarm, ResiHPConfig, ResiHPDetector
from steptune.resilience.predict import PredictorConfig, WorkloadPredictor
from steptune.resilience.workload import StageModel, features

__all__ = ["IterationThreshold", "Runtime", "RuntimeConfig", "SlowFault", "StepReport", "lpt_assign"]


@dataclass(frozen=True, kw_only=True, slots=True)
class SlowFault:
    """Rank ``rank`` runs ``factor`` x slower from step ``start`` for ``duration`` steps (None: forever)."""

    rank: int
    factor: float
    start: int
    duration: int | None = None

    def factor_at(self, rank: int, step: int) -> float:
        if rank != self.rank or step < self.start:
            return 1.0
        if self.duration is not None and step >= self.start + self.duration:
            return 1.0
        return self.factor


@dataclass(frozen=True, kw_only=True, slots=True)
class RuntimeConfig:
    emulate: bool = True
    """Emulated device time (CPU boxes); False: real measured times (GPUs)."""
    time_scale: float = 0.01
    """Wall seconds per emulated device second."""
    noise_sigma: float = 0.05
    """Lognormal sigma of per-microbatch device-time noise (kernel jitter)."""
    adapt: bool = True
    """Rebalance after a detection (False: detect and report only, the unmitigated baseline)."""
    detector: ResiHPConfig = field(default_factory=ResiHPConfig)
    predictor: PredictorConfig = field(default_factory=lambda: PredictorConfig(warmup=12, refit_every=8))
    iteration_threshold: float = 0.10
    """The baseline rule reported alongside: alarm when an iteration exceeds its trailing median by this."""
    seed: int = 0


@dataclass(frozen=True, kw_only=True, slots=True)
class StepReport:
    step: int
    wall_s: float
    """Measured wall time of the step (end_step to end_step), in emulated seconds when emulating."""
    tokens: int
    rank_compute_s: tuple[float, ...]
    rank_predicted_s: tuple[float, ...] | None
    alarms: tuple[Alarm, ...]
    threshold_alarm: bool
    speeds: tuple[float, ...]
    """Relative speeds the next step's plan uses."""


class IterationThreshold:
    """Alarm when an iteration takes more than (1 + threshold) x the median of the previous ``window``."""

    def __init__(self, threshold: float = 0.10, window: int = 10, warmup: int = 5) -> None:
        self.threshold, self.window, self.warmup = threshold, window, warmup
        self._times: list[float] = []

    def observe(self, t: float) -> bool:
        hit = len(self._times) >= self.warmup and t > (1 + self.threshold) * statistics.median(
            self._times[-self.window :]
        )
        self._times.append(t)
        return hit


def lpt_assign(costs: Sequence[float], speeds: Sequence[float]) -> list[list[int]]:
    """Longest-processing-time-first: each item to the rank whose load (time at its speed) ends first."""
    loads = [0.0] * len(speeds)
    out: list[list[int]] = [[] for _ in speeds]
    for i in sorted(range(len(costs)), key=lambda i: (-costs[i], i)):
        r = min(range(len(speeds)), key=lambda r: (loads[r] + costs[i] / speeds[r], r))
        loads[r] += costs[i] / speeds[r]
        out[r].append(i)
    return [sorted(x) for x in out]


class Runtime:
    def __init__(
        self,
        group: Any,
        stage: StageModel,
        config: RuntimeConfig | None = None,
        *,
        faults: Sequence[SlowFault] = (),
    ) -> None:
        self.group = group
        self.rank, self.world = group.rank(), group.size()
        self.stage = stage
        self.config = config or RuntimeConfig()
        self.faults = tuple(faults)
        for f in self.faults:
            if not 0 <= f.rank < self.world or f.factor <= 0:
                raise ValueError(f"{f}: rank must be in [0, {self.world}) and factor > 0")
        self.predictor = WorkloadPredictor(self.config.predictor)
        self.detector = ResiHPDetector(self.config.detector)
        self.threshold = IterationThreshold(self.config.iteration_threshold)
        self.speeds = [1.0] * self.world
        self.step = 0
        self.reports: list[StepReport] = []
        self._rng = np.random.default_rng((self.config.seed, self.rank))
        self._samples: list[tuple[float, float, float]] = []  # (N, Q, observed device seconds)
        self._tokens = 0
        self._last = time.perf_counter()

    # -- the plan ------------------------------------------------------------------------------------
    def cost(self, lengths: Sequence[int]) -> float:
        """Predicted whole-model F+B+W seconds of a microbatch on a healthy device (cost model until warm)."""
        n, q = features(lengths)
        if self.predictor.ready("fb"):
            return max(self.predictor.predict("fb", n, q), 1e-9)
        return self.stage.time(lengths, "F") + self.stage.time(lengths, "B") + self.stage.time(lengths, "W")

    def assign(self, microbatches: Sequence[Sequence[int]]) -> list[int]:
        """Indices of this step's microbatches this rank runs (FLOPs- and speed-aware LPT)."""
        self._tokens = sum(sum(mb) for mb in microbatches)
        return lpt_assign([self.cost(mb) for mb in microbatches], self.speeds)[self.rank]

    # -- timing --------------------------------------------------------------------------------------
    def slowdown(self) -> float:
        return math.prod(f.factor_at(self.rank, self.step) for f in self.faults)

    @contextlib.contextmanager
    def timed(
        self,
        lengths: Sequence[int],
        *,
        part: StageModel | None = None,
        phases: Sequence[str] = ("F", "B", "W"),
        fraction: float = 1.0,
    ) -> Iterator[None]:
        """Time the block: ``phases`` of one microbatch on ``part`` of the model (default: all of it),
        of which this device does ``fraction`` (1/k in a TP group of k).

        Emulates device time if configured. The sample is scaled to whole-model F+B+W time by the cost
        model's share of ``part``, ``phases`` and ``fraction`` in it, so the predictor and detector
        compare ranks that hold different layers (pipeline stages) or shards (TP) on one scale.
        """
        if not 0 < fraction <= 1:
            raise ValueError(f"fraction must be in (0, 1], got {fraction}")
        cfg = self.config
        part = part or self.stage
        nominal = sum(part.time(lengths, p) for p in phases) * fraction
        share = nominal / sum(self.stage.time(lengths, p) for p in ("F", "B", "W"))
        t0 = time.perf_counter()
        yield
        if cfg.emulate:
            device = nominal * self.slowdown() * float(self._rng.lognormal(0.0, cfg.noise_sigma))
            rest = device * cfg.time_scale - (time.perf_counter() - t0)
            if rest > 0:
                time.sleep(rest)
        observed = (time.perf_counter() - t0) / (cfg.time_scale if cfg.emulate else 1.0)
        n, q = features(lengths)
        self._samples.append((n, q, observed / share))

    def sleep_device(self, seconds: float) -> None:
        """Emulate ``seconds`` of device-side work that is not a microbatch (e.g. moving layers)."""
        if self.config.emulate and seconds > 0:
            time.sleep(seconds * self.config.time_scale)

    # -- the step boundary (safe point) --------------------------------------------------------------
    def _gather(self) -> list[list[tuple[float, float, float]]]:
        counts = torch.tensor([float(len(self._samples))])
        every = [torch.zeros(1) for _ in range(self.world)]
        self.group.allgather([every], [counts]).wait()
        width = int(max(c.item() for c in every)) or 1
        mine = torch.zeros(width, 3, dtype=torch.float64)
        if self._samples:
            mine[: len(self._samples)] = torch.tensor(self._samples, dtype=torch.float64)
        rows = [torch.zeros(width, 3, dtype=torch.float64) for _ in range(self.world)]
        self.group.allgather([rows], [mine]).wait()
        return [[tuple(map(float, r)) for r in rows[k][: int(every[k].item())]] for k in range(self.world)]  # type: ignore[misc]

    def end_step(self, tokens: int | None = None) -> StepReport:
        """The safe point; ``tokens``: the step's global tokens when ``assign`` was not used."""
        if tokens is not None:
            self._tokens = tokens
        now = time.perf_counter()
        wall = (now - self._last) / (self.config.time_scale if self.config.emulate else 1.0)
        self._last = now
        per_rank = self._gather()
        self._samples = []
        compute = tuple(sum(t for _, _, t in s) for s in per_rank)
        predicted: tuple[float, ...] | None = None
        if self.predictor.ready("fb"):
            predicted = tuple(sum(self.predictor.predict("fb", n, q) for n, q, _ in s) for s in per_rank)
        for s in per_rank:  # identical on every rank: the predictor learns only healthy samples
            for n, q, t in s:
                self.predictor.observe("fb", n, q, t)
        alarms: list[Alarm] = []
        if predicted is not None:  # a rank that ran nothing this step has nothing to judge
            busy = [r for r, s in enumerate(per_rank) if s]
            alarms = self.detector.observe(
                self.step, {r: compute[r] for r in busy}, {r: predicted[r] for r in busy}
            )
        if self.config.adapt:
            for a in alarms:
                if a.unit is not None:
                    self.speeds[a.unit] = 1.0 / a.slowdown
            if predicted is not None:  # a rank back under the detector's recovery line gets its share back
                for r, speed in enumerate(self.speeds):
                    if (
                        speed < 1.0
                        and per_rank[r]
                        and predicted[r] > 0
                        and compute[r] < self.config.detector.recover * predicted[r]
                    ):
                        self.speeds[r] = 1.0
        report = StepReport(
            step=self.step,
            wall_s=wall,
            tokens=self._tokens,
            rank_compute_s=compute,
            rank_predicted_s=predicted,
            alarms=tuple(alarms),
            threshold_alarm=self.threshold.observe(wall),
            speeds=tuple(self.speeds),
        )
        self.reports.append(report)
        self.step += 1
        return report
