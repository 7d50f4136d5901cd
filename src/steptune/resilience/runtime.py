"""``Runtime``: ResiHP's detector and DP rebalancing inside a real torch.distributed training loop.

A loop adds four calls (docs/resilience.md shows the whole loop)::

    rt = Runtime(group, stage_model, RuntimeConfig(), faults=[SlowFault(rank=1, factor=1.6, start=20)])
    for step in range(steps):
        mbs = [[1024, 512], [2048], [256, 256, 512]]     # the step's microbatches: sequence lengths each
        for i in rt.assign(mbs):                         # this rank's microbatches under the current plan
            with rt.timed(mbs[i]):                       # forward + backward of microbatch i
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
as they are (GPUs). On CUDA those are CUDA events around the block (``RuntimeConfig.timing``): a host clock
would read the kernels' launch, not their run. They are read at ``end_step``, which waits for them, so a
microbatch costs no synchronization.
"""

from __future__ import annotations

import contextlib
import math
import numbers
import statistics
import time
import zlib
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from steptune.resilience.detect import Alarm, ResiHPConfig, ResiHPDetector
from steptune.resilience.predict import PredictorConfig, WorkloadPredictor
from steptune.resilience.workload import StageModel, features

__all__ = [
    "IterationThreshold",
    "LinkFault",
    "Runtime",
    "RuntimeConfig",
    "SlowFault",
    "StepReport",
    "lpt_assign",
]


_MIN_EMULATED_COMM_S = 0.005
"""Emulated collectives shorter than this in wall seconds are not judged: the real gloo call's
millisecond jitter on a shared CPU would be most of the sample (an 8B all-reduce over NVLink at time
scale 0.02 lasts 1 ms). GPUs time the real collective and have no such floor."""


_VALIDATE = 1.25
"""A probed link counts as slow above 1.25 x both its model and the fastest probe: ResiHP validates only
slowdowns over 25%."""
_MAX_COMM_GROUPS = 4  # distinct ``comm_timed`` groups one rank may time in one step


MAX_SLOWDOWN = 1000.0
"""The largest slowdown an injected fault may have (a sweep: 1e300 overflowed time.sleep inside a rank, 1e6
slept 13 h per microbatch)."""


def fault_range_error(
    rank: Any,
    factor: Any,
    start: Any,
    duration: Any,
    names: Sequence[str] = ("rank", "factor", "start", "duration"),
) -> str | None:
    """What is wrong with a slow fault's fields, as ``name=value): why``, or None. One rule for
    ``SlowFault`` and the CLI's ``--inject`` (which passes its own key names)."""

    def whole(v: Any) -> bool:  # numpy's integers too (a sweep: np.int64(1) was "not a whole number")
        return isinstance(v, numbers.Integral) and not isinstance(v, bool)

    n_rank, n_factor, n_start, n_duration = names
    if not whole(rank) or rank < 0:
        return f"{n_rank}={rank!r}): a rank is a whole number >= 0"
    if not (
        isinstance(factor, numbers.Real) and not isinstance(factor, bool) and 1 <= factor <= MAX_SLOWDOWN
    ):
        return (
            f"{n_factor}={factor!r}): a slowdown factor is a number from 1 to {MAX_SLOWDOWN:g} (1.6: 1.6x "
            "slower); a device slower than that is hung: kill the rank instead (a fail-stop)"
        )
    if not whole(start) or start < 0:
        return f"{n_start}={start!r}): the first slow step, a whole number >= 0"
    if duration is not None and (not whole(duration) or duration < 1):
        return f"{n_duration}={duration!r}): steps, a whole number >= 1 (None: forever)"
    return None


@dataclass(frozen=True, kw_only=True, slots=True)
class SlowFault:
    """Rank ``rank`` runs ``factor`` x slower from step ``start`` for ``duration`` steps (None: forever)."""

    rank: int
    factor: float
    start: int
    duration: int | None = None

    def __post_init__(self) -> None:
        problem = fault_range_error(self.rank, self.factor, self.start, self.duration)
        if problem:
            raise ValueError(f"{type(self).__name__}({problem}")
        for name, kind in (("rank", int), ("factor", float), ("start", int)):  # numpy scalars as Python's
            object.__setattr__(self, name, kind(getattr(self, name)))
        if self.duration is not None:
            object.__setattr__(self, "duration", int(self.duration))

    def factor_at(self, rank: int, step: int) -> float:
        if rank != self.rank or step < self.start:
            return 1.0
        if self.duration is not None and step >= self.start + self.duration:
            return 1.0
        return self.factor


@dataclass(frozen=True, kw_only=True, slots=True)
class LinkFault(SlowFault):
    """Transfers through rank ``rank``'s network link take ``factor`` x longer from step ``start`` for
    ``duration`` steps (None: forever): a degraded NIC, cable or switch port. Same fields as
    ``SlowFault``; the Runtime keeps the two apart (``faults`` vs ``link_faults``)."""


@dataclass(frozen=True, kw_only=True, slots=True)
class RuntimeConfig:
    emulate: bool = True
    """Emulated device time (CPU boxes); False: real measured times (GPUs)."""
    timing: str = "auto"
    """How real times are taken when ``emulate`` is False: ``"cuda"`` (CUDA events on the current stream,
    read at ``end_step``), ``"wall"`` (the host clock), or ``"auto"``: CUDA events once this process uses
    CUDA, else the host clock."""
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
    probe_every: int = 10
    """A rank judged so slow that the plan gives it no microbatch gets the cheapest one after this many
    steps without work, so that it can show it has recovered (a sweep: a rank judged 20x slow for 3 steps
    never ran again, a quarter of the job lost); 0: never. The wait doubles each time a probe finds it
    still slow, and a probe is skipped while its predicted time exceeds half a step per step waited."""

    def __post_init__(self) -> None:
        if not isinstance(self.emulate, bool) or not isinstance(self.adapt, bool):
            raise ValueError(
                f"RuntimeConfig: emulate and adapt are True or False, got {self.emulate!r}, {self.adapt!r}"
            )
        if self.timing not in ("auto", "cuda", "wall"):
            raise ValueError(f"RuntimeConfig.timing must be 'auto', 'cuda' or 'wall', got {self.timing!r}")
        checks = (
            (
                "time_scale",
                self.time_scale,
                "> 0 (wall seconds per emulated second)",
                lambda v: 0 < v < math.inf,
            ),
            # sigma 1 already spreads a microbatch 2.7x either way; 50 slept for half an hour
            ("noise_sigma", self.noise_sigma, "in [0, 1] (lognormal sigma)", lambda v: 0 <= v <= 1),
            ("iteration_threshold", self.iteration_threshold, "> 0 (0.10: 10%)", lambda v: 0 < v < math.inf),
        )
        for name, value, rule, ok in checks:
            if not isinstance(value, int | float) or isinstance(value, bool) or not ok(value):
                raise ValueError(f"RuntimeConfig.{name} must be a finite number {rule}, got {value!r}")
        if isinstance(self.seed, bool) or not isinstance(self.seed, int) or not 0 <= self.seed < 2**63:
            raise ValueError(
                f"RuntimeConfig.seed must be a whole number >= 0 (below 2**63), got {self.seed!r}"
            )
        p = self.probe_every
        if isinstance(p, bool) or not isinstance(p, int) or p < 0:
            raise ValueError(f"RuntimeConfig.probe_every must be a whole number of steps >= 0, got {p!r}")
        if not isinstance(self.detector, ResiHPConfig) or not isinstance(self.predictor, PredictorConfig):
            raise TypeError("RuntimeConfig: detector is a ResiHPConfig and predictor a PredictorConfig")


def _check_lengths(lengths: Any, what: str) -> list[int]:
    """A microbatch: a non-empty list (or array, or 1-d integer tensor) of sequence lengths, each a whole
    number >= 1; returned as Python ints (numpy's int32 overflowed the batch digest; a tensor's elements
    were refused, a sweep found)."""
    if isinstance(lengths, numbers.Number | str) or not hasattr(lengths, "__iter__"):
        raise TypeError(
            f"{what}: a microbatch is the list of its sequences' lengths (e.g. [1024, 512]), "
            f"got {lengths!r}; assign() takes a list of them: [[1024, 512], [2048]]"
        )
    values = [n.item() if isinstance(n, torch.Tensor) and n.ndim == 0 else n for n in lengths]
    if not values or any(not isinstance(n, numbers.Integral) or isinstance(n, bool) or n < 1 for n in values):
        raise ValueError(f"{what}: each sequence length must be a whole number >= 1, got {values!r}")
    return [int(n) for n in values]


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
    comm_s: tuple[float, ...] = ()
    """Per rank: seconds measured in ``comm_timed`` collectives this step (emulated when emulating)."""


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


@dataclass(frozen=True)
class _CommStep:
    modelled: list[float]
    """Per rank: the healthy seconds of the collectives it timed this step."""
    observed: list[float]
    units: dict[int, tuple[float, float]]
    """Per group of ranks: the mean (modelled, observed) seconds over its ranks."""


_NO_BATCH = (-1.0, -1.0, -1.0, -1.0)  # no assign() this step (the loop passes end_step(tokens=))


def _check_same_batch(step: int, batches: Sequence[tuple[float, ...]]) -> None:
    """Every rank that called assign() this step must have passed the same global batch: each plans from
    its own copy, so copies that differ leave microbatches on no rank, or on two (found in a sweep: two
    microbatches ran nowhere, silently)."""
    seen = [(r, b) for r, b in enumerate(batches) if b != _NO_BATCH]
    other = next(((r, b) for r, b in seen[1:] if b != seen[0][1]), None)
    if other is None:
        return
    (r, b), (r0, b0) = other, seen[0]
    raise ValueError(
        f"step {step}: rank {r} passed assign() {int(b[0])} microbatches, {int(b[1])} tokens, rank {r0} "
        f"{int(b0[0])} microbatches, {int(b0[1])} tokens (or the same counts with other lengths or "
        "grouping): every rank must pass the step's whole global batch, the same lengths in the same order"
    )


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
        link_faults: Sequence[LinkFault] = (),
    ) -> None:
        if not isinstance(stage, StageModel):
            raise TypeError(
                f"Runtime(stage={stage!r}): the cost model of the whole model, a StageModel, e.g. "
                "steptune.resilience.live.stage_model('llama3.1-8b')"
            )
        if group is None:  # torch's convention: the default group
            import torch.distributed as dist

            if not dist.is_initialized():
                raise ValueError(
                    "Runtime(group=None) means the default process group, and there is none: call "
                    "torch.distributed.init_process_group(...) first (torchrun sets its environment), or "
                    "pass a group"
                )
            group = dist.group.WORLD
        self.group = group
        self.rank, self.world = group.rank(), group.size()
        self.stage = stage
        self.config = config or RuntimeConfig()
        if self.config.timing == "cuda" and not self.config.emulate and not torch.cuda.is_available():
            raise ValueError("RuntimeConfig(timing='cuda') needs a CUDA device; use timing='wall' or 'auto'")
        for name, given in (("faults", faults), ("link_faults", link_faults)):
            if isinstance(given, SlowFault) or not isinstance(given, Sequence):
                raise TypeError(f"Runtime({name}=...) takes a list of faults, e.g. [SlowFault(...)]")
        self.faults = tuple(faults)
        self.link_faults = tuple(link_faults)
        checks: list[SlowFault] = [*self.faults, *self.link_faults]
        for f in checks:
            if not 0 <= f.rank < self.world:
                raise ValueError(f"{f}: rank must be in [0, {self.world})")
        if checks and not self.config.emulate:
            raise ValueError(
                "injected faults slow the emulated device time; with RuntimeConfig(emulate=False) the real "
                "device time is measured and a fault would inject nothing: slow the device for real (e.g. a "
                "competing kernel) or emulate"
            )
        self.comm_detector = ResiHPDetector(self.config.detector)
        # (modelled healthy seconds, observed seconds, the collective's group: (CRC of its ranks, size))
        self._comm: list[tuple[float, float, tuple[int, int]]] = []
        self.predictor = WorkloadPredictor(self.config.predictor)
        self.detector = ResiHPDetector(self.config.detector)
        self.threshold = IterationThreshold(self.config.iteration_threshold)
        self.speeds = [1.0] * self.world
        # Per rank, identical on every rank: steps without a timed microbatch, the steps to wait before a
        # probe (doubling while probes find the rank still slow), and whether this step's plan probed it
        self._idle = [0] * self.world
        self._probe_wait = [self.config.probe_every] * self.world
        self._probed = [False] * self.world
        self.step = 0
        self.reports: list[StepReport] = []
        self._rng = np.random.default_rng((self.config.seed, self.rank))
        self._samples: list[tuple[float, float, float]] = []  # (N, Q, observed device seconds)
        # CUDA-event spans not read yet: (N, Q, share, start, end) and (modelled seconds, start, end)
        self._pending: list[tuple[float, float, float, Any, Any]] = []
        self._pending_comm: list[tuple[float, tuple[int, int], Any, Any]] = []
        self._tokens = 0
        self._batch: tuple[float, ...] = _NO_BATCH  # what assign() saw: checked across ranks
        self._open = False  # a timed() block is running
        self._last = time.perf_counter()

    # -- the plan ------------------------------------------------------------------------------------
    def cost(self, lengths: Sequence[int]) -> float:
        """Predicted whole-model F+B+W seconds of a microbatch on a healthy device (cost model until warm)."""
        n, q = features(lengths)
        if self.predictor.ready("fb"):
            return max(self.predictor.predict("fb", n, q), 1e-9)
        return self.stage.time(lengths, "F") + self.stage.time(lengths, "B") + self.stage.time(lengths, "W")

    def assign(self, microbatches: Sequence[Sequence[int]]) -> list[int]:
        """Indices of this step's microbatches this rank runs (FLOPs- and speed-aware LPT). Each
        microbatch is the list of its sequences' lengths: ``[[1024, 512], [2048]]``."""
        if isinstance(microbatches, numbers.Number | str) or not hasattr(microbatches, "__iter__"):
            raise TypeError(f"assign() takes a list of microbatches such as [[1024, 512], [2048]], got "
                            f"{microbatches!r}")  # fmt: skip
        microbatches = [_check_lengths(mb, f"microbatch {i}") for i, mb in enumerate(microbatches)]
        self._tokens = sum(sum(mb) for mb in microbatches)
        # the counts, and a CRC of the lengths in order: a batch regrouped or permuted has the same counts
        # (found in a sweep: [[100, 200], [300]] vs [[100], [200, 300]] left the 200 on no rank)
        layout = zlib.crc32(repr(microbatches).encode())
        self._batch = (len(microbatches), self._tokens, sum(n * n for mb in microbatches for n in mb), layout)
        costs = [self.cost(mb) for mb in microbatches]
        plan = self.add_probes(lpt_assign(costs, self.speeds), costs, self.speeds)
        return plan[self.rank]

    def add_probes(
        self,
        plan: list[list[int]],
        costs: Sequence[float],
        rates: Sequence[float],
        members: Sequence[Sequence[int]] | None = None,
        base: Sequence[float] | None = None,
    ) -> list[list[int]]:
        """``plan`` (microbatch indices per unit, changed in place and returned) with a probe: a unit left
        without microbatches for ``RuntimeConfig.probe_every`` steps gets the cheapest microbatch of a unit
        that holds more than one, so the detector sees whether it has healed. Units are ranks (``assign``)
        or replicas (``members[u]``: replica u's ranks, for the DP x PP and DP x TP jobs' ``plan_dp``);
        ``rates`` are their speeds and ``base`` their fixed seconds (``plan_dp``'s). Every rank must pass
        the same arguments, as for ``assign``."""
        units = members if members is not None else [[r] for r in range(self.world)]
        if not (len(plan) == len(rates) == len(units)) or (base is not None and len(base) != len(plan)):
            raise ValueError(
                f"add_probes needs one plan entry, rate and member list per unit (and one base each if "
                f"given); got {len(plan)} plans, {len(rates)} rates, {len(units)} member lists"
            )
        fixed = list(base) if base is not None else [0.0] * len(plan)
        makespan = max(
            (f + sum(costs[i] for i in p) / v for p, v, f in zip(plan, rates, fixed, strict=True) if v > 0),
            default=0.0,
        )
        self._probed = [False] * self.world
        for u, ranks in enumerate(units):  # a probe: a unit left idle this long gets the cheapest microbatch
            donors = [d for d in range(len(plan)) if len(plan[d]) > 1]
            wait = max(self._probe_wait[r] for r in ranks)  # the slow member's (doubled) wait
            if not (wait and not plan[u] and rates[u] > 0 and donors):
                continue
            if min(self._idle[r] for r in ranks) < wait:
                continue
            c, i, d = min((costs[i], i, d) for d in donors for i in plan[d])
            # At most half a step's time per step waited: a probe of a rank still 20x slow cost 21% of the
            # job every 10 steps, of one 1000x slow 16x (a review); the wait doubles while it stays slow.
            if fixed[u] + c / rates[u] > 0.5 * wait * makespan:
                continue
            plan[d].remove(i)
            plan[u].append(i)
            plan[u].sort()
            for r in ranks:
                self._probed[r] = True
        return plan

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
        if not phases or any(ph not in ("F", "B", "W") for ph in phases):
            raise ValueError(f"timed(phases={phases!r}): one or more of 'F', 'B', 'W'")
        lengths = _check_lengths(lengths, "timed(lengths)")
        if self._open:
            raise RuntimeError(
                "timed() blocks do not nest: each times one microbatch; close the outer one first"
            )
        self._open = True
        try:
            yield from self._timed(lengths, part, phases, fraction)
        finally:
            self._open = False

    def _timed(
        self, lengths: Sequence[int], part: StageModel | None, phases: Sequence[str], fraction: float
    ) -> Iterator[None]:
        cfg = self.config
        part = part or self.stage
        nominal = sum(part.time(lengths, p) for p in phases) * fraction
        share = nominal / sum(self.stage.time(lengths, p) for p in ("F", "B", "W"))
        if self._cuda_timing():
            with self._events() as span:
                yield
            self._pending.append((*features(lengths), share, *span))
            return
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

    def link_slowdown(self, rank: int) -> float:
        return math.prod(f.factor_at(rank, self.step) for f in self.link_faults)

    @contextlib.contextmanager
    def comm_timed(self, seconds: float, ranks: Sequence[int] | None = None) -> Iterator[None]:
        """Time a collective over ``ranks`` (default: the group) whose healthy time is ``seconds`` (the
        cost model: bytes over the link). Emulated, it lasts ``seconds`` x the slowest link among
        ``ranks`` x noise: a ring or tree is paced by its slowest link. ``end_step`` judges each group's
        collectives apart (a stage's DP all-reduce, another stage's), against a detector of their own, so
        one slow group is not averaged away among healthy ones; an alarm is validated by ``probe_links``.
        Every rank of ``ranks`` times it (this rank must be one of them)."""
        if not (
            isinstance(seconds, int | float) and not isinstance(seconds, bool) and 0 <= seconds < math.inf
        ):
            raise ValueError(
                f"comm_timed(seconds={seconds!r}): the collective's healthy time, finite and >= 0"
            )
        cfg = self.config
        key = self._comm_group(ranks)
        if self._cuda_timing():
            with self._events() as span:
                yield
            self._pending_comm.append((seconds, key, *span))
            return
        t0 = time.perf_counter()
        yield
        if cfg.emulate:
            slow = max(self.link_slowdown(r) for r in (ranks if ranks is not None else range(self.world)))
            rest = seconds * slow * float(self._rng.lognormal(0.0, cfg.noise_sigma)) * cfg.time_scale
            rest -= time.perf_counter() - t0
            if rest > 0:
                time.sleep(rest)
        observed = (time.perf_counter() - t0) / (cfg.time_scale if cfg.emulate else 1.0)
        if not cfg.emulate or seconds * cfg.time_scale >= _MIN_EMULATED_COMM_S:
            self._comm.append((seconds, observed, key))

    def _comm_group(self, ranks: Sequence[int] | None) -> tuple[int, int]:
        if ranks is None:
            return (zlib.crc32(repr(list(range(self.world))).encode()), self.world)
        members = set(ranks)
        if not members or not all(isinstance(r, int) and 0 <= r < self.world for r in members):
            raise ValueError(f"comm_timed(ranks={list(ranks)!r}): ranks of the group, in [0, {self.world})")
        if self.rank not in members:
            raise ValueError(
                f"comm_timed(ranks={sorted(members)}) on rank {self.rank}: time a collective on the ranks "
                "that take part in it (this rank is not one of them)"
            )
        # the whole member set (a CRC of it): TP {0, 1} and DP {0, 2} share their lowest rank and size
        return (zlib.crc32(repr(sorted(members)).encode()), len(members))

    def probe_links(self, seconds: float) -> list[float]:
        """Validation: every rank sends a probe to its ring successor and times it (``seconds`` healthy;
        emulated through the slower of the two ends' links). Returns the time of link r -> r+1 for
        every r, on every rank (all-gathered)."""
        succ, pred = (self.rank + 1) % self.world, (self.rank - 1) % self.world
        out, into = torch.zeros(1), torch.zeros(1)
        t0 = time.perf_counter()
        work = self.group.send([out], succ, 77_000_000)
        self.group.recv([into], pred, 77_000_000).wait()
        work.wait()
        if self.config.emulate:
            slow = max(self.link_slowdown(self.rank), self.link_slowdown(succ))
            noise = float(self._rng.lognormal(0.0, self.config.noise_sigma))
            rest = seconds * slow * noise * self.config.time_scale - (time.perf_counter() - t0)
            if rest > 0:
                time.sleep(rest)
        mine = torch.tensor(
            [(time.perf_counter() - t0) / (self.config.time_scale if self.config.emulate else 1.0)]
        )
        every = [torch.zeros(1) for _ in range(self.world)]
        self.group.allgather([every], [mine]).wait()
        return [float(t) for t in every]

    def _localize(self, probes: Sequence[float], seconds: float) -> Alarm | None:
        """The rank both of whose ring links are slow (its NIC), else the single slowest link, else the
        fabric if every probe is slower than modelled; None if the probes find nothing (not validated)."""
        base = min(probes)  # the fastest link is healthy unless every link is slow
        slow = [r for r, t in enumerate(probes) if t > _VALIDATE * base and t > _VALIDATE * seconds]
        n = self.world
        if not slow:  # every link alike: the whole fabric if slower than modelled, else a false alarm
            if base < _VALIDATE * seconds:
                return None
            return Alarm(step=self.step, unit=None, kind="fail-slow-link", slowdown=base / seconds,
                         detector="resihp-link")  # fmt: skip
        worst = max(slow, key=lambda r: probes[r])
        ratio = probes[worst] / base
        ends = [r for r in range(n) if (r - 1) % n in slow and r in slow]
        unit = ends[0] if len(ends) == 1 else None
        return Alarm(step=self.step, unit=unit, kind="fail-slow-link", slowdown=ratio, detector="resihp-link",
                     link=(worst, (worst + 1) % n))  # fmt: skip

    def sleep_device(self, seconds: float) -> None:
        """Emulate ``seconds`` of device-side work that is not a microbatch (e.g. moving layers)."""
        if self.config.emulate and seconds > 0:
            time.sleep(seconds * self.config.time_scale)

    # -- the step boundary (safe point) --------------------------------------------------------------
    def _cuda_timing(self) -> bool:
        cfg = self.config
        if cfg.emulate or cfg.timing == "wall":
            return False
        return cfg.timing == "cuda" or torch.cuda.is_initialized()  # per microbatch: no device query

    @contextlib.contextmanager
    def _events(self) -> Iterator[list[Any]]:
        """CUDA events on the current stream around the block; the list holds (start, end) after it."""
        span: list[Any] = [torch.cuda.Event(enable_timing=True)]
        span[0].record()
        yield span
        span.append(torch.cuda.Event(enable_timing=True))
        span[1].record()

    def _read_events(self) -> None:
        """Wait for this step's CUDA-event spans and turn them into samples (seconds)."""
        for n, q, share, start, end in self._pending:
            end.synchronize()
            self._samples.append((n, q, start.elapsed_time(end) / 1e3 / share))
        for seconds, key, start, end in self._pending_comm:
            end.synchronize()
            self._comm.append((seconds, start.elapsed_time(end) / 1e3, key))
        self._pending, self._pending_comm = [], []

    def _allgather(self, out: list[torch.Tensor], mine: torch.Tensor) -> None:
        """One of ``end_step``'s all-gathers; a failure says what the runtime needs of the loop."""
        try:
            self.group.allgather([out], [mine]).wait()
        except RuntimeError as err:
            raise RuntimeError(
                f"rank {self.rank}, step {self.step}: end_step's all-gather of the step's timings failed "
                f"({str(err).splitlines()[0][:200]}). Every rank must call end_step() exactly once per step, "
                "after the same number of steps; a rank that skipped or repeated one, or died, leaves the "
                "others waiting here until the group's timeout"
            ) from err

    def _gather(self) -> list[list[tuple[float, float, float]]]:
        # each rank's sample count, and a digest of the batch its assign() saw (exact in float64)
        # ... and of the plan (the speeds this step's assign() used): ranks configured differently
        # (adapt on some only) planned apart and ran microbatches twice or not at all (a sweep)
        # (two weighted sums, compared within 1e-9: hosts whose BLAS differ in the last bit still agree)
        plan = (sum(self.speeds), sum((r + 1) * v for r, v in enumerate(self.speeds)))
        counts = torch.tensor([float(len(self._samples)), *self._batch, *plan], dtype=torch.float64)
        every = [torch.zeros(7, dtype=torch.float64) for _ in range(self.world)]
        self._allgather(every, counts)
        _check_same_batch(self.step, [tuple(map(float, e[1:5])) for e in every])
        if any(not math.isclose(float(e[k]), plan[k - 5], rel_tol=1e-9) for e in every for k in (5, 6)):
            raise ValueError(
                f"step {self.step}: the ranks plan with different speeds (this rank: {self.speeds}): each "
                "plans from its own copy, so every rank must run the same RuntimeConfig (adapt, detector, "
                "predictor) and the same faults"
            )
        width = int(max(c[0].item() for c in every)) or 1
        mine = torch.zeros(width, 3, dtype=torch.float64)
        if self._samples:
            mine[: len(self._samples)] = torch.tensor(self._samples, dtype=torch.float64)
        rows = [torch.zeros(width, 3, dtype=torch.float64) for _ in range(self.world)]
        self._allgather(rows, mine)
        return [[tuple(map(float, r)) for r in rows[k][: int(every[k][0].item())]] for k in range(self.world)]  # type: ignore[misc]

    def _gather_comm(self) -> _CommStep | None:
        """This step's ``comm_timed`` collectives, per rank and per group; None if the loop times none
        (every rank calls it, so the all-gather matches on all of them)."""
        groups: dict[tuple[int, int], list[float]] = {}
        for m, o, key in self._comm:
            acc = groups.setdefault(key, [0.0, 0.0])
            acc[0] += m
            acc[1] += o
        self._comm = []
        # rows: the group's CRC and size, m, o; the last row holds this rank's group count, so that a rank
        # over the limit makes every rank raise after the all-gather (raised alone, it left the others
        # waiting in it until the group's timeout)
        mine = torch.zeros(_MAX_COMM_GROUPS + 1, 4, dtype=torch.float64)
        for i, ((crc, size), (m, o)) in enumerate(sorted(groups.items())[:_MAX_COMM_GROUPS]):
            mine[i] = torch.tensor([crc, size, m, o], dtype=torch.float64)
        mine[-1, 0] = len(groups)
        rows = [torch.zeros(_MAX_COMM_GROUPS + 1, 4, dtype=torch.float64) for _ in range(self.world)]
        self._allgather(rows, mine)
        over = [(r, int(row[-1, 0])) for r, row in enumerate(rows) if row[-1, 0] > _MAX_COMM_GROUPS]
        if over:
            raise ValueError(
                f"step {self.step}: rank {over[0][0]} timed comm_timed over {over[0][1]} different groups in "
                f"one step; the runtime judges at most {_MAX_COMM_GROUPS} per rank (time one per group)"
            )
        timed = [[(int(g[0]), int(g[1]), float(g[2]), float(g[3])) for g in r[:-1] if g[1] > 0] for r in rows]
        if not any(m > 0 for r in timed for _, _, m, _ in r):
            return None
        units: dict[int, list[tuple[float, float]]] = {}
        for r in timed:
            for crc, size, m, o in r:
                units.setdefault(crc * 4096 + size, []).append((m, o))
        return _CommStep(
            modelled=[sum(m for _, _, m, _ in r) for r in timed],
            observed=[sum(o for _, _, _, o in r) for r in timed],
            units={
                u: (statistics.fmean(m for m, _ in v), statistics.fmean(o for _, o in v))
                for u, v in units.items()
            },
        )

    def end_step(self, tokens: int | None = None) -> StepReport:
        """The safe point; ``tokens``: the step's global tokens when ``assign`` was not used."""
        if self._open:
            raise RuntimeError("end_step() inside a timed() block: close it (a with block) first")
        if tokens is not None:
            if isinstance(tokens, bool) or not isinstance(tokens, numbers.Integral) or tokens < 0:
                raise ValueError(
                    f"end_step(tokens={tokens!r}): the step's global tokens, a whole number >= 0"
                )
            self._tokens = int(tokens)
        self._read_events()  # on CUDA: the step's kernels have finished before the wall clock is read
        now = time.perf_counter()
        wall = (now - self._last) / (self.config.time_scale if self.config.emulate else 1.0)
        self._last = now
        per_rank = self._gather()
        self._samples = []
        self._idle = [0 if s else n + 1 for s, n in zip(per_rank, self._idle, strict=True)]
        compute = tuple(sum(t for _, _, t in s) for s in per_rank)
        predicted: tuple[float, ...] | None = None
        if self.predictor.ready("fb"):
            predicted = tuple(sum(self.predictor.predict("fb", n, q) for n, q, _ in s) for s in per_rank)
        for s in per_rank:  # identical on every rank: the predictor learns only healthy samples
            for n, q, t in s:
                self.predictor.observe("fb", n, q, t)
        comm = self._gather_comm()
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
            for r in range(self.world):  # a probe that found the rank still slow: wait twice as long
                if self._probed[r] and self.speeds[r] < 1.0:
                    self._probe_wait[r] = min(2 * self._probe_wait[r], 10_000)
                elif self.speeds[r] >= 1.0:
                    self._probe_wait[r] = self.config.probe_every
        self._probed = [False] * self.world
        if comm is not None:  # a group's collective is slower than its model on its ranks: find the link
            hits = self.comm_detector.observe(  # one unit a group: paced by its slowest link on every rank
                self.step,
                {u: o for u, (_, o) in comm.units.items()},
                {u: m for u, (m, _) in comm.units.items()},
            )
            if hits:
                probe = max(comm.modelled)  # as long as the collective, so real messaging stays small
                found = self._localize(self.probe_links(probe), probe)
                if found is not None:
                    alarms.append(found)
        report = StepReport(
            step=self.step,
            wall_s=wall,
            tokens=self._tokens,
            rank_compute_s=compute,
            rank_predicted_s=predicted,
            alarms=tuple(alarms),
            threshold_alarm=self.threshold.observe(wall),
            speeds=tuple(self.speeds),
            comm_s=tuple(comm.observed) if comm is not None else (),
        )
        self.reports.append(report)
        self._tokens = 0  # the next step's come from its assign() or end_step(tokens=)
        self._batch = _NO_BATCH
        self.step += 1
        return report
