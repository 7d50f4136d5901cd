"""Iteration-level simulation of a training job under injected failures, to score adaptation policies.

A job is ``dp`` replicas of a ``pp``-stage pipeline whose stages are TP groups of ``tp`` devices (device
ids replica-major, as in ``initial_plan``). Wall-clock time advances one training step at a time until
``duration_s``; at each step boundary the policy sees the device speeds it has detected so far and may
replace the ``ExecutionPlan`` at the price of a stall. Everything here is SIMULATED.

Modelled:
- Speeds: device ``i`` runs at the product of the factors of its active fail-slows, 0 once fail-stopped.
  A step uses the speeds at its start; a fail-slow that starts mid-step takes effect at the next step.
- Step time: per replica, the pipeline simulator's makespan of a 1F1B schedule over that replica's
  microbatches with per-stage F and B durations = the stage's layer times / its TP group's throughput
  (``group_speed``: k x min p, the slowest member paces the group); the step is the slowest replica.
  Layer times are the preset's per-layer FLOPs for one packed sequence of ``tokens_per_microbatch``
  tokens at ``efficiency`` x the device peak. A plan with a dead device cannot step at all.
- A fail-stop on a device of the running plan during a step aborts that step (its time is lost).
- Detection: a policy sees a failure's onset (and a fail-slow's end) ``detect_*_steps`` healthy step
  times after it happens: "steps" become seconds through the healthy step time, so a halted job still
  detects (a heartbeat timeout is a multiple of the usual step, as in ``evaluate.simulate_run``).
- Checkpoint-restart: a checkpoint at the first step boundary after every ``checkpoint_interval_s``;
  a restart stalls ``restart_cost_s`` and discards the steps since the last checkpoint.
- Reconfiguration price (``reconfig_cost``): ``tp_s`` per TP group that changed, ``pp_s`` +
  ``pp_per_layer_s`` x layers moved if the partition changed, ``dp_s`` if microbatch counts changed.

Communication: free unless ``SimJob(comm=True)``; then TP all-reduces, PP P2P and the DP gradient
all-reduce are priced by ``simcomm`` (alpha-beta model), and a fail-slow may target a device's links
(``FailureEvent(target="link")``) instead of its compute. Policies then see per-device speeds that fold
a slow link in (``simcomm.effective_speeds``), while prices use the compute and link factors.

Sequence-length variability: none by default (every microbatch costs the mean); ``run(workload=)``
gives each step its own packed batch and deals it to the replicas by count or by predicted cost
(``simload``).

Ignored: the optimizer step, activation memory (the planner's memory check uses 16 bytes/parameter
only), the cost of writing checkpoints, and spare devices: only the job's ``tp*pp*dp`` devices exist.
The tokens/s numbers are model outputs, not measurements.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import NamedTuple, Protocol

from steptune.core.specs import LayerSpec, Phase, cluster_preset, model_preset
from steptune.pipeline.anchors import one_f_one_b
from steptune.pipeline.costs import StageCosts
from steptune.pipeline.listsched import ListPolicy, list_schedule
from steptune.pipeline.schedule import Schedule
from steptune.pipeline.simulate import makespan
from steptune.resilience.plan import (
    ClusterState,
    ExecutionPlan,
    ReconfigCosts,
    initial_plan,
    progressive_replan,
    rebalanced,
    shares_only,
    shares_speed,
    should_apply,
    uniform_repartition,
)
from steptune.resilience.simcomm import CommModel, comm_model, effective_speeds
from steptune.resilience.simload import PREDICTION_SIGMA, BatchWorkload, workload_factor
from steptune.resilience.workload import StageModel

__all__ = [
    "CheckpointRestart",
    "Decision",
    "FailureEvent",
    "Memoized",
    "NoOp",
    "Oracle",
    "Policy",
    "ResiHPPolicy",
    "SimContext",
    "SimJob",
    "SimResult",
    "StepTimeHook",
    "StepTimeOf",
    "SteptunePolicy",
    "cached_one_f_one_b",
    "dp_sync_s",
    "improve_counts",
    "layer_phase_times",
    "pipeline_time",
    "reconfig_cost",
    "restart_plan",
    "run",
]

_KINDS = ("fail-stop", "fail-slow")
_TARGETS = ("compute", "link")
_MIN_LAYER_S = 1e-9
"""Floor on a layer's time: embeddings have (almost) no FLOPs but the planner needs costs > 0."""
_BYTES_PER_PARAM = 16.0
"""bf16 weights + fp32 master, grads and two Adam moments."""


@dataclass(frozen=True, kw_only=True, slots=True)
class FailureEvent:
    """One injected failure on one device."""

    kind: str
    """"fail-stop" (the device dies for good) or "fail-slow" (it runs at ``factor`` of its speed)."""
    device: int
    start_s: float
    duration_s: float = math.inf
    """How long a fail-slow lasts (inf: persistent). Ignored for a fail-stop."""
    factor: float = 1.0
    """Fail-slow speed multiplier in (0, 1]: 0.5 = half speed."""
    target: str = "compute"
    """What a fail-slow slows: the device's "compute" or its "link" bandwidth (``SimJob(comm=True)``)."""

    def __post_init__(self) -> None:
        if self.kind not in _KINDS:
            raise ValueError(f"failure kind {self.kind!r} must be one of {_KINDS}")
        if self.target not in _TARGETS or (self.target == "link" and self.kind != "fail-slow"):
            raise ValueError(f"failure target {self.target!r} must be one of {_TARGETS} (link: fail-slows)")
        if self.device < 0 or self.start_s < 0 or self.duration_s <= 0:
            raise ValueError("failure needs device >= 0, start_s >= 0 and duration_s > 0")
        if self.kind == "fail-slow" and not 0 < self.factor <= 1:
            raise ValueError(f"fail-slow factor {self.factor} must lie in (0, 1] (0.5 = half speed)")

    @property
    def end_s(self) -> float:
        return math.inf if self.kind == "fail-stop" else self.start_s + self.duration_s


@dataclass(frozen=True, kw_only=True, slots=True)
class SimJob:
    """The training job and the prices of recovering it."""

    model: str = "llama2-7b"
    tp: int = 2
    pp: int = 4
    dp: int = 4
    global_microbatches: int = 32
    tokens_per_microbatch: int = 4096
    """One packed sequence per microbatch (attention is quadratic over all of it)."""
    cluster: str = "a100-256"
    microbatch_sq_tokens: float | None = None
    """Sum of squared sequence lengths of a packed microbatch (attention's term); None: one sequence of
    ``tokens_per_microbatch`` tokens."""
    memory_bytes: float | None = None
    """Per-device memory for layer state; None: the cluster's device (inf: no memory limit)."""
    step_overhead_s: float = 0.0
    """Seconds each step spends outside the pipeline model (gradient sync, optimizer, host); 0: ignored."""
    efficiency: float = 0.5
    """Fraction of the device's peak FLOP/s that layers achieve."""
    comm: bool = False
    """Price TP, PP and DP communication on the cluster's links (``simcomm``); False: free."""
    checkpoint_interval_s: float = 1800.0
    restart_cost_s: float = 600.0
    """Stall of a checkpoint restart: reschedule, reload, warm up."""
    reconfig: ReconfigCosts = field(default_factory=lambda: ReconfigCosts(tp_s=1.0, pp_s=5.0, dp_s=0.0))

    @property
    def num_devices(self) -> int:
        return self.tp * self.pp * self.dp

    @property
    def tokens_per_step(self) -> int:
        return self.global_microbatches * self.tokens_per_microbatch


class Decision(NamedTuple):
    plan: ExecutionPlan
    stall_s: float = 0.0
    restart: bool = False
    """Roll back to the last checkpoint (the steps since then are lost)."""


@dataclass(frozen=True, kw_only=True)
class SimContext:
    """What every policy may use besides the detected speeds: the job, its first plan, the cost model."""

    job: SimJob
    base_plan: ExecutionPlan
    healthy_step_s: float
    step_time: Callable[[ExecutionPlan, tuple[float, ...]], float] = field(repr=False)
    """Simulated step time of a plan under given speeds (what the Oracle optimizes)."""
    layer_f: tuple[float, ...] = field(default=(), repr=False)
    """Per layer: forward seconds of one microbatch on one healthy device (then B and W)."""
    layer_b: tuple[float, ...] = field(default=(), repr=False)
    layer_w: tuple[float, ...] = field(default=(), repr=False)
    gpus_per_node: int = 8
    comm: CommModel | None = field(default=None, repr=False)
    """The communication model (``SimJob(comm=True)``); speed vectors then carry link factors."""
    comm_share: float = 0.0
    """Fraction of the healthy step's stage time spent communicating (``effective_speeds``)."""
    rescheduled_step_time: Callable[[ExecutionPlan, tuple[float, ...]], float] = field(repr=False)
    """``step_time`` when each replica runs the best of 1F1B and deeper warm-ups (``rescheduled_time``)."""


class Policy(Protocol):
    name: str
    detect_stop_steps: float
    """Healthy steps from a fail-stop until the policy sees it (heartbeat latency)."""
    detect_slow_steps: float
    """Healthy steps from a fail-slow's onset (or end) until the policy sees it; inf: never."""

    def on_step(
        self,
        t: float,
        step: int,
        observed: tuple[float, ...],
        plan: ExecutionPlan,
        state: ClusterState,
        ctx: SimContext,
    ) -> Decision: ...


class StepTimeHook(Protocol):
    """Optional: a policy whose mechanism is not a plan change (ReCycle's rerouting, Adaptra's
    rescheduling) prices its own steps. inf: the plan cannot step."""

    def step_time(self, plan: ExecutionPlan, speeds: tuple[float, ...], ctx: SimContext) -> float: ...


def _policy_step_time(policy: Policy, ctx: SimContext) -> Callable[[ExecutionPlan, tuple[float, ...]], float]:
    hook = getattr(policy, "step_time", None)
    if hook is None:
        return ctx.step_time
    return lambda plan, speeds: float(hook(plan, speeds, ctx))


@dataclass(frozen=True, kw_only=True)
class SimResult:
    policy: str
    duration_s: float
    tokens: int
    """Tokens of the steps that survived (restarts discard the steps since the last checkpoint)."""
    steps: int
    """Steps completed, including those a restart later discarded."""
    lost_steps: int
    stall_s: float
    """Seconds spent reconfiguring or restarting."""
    lost_s: float
    """Seconds of steps discarded by restarts plus steps aborted by a fail-stop."""
    halted_s: float
    """Seconds the plan could not step (a dead device not yet replanned around)."""
    timeline: tuple[tuple[float, float, int], ...] = field(repr=False)
    """(start time, step time, plan version) per completed step."""
    log: tuple[str, ...] = field(default=(), repr=False)

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.duration_s


# Cost model --------------------------------------------------------------------------------------


def layer_phase_times(job: SimJob) -> tuple[tuple[float, ...], tuple[float, ...], tuple[float, ...]]:
    """Per layer: F, B (input gradient) and W (weight gradient) seconds of one microbatch, one device."""
    model = model_preset(job.model)
    rate = cluster_preset(job.cluster).device.peak_flops * job.efficiency
    n = job.tokens_per_microbatch

    def flops(x: LayerSpec, ph: Phase) -> float:
        if job.microbatch_sq_tokens is None:
            return x.flops(n, ph)
        lin, quad = StageModel(layers=(x,), device=cluster_preset(job.cluster).device).coefficients(ph)
        return lin * n + quad * job.microbatch_sq_tokens

    f, b, w = (
        tuple(max(flops(x, ph) / rate, _MIN_LAYER_S / 2) for x in model.layers)
        for ph in (Phase.F, Phase.B, Phase.W)
    )
    return f, b, w


def _layer_times(job: SimJob) -> tuple[tuple[float, ...], tuple[float, ...], tuple[float, ...], int]:
    """Per layer: forward and backward (B + W) seconds on one healthy device, bytes; and the heads."""
    model = model_preset(job.model)
    f, b, w = layer_phase_times(job)
    fwd = tuple(max(x, _MIN_LAYER_S) for x in f)
    bwd = tuple(max(x + y, _MIN_LAYER_S) for x, y in zip(b, w, strict=True))
    nbytes = tuple(x.params * _BYTES_PER_PARAM for x in model.layers)
    return fwd, bwd, nbytes, int(model.config.get("num_attention_heads", 1))


RESCHEDULE_MAX_EXTRA = 3
"""Deepest extra warm-up Adaptra's rescheduling (and steptune's) tries."""


def pipeline_time(f: list[float] | tuple[float, ...], b: list[float] | tuple[float, ...], m: int) -> float:
    """1F1B makespan of ``m`` microbatches over stages with F and fused-backward seconds ``f``, ``b``."""
    if m <= 0:
        return 0.0
    zero = (0.0,) * len(f)
    costs = StageCosts(f=tuple(f), i=tuple(b), w=zero, act_bytes=zero, out_bytes=zero, static_bytes=zero)
    return makespan(cached_one_f_one_b(len(f), m), costs)


@functools.lru_cache(maxsize=256)
def cached_one_f_one_b(num_stages: int, m: int) -> Schedule:
    """One schedule object per shape, so ``makespan`` compiles it once."""
    return one_f_one_b(num_stages, m)


@functools.lru_cache(maxsize=8192)
def rescheduled_time(f: tuple[float, ...], fb: tuple[float, ...], m: int, max_extra: int) -> float:
    """Adaptra's rescheduling for one replica: the best of 1F1B and list schedules that run up to
    ``max_extra`` microbatches deeper into the warm-up, so a slow stage's delay is absorbed by work
    queued ahead of it. Equal stages have nothing to absorb: 1F1B."""
    t = pipeline_time(f, fb, m)
    slowest = max(x + y for x, y in zip(f, fb, strict=True))
    fastest = min(x + y for x, y in zip(f, fb, strict=True))
    if m > 0 and slowest > fastest * (1 + 1e-9):
        n = len(f)
        zero = (0.0,) * n
        costs = StageCosts(f=f, i=fb, w=zero, act_bytes=zero, out_bytes=zero, static_bytes=zero)
        for extra in range(1, max_extra + 1):
            sched = list_schedule(
                costs, tuple(range(n)), m, ListPolicy(extra_inflight=extra, split_backward=False)
            )
            t = min(t, makespan(sched, costs))
    return t


ReplicaTimes = Callable[[ExecutionPlan, tuple[float, ...]], tuple[float, ...]]


def _make_step_model(
    fwd: tuple[float, ...], bwd: tuple[float, ...], comm: CommModel | None = None, *, max_extra: int = 0
) -> tuple[Callable[[ExecutionPlan, tuple[float, ...]], float], ReplicaTimes]:
    """(step time, per-replica times). Step time = slowest replica's 1F1B makespan (+ the DP gradient
    sync with ``comm``); cached per replica (partition, count, stage throughputs and communication),
    so plans that differ in one replica's microbatch count re-simulate only that replica. With
    ``max_extra`` > 0 each replica runs the best of 1F1B and deeper warm-ups (``rescheduled_time``)."""
    cache: dict[tuple[object, ...], float] = {}

    def replica_time(
        groups: tuple[tuple[int, ...], ...],
        part: tuple[int, ...],
        m: int,
        speeds: tuple[float, ...],
        shares: tuple[tuple[int, ...], ...] | None,
    ) -> float:
        # Keyed by what the time depends on (stage throughputs), so healthy replicas share entries.
        if shares is None:
            stage_speeds = tuple(len(g) * min(speeds[d] for d in g) for g in groups)
        else:
            stage_speeds = tuple(shares_speed(g, c, speeds) for g, c in zip(groups, shares, strict=True))
        if min(stage_speeds) <= 0:
            return math.inf
        extra = comm.stage_extra(groups, part, speeds) if comm is not None else None
        key = (part, m, stage_speeds, extra)
        if key not in cache:
            f, b, start = [], [], 0
            for v, n in zip(stage_speeds, part, strict=True):
                f.append(sum(fwd[start : start + n]) / v)
                b.append(sum(bwd[start : start + n]) / v)
                start += n
            if extra is not None:
                f = [x + y for x, y in zip(f, extra[0], strict=True)]
                b = [x + y for x, y in zip(b, extra[1], strict=True)]
            cache[key] = (
                rescheduled_time(tuple(f), tuple(b), m, max_extra) if max_extra else pipeline_time(f, b, m)
            )
        return cache[key]

    def replica_times(plan: ExecutionPlan, speeds: tuple[float, ...]) -> tuple[float, ...]:
        num_s = plan.num_stages
        out = []
        for r, (part, m) in enumerate(zip(plan.layer_partition, plan.microbatches, strict=True)):
            groups = plan.tp_groups[r * num_s : (r + 1) * num_s]
            shares = plan.tp_shares[r * num_s : (r + 1) * num_s] if plan.tp_shares else None
            out.append(0.0 if m == 0 else replica_time(groups, part, m, speeds, shares))
        return tuple(out)

    def step_time(plan: ExecutionPlan, speeds: tuple[float, ...]) -> float:
        out = max(replica_times(plan, speeds), default=0.0)
        if comm is not None and math.isfinite(out):
            out += comm.dp_sync_s(plan.tp_groups, plan.layer_partition, speeds)
        return out

    return step_time, replica_times


def _make_step_time(
    fwd: tuple[float, ...], bwd: tuple[float, ...], comm: CommModel | None = None, *, max_extra: int = 0
) -> Callable[[ExecutionPlan, tuple[float, ...]], float]:
    return _make_step_model(fwd, bwd, comm, max_extra=max_extra)[0]


def runs_slow(plan: ExecutionPlan, state: ClusterState) -> bool:
    """Whether a detected slow device (or link) and no dead one runs in ``plan``: when rescheduling
    pays (Adaptra's trigger; steptune's too)."""
    return 0 < min(state.speeds[d] for g in plan.tp_groups for d in g) < 1.0


def dp_sync_s(plan: ExecutionPlan, speeds: tuple[float, ...], ctx: SimContext) -> float:
    """The DP gradient all-reduce after ``plan``'s flush (0 without a comm model): for policies that
    price their own steps."""
    return 0.0 if ctx.comm is None else ctx.comm.dp_sync_s(plan.tp_groups, plan.layer_partition, speeds)


def reconfig_cost(old: ExecutionPlan, new: ExecutionPlan, costs: ReconfigCosts) -> float:
    """Stall of switching ``old`` -> ``new`` (module docstring); 0 if nothing changed."""
    cost = costs.tp_s * len(set(new.tp_groups) - set(old.tp_groups))
    if new.tp_shares != old.tp_shares:  # groups kept, units moved between members
        kept = set(new.tp_groups) & set(old.tp_groups)
        cost += costs.tp_s * sum(
            1 for g, a, b in zip(new.tp_groups, _shares(new), _shares_of(old, new.tp_groups), strict=True)
            if g in kept and a != b
        )  # fmt: skip
    if new.layer_partition != old.layer_partition:  # replica by replica (steptune's may differ)

        def owner(p: tuple[int, ...]) -> list[int]:
            return [s for s, n in enumerate(p) for _ in range(n)]

        same = len(new.layer_partition) == len(old.layer_partition)
        refs = old.layer_partition if same else (old.layer_partition[0],) * len(new.layer_partition)
        moved = max(
            sum(a != b for a, b in zip(owner(r), owner(p), strict=True))
            for r, p in zip(refs, new.layer_partition, strict=True)
        )
        if moved or not same:
            cost += costs.pp_s + costs.pp_per_layer_s * moved
    if new.microbatches != old.microbatches:
        cost += costs.dp_s
    return cost


def _shares(plan: ExecutionPlan) -> tuple[tuple[int, ...] | None, ...]:
    """Per group, its uneven shares, or None for an equal split (however it is written)."""
    if plan.tp_shares is None:
        return (None,) * len(plan.tp_groups)
    return tuple(None if len(set(c)) == 1 else c for c in plan.tp_shares)


def _shares_of(plan: ExecutionPlan, groups: tuple[tuple[int, ...], ...]) -> list[tuple[int, ...] | None]:
    """``plan``'s shares of each of ``groups`` (None: equal, or the group is not in ``plan``)."""
    own = dict(zip(plan.tp_groups, _shares(plan), strict=True))
    return [own.get(g) for g in groups]


def improve_counts(
    plan: ExecutionPlan, price: Callable[[ExecutionPlan], float], *, max_moves: int = 256
) -> ExecutionPlan:
    """Greedy DP redistribution: move one microbatch at a time from a replica to another while the
    priced step time drops (Greyhound S2 minimizes the spread of per-replica times the same way)."""
    best, best_t = plan, price(plan)
    for _ in range(max_moves):
        cands = []
        for src in range(best.num_replicas):
            if best.microbatches[src] == 0:
                continue
            for dst in range(best.num_replicas):
                if dst != src:
                    mb = list(best.microbatches)
                    mb[src] -= 1
                    mb[dst] += 1
                    cand = replace(best, microbatches=tuple(mb))
                    cands.append((price(cand), cand))
        if not cands:
            break
        t, cand = min(cands, key=lambda x: x[0])
        if t >= best_t * (1 - 1e-9):
            break
        best, best_t = cand, t
    return best if best == plan else replace(best, version=plan.version + 1)


# Policies ----------------------------------------------------------------------------------------


class NoOp:
    """Never adapts: a fail-stop halts the job for good, a fail-slow slows every step."""

    name = "noop"
    detect_stop_steps = math.inf
    detect_slow_steps = math.inf

    def on_step(
        self,
        t: float,
        step: int,
        observed: tuple[float, ...],
        plan: ExecutionPlan,
        state: ClusterState,
        ctx: SimContext,
    ) -> Decision:
        return Decision(plan)


class CheckpointRestart:
    """On a detected fail-stop: restart from the last checkpoint without the dead device's replica.

    The removed replica's microbatches go to the survivors (the global batch is kept). Blind to fail-slow.
    """

    name = "ckpt-restart"
    detect_slow_steps = math.inf

    def __init__(self, *, detect_stop_steps: float = 2.0) -> None:
        self.detect_stop_steps = detect_stop_steps

    def on_step(
        self,
        t: float,
        step: int,
        observed: tuple[float, ...],
        plan: ExecutionPlan,
        state: ClusterState,
        ctx: SimContext,
    ) -> Decision:
        new = restart_plan(plan, observed)
        if new is None or new == plan:
            return Decision(plan)  # nothing dead, or nothing left to restart on: the job stays down
        return Decision(new, ctx.job.restart_cost_s, restart=True)


def restart_plan(plan: ExecutionPlan, speeds: tuple[float, ...]) -> ExecutionPlan | None:
    """Checkpoint-restart's plan: drop every replica holding a device of speed 0, keep the global
    batch (split evenly over the survivors). ``plan`` itself if none is dead; None if none survives."""
    keep = [
        r
        for r in range(plan.num_replicas)
        if all(speeds[d] > 0 for s in range(plan.num_stages) for d in plan.group(r, s))
    ]
    if len(keep) == plan.num_replicas:
        return plan
    if not keep:
        return None
    q, rem = divmod(sum(plan.microbatches), len(keep))
    return ExecutionPlan(
        version=plan.version + 1,
        tp_groups=tuple(plan.group(r, s) for r in keep for s in range(plan.num_stages)),
        layer_partition=tuple(plan.layer_partition[r] for r in keep),
        microbatches=tuple(q + (i < rem) for i in range(len(keep))),
    )


def _try_replan(
    state: ClusterState,
    src: ExecutionPlan,
    duration_s: float,
    costs: ReconfigCosts,
    per_replica: bool = False,
) -> ExecutionPlan | None:
    """``progressive_replan`` from ``src``, or None when no replica can survive."""
    try:
        return progressive_replan(
            state,
            src,
            expected_fault_duration_s=duration_s,
            reconfig_costs=costs,
            per_replica_partitions=per_replica,
        )[0]
    except ValueError:
        return None


Option = tuple[float, float, object]
"""A way to run a plan: (step time, stall of switching to it, mechanism: steptune's rerouting moves)."""


class Memoized:
    """A policy whose decision depends only on (job, plan, observed speeds): decide once, reuse."""

    def __init__(self) -> None:
        self._memo: dict[tuple[SimJob, ExecutionPlan, tuple[float, ...]], Decision] = {}

    def reset(self) -> None:
        self._memo.clear()

    def on_step(
        self,
        t: float,
        step: int,
        observed: tuple[float, ...],
        plan: ExecutionPlan,
        state: ClusterState,
        ctx: SimContext,
    ) -> Decision:
        key = (ctx.job, plan, observed)
        if key not in self._memo:
            self._memo[key] = self._decide(observed, plan, state, ctx)
        return self._memo[key]

    def _decide(
        self, observed: tuple[float, ...], plan: ExecutionPlan, state: ClusterState, ctx: SimContext
    ) -> Decision:
        raise NotImplementedError


class ResiHPPolicy(Memoized):
    """ResiHP: on a change in the detected speeds, ``progressive_replan`` and stall its reconfiguration.

    A detected fail-stop is a permanent fault; a fail-slow is expected to last ``expected_slow_s``
    (Greyhound's mean communication fail-slow, 24 min) for the ski-rental gates. Surviving replicas
    hold the optimizer state, so nothing is rolled back. A replan that finds no surviving replica
    leaves the job down. When every device in the plan is healthy again and an excluded device has
    recovered, it replans from the first plan, under the same ski-rental gate.
    """

    name = "resihp"
    tp_shares = False
    """Plan with steptune's uneven TP shares (``SteptunePolicy``) instead of ResiHP's exclusion."""
    assignment_error: float | None = PREDICTION_SIGMA
    """Workload-aware DP assignment (``run(workload=)``): microbatches go to replicas by the predictor's
    cost estimate, with the predictor's error."""

    def __init__(
        self,
        *,
        detect_stop_steps: float = 2.0,
        detect_slow_steps: float = 2.0,
        expected_slow_s: float = 24 * 60.0,
        false_alarm_s_per_step: float = 0.0,
        per_replica_partitions: bool = False,
    ) -> None:
        self.per_replica_partitions = per_replica_partitions
        """Replan with a layer partition per replica (a runtime with layer-wise gradient sync)."""
        self.detect_stop_steps = detect_stop_steps
        self.detect_slow_steps = detect_slow_steps
        self.expected_slow_s = expected_slow_s
        self.false_alarm_s_per_step = false_alarm_s_per_step
        """Expected validation stall of false fail-slow alarms per step (the sim adds it to every step)."""
        super().__init__()

    def _decide(
        self, observed: tuple[float, ...], plan: ExecutionPlan, state: ClusterState, ctx: SimContext
    ) -> Decision:
        if self.tp_shares:
            state = replace(state, tp_shares=True)
        # The per-device view (a slow link shows as a slower device); prices use ``observed``.
        used = [state.speeds[d] for g in plan.tp_groups for d in g]
        if min(used) >= 1.0 and plan.tp_shares is None:
            return self._readmit(plan, state, observed, ctx)
        dur = math.inf if min(used) <= 0 else self.expected_slow_s
        if min(used) >= 1.0:  # healthy again, on steptune's uneven shares (ResiHP readmits above)
            dur = self._readmit_horizon_s()
        # Candidates: the gated progressive plan and the ungated one; the iteration-time predictor
        # (the pipeline simulator's critical path, not the planner's closed form) and the ski-rental
        # horizon pick among them. No candidate means no replica survives: down until devices return.
        cands = [plan]
        for costs, horizon in ((ctx.job.reconfig, dur), (ReconfigCosts(tp_s=0.0, pp_s=0.0), math.inf)):
            cand = _try_replan(state, plan, horizon, costs, self.per_replica_partitions)
            if cand is not None and cand not in cands:
                cands.append(cand)
        cands += self._more_candidates(cands, plan, observed, state, ctx)
        t_now = self._running_on(plan, observed, ctx)[0]

        def total(o: Option) -> tuple[float, float]:
            t_c, cost, _ = o
            if math.isinf(dur) or math.isinf(t_now):
                return (t_c, cost)
            return (cost + dur / t_now * t_c, 0.0)  # seconds to run the fault's steps

        best = {c: min(self._options(plan, c, observed, ctx), key=total) for c in cands}
        new = min(cands, key=lambda c: total(best[c]))  # replans come back as version + 1 already
        self._picked(plan, observed, best[new][2])
        return Decision(new, best[new][1])

    def _options(
        self, plan: ExecutionPlan, new: ExecutionPlan, observed: tuple[float, ...], ctx: SimContext
    ) -> list[Option]:
        """The ways to run ``new`` after ``plan``: (step time under ``observed``, switching stall,
        mechanism). ResiHP has one: the plan as its runtime runs it, for ``reconfig_cost``."""
        return [(ctx.step_time(new, observed), reconfig_cost(plan, new, ctx.job.reconfig), None)]

    def _running_on(self, plan: ExecutionPlan, observed: tuple[float, ...], ctx: SimContext) -> Option:
        """The free option of ``plan`` itself: running on as it is."""
        return min((o for o in self._options(plan, plan, observed, ctx) if o[1] == 0), key=lambda o: o[0])

    def _picked(self, plan: ExecutionPlan, observed: tuple[float, ...], mechanism: object) -> None:
        """The decision from (``plan``, ``observed``) runs with ``mechanism`` (steptune keeps it)."""

    def _readmit_horizon_s(self) -> float:
        """The ski-rental horizon for undoing a fault's changes once it is over: ResiHP uses the fault's
        (``expected_slow_s``); steptune the time until the next fault (unbounded)."""
        return self.expected_slow_s

    def _more_candidates(
        self,
        cands: list[ExecutionPlan],
        plan: ExecutionPlan,
        observed: tuple[float, ...],
        state: ClusterState,
        ctx: SimContext,
    ) -> list[ExecutionPlan]:
        """Plans to weigh besides ResiHP's progressive replans: none (steptune adds some)."""
        return []

    def _readmit(
        self, plan: ExecutionPlan, state: ClusterState, observed: tuple[float, ...], ctx: SimContext
    ) -> Decision:
        """Every device in the plan is healthy: undo what the faults made the plan do.

        Candidates: the replan from the first plan under the observed speeds (takes back recovered
        devices, restores the layer partition) and the current plan with balanced microbatch counts.
        Switch to the one with the fastest simulated step if it is faster and the gain over
        ``expected_slow_s`` (the horizon a fail-slow decision used) pays for the reconfiguration, the
        same ski-rental rule as in the other direction.
        """
        cands = [rebalanced(state, plan)]
        base_devices = {d for g in ctx.base_plan.tp_groups for d in g}
        in_plan = {d for g in plan.tp_groups for d in g}
        back = any(state.speeds[d] >= 1.0 for d in base_devices - in_plan)
        if back or set(plan.layer_partition) != set(ctx.base_plan.layer_partition):
            new = _try_replan(state, ctx.base_plan, math.inf, ctx.job.reconfig, self.per_replica_partitions)
            if new is not None:
                cands.append(new)
        now = self._running_on(plan, observed, ctx)
        best, best_o = plan, now
        for c in (plan, *(replace(c, version=plan.version + 1) for c in cands)):
            for o in self._options(plan, c, observed, ctx):
                if o[0] < best_o[0] and should_apply(now[0], o[0], self._readmit_horizon_s(), o[1]):
                    best, best_o = c, o
        self._picked(plan, observed, best_o[2])
        return Decision(best, best_o[1])


class SteptunePolicy(ResiHPPolicy):
    """steptune: ResiHP's detector, ski-rental gates and PP/DP steps, with uneven TP shares in place of
    TP exclusion. A TP group keeps every live member and splits its heads (with their MLP slices) by
    speed (``plan.water_fill``), so a slow member works on less instead of leaving, and the survivors of a
    fail-stop keep their whole throughput (3 of 4 run at 32/11 = 2.9 devices where ResiHP keeps 2).
    Re-splitting a group's shares costs ``tp_s`` like a membership change. Live counterpart:
    ``tensorpar``'s ``tp_policy="uneven"``."""

    name = "steptune"
    tp_shares = True
    _adapted = False
    _moves: dict[tuple[int, int], int] | None = None
    _state: ClusterState

    def __init__(self, *, reroute: bool = True, **kwargs: float | bool) -> None:
        self.reroute = reroute
        """Weigh rerouting part of slow or dead workers' microbatches to DP peers (``reroute``)."""
        super().__init__(**kwargs)  # type: ignore[arg-type]
        self.reset()

    def reset(self) -> None:
        super().reset()
        self._adapted = False
        self._moves = None
        self._pick: dict[tuple[ExecutionPlan, tuple[float, ...]], object] = {}
        self._rerouted: dict[tuple[object, ...], float] = {}
        self._best: dict[
            tuple[ExecutionPlan, tuple[float, ...]], tuple[float, dict[tuple[int, int], int]]
        ] = {}

    def on_step(
        self,
        t: float,
        step: int,
        observed: tuple[float, ...],
        plan: ExecutionPlan,
        state: ClusterState,
        ctx: SimContext,
    ) -> Decision:
        self._state = state  # what ``_options`` prices a plan without rerouting by
        decision = super().on_step(t, step, observed, plan, state, ctx)
        self._adapted = runs_slow(decision.plan, state)  # reschedule as Adaptra does
        # Part of the slow or dead workers' microbatches rerouted to DP peers (``reroute``), or none:
        # the decision picked the moves with the plan (``_options``); they stay until the next one.
        moves = self._pick.get((plan, observed), self._moves)
        if decision.plan == plan:
            # Same plan, new moves: a new version, so the sim stalls (``pp_s``) once.
            decision = (
                Decision(replace(plan, version=plan.version + 1), decision.stall_s)
                if moves != self._moves
                else Decision(plan)
            )
        self._moves = moves  # type: ignore[assignment]
        return decision

    def _readmit_horizon_s(self) -> float:
        # Health lasts until the next fault: at Llama 3's rate (419 interruptions in 54 days on 16K
        # GPUs) about 8 days on 256 GPUs, unbounded next to a stall of seconds.
        return math.inf

    def _picked(self, plan: ExecutionPlan, observed: tuple[float, ...], mechanism: object) -> None:
        self._pick[(plan, observed)] = mechanism

    def _options(
        self, plan: ExecutionPlan, new: ExecutionPlan, observed: tuple[float, ...], ctx: SimContext
    ) -> list[Option]:
        """``new`` run without rerouting (rescheduled as Adaptra does), with its best moves, and (for the
        plan in place) with the current moves. Changing the moves is a new schedule and P2P set-up at a
        safe point: it stalls ``pp_s`` as ReCycle's rerouting does, on top of a TP change (a repartition's
        own ``pp_s`` covers it). Without rerouting a plan is priced as ``step_time`` will charge it."""
        base = reconfig_cost(plan, new, ctx.job.reconfig)
        # New moves on the same layer partition pay ``pp_s`` on top of any TP change; a repartition's
        # own ``pp_s`` already covers the new schedule.
        rerouting = base if new.layer_partition != plan.layer_partition else base + ctx.job.reconfig.pp_s
        mechanisms: list[dict[tuple[int, int], int] | None] = [None]
        if self.reroute:
            moves = self._reroute(new, observed, ctx)[1]
            if moves:
                mechanisms.append(moves)
        if new == plan and self._moves and self._moves not in mechanisms:
            mechanisms.append(self._moves)
        return [
            (
                self._mechanism_time(new, observed, ctx, m),
                base if m == self._moves else rerouting,
                m,
            )
            for m in mechanisms
        ]

    def _mechanism_time(
        self,
        plan: ExecutionPlan,
        speeds: tuple[float, ...],
        ctx: SimContext,
        moves: dict[tuple[int, int], int] | None,
    ) -> float:
        if not moves:  # as ``step_time`` will charge it
            slow = runs_slow(plan, self._state)
            return (ctx.rescheduled_step_time if slow else ctx.step_time)(plan, speeds)
        key = (plan, speeds, tuple(sorted(moves.items())))
        if key not in self._rerouted:
            from steptune.resilience.reroute import rerouted_step_time

            self._rerouted[key] = rerouted_step_time(plan, speeds, ctx, moves)
        return self._rerouted[key]

    def _reroute(
        self, plan: ExecutionPlan, speeds: tuple[float, ...], ctx: SimContext
    ) -> tuple[float, dict[tuple[int, int], int]]:
        from steptune.resilience.reroute import best_moves  # reroute prices with this module's model

        key = (plan, speeds)
        if key not in self._best:
            self._best[key] = best_moves(plan, speeds, ctx)
        return self._best[key]

    def _more_candidates(
        self,
        cands: list[ExecutionPlan],
        plan: ExecutionPlan,
        observed: tuple[float, ...],
        state: ClusterState,
        ctx: SimContext,
    ) -> list[ExecutionPlan]:
        # One repartition for all replicas (Greyhound's S3), and each candidate's microbatch counts
        # improved by greedy moves priced by the iteration-time predictor (the simulator), not by the
        # planner's per-device speed, which misjudges slow links.
        more = [c for c in (uniform_repartition(state, plan),) if c is not None]
        # The plan as it is with uneven shares around the fault: cheapest to switch to, and with part
        # of the hit workers' microbatches rerouted (``_options``) often the fastest.
        more.append(shares_only(state, plan))
        # ResiHP's replans again with a layer partition per replica (Oobleck-style heterogeneous
        # pipelines: the healthy replicas keep their split while the hit one rebalances). The live
        # counterpart syncs gradients layer-wise (``pipelined``), so replicas may hold different splits.
        if not self.per_replica_partitions:
            used = [state.speeds[d] for g in plan.tp_groups for d in g]
            dur = math.inf if min(used) <= 0 else self.expected_slow_s
            for costs, horizon in ((ctx.job.reconfig, dur), (ReconfigCosts(tp_s=0.0, pp_s=0.0), math.inf)):
                cand = _try_replan(state, plan, horizon, costs, per_replica=True)
                if cand is not None:
                    more.append(cand)

        def price(p: ExecutionPlan) -> float:
            return ctx.step_time(p, observed)

        more += [improve_counts(c, price) for c in (*cands, *more)]
        return [replace(c, version=plan.version + 1) for c in more if c != plan and c not in cands]

    def step_time(self, plan: ExecutionPlan, speeds: tuple[float, ...], ctx: SimContext) -> float:
        if self._moves:
            return self._mechanism_time(plan, speeds, ctx, self._moves)
        if self._adapted:
            return ctx.rescheduled_step_time(plan, speeds)
        return ctx.step_time(plan, speeds)


PriceFn = Callable[[ExecutionPlan, tuple[float, ...], SimContext], float]


class Oracle(Memoized):
    """Sees every change at once and switches for free to the best simulated plan: an upper bound.

    Candidates: the current plan, and ``progressive_replan`` from the current and from the first plan
    (so recovered devices come back), each with free and with the job's reconfiguration costs, with one
    partition for all replicas and with one per replica; and the same with uneven TP shares (steptune's),
    free only. With
    ``extra_prices`` (other mechanisms' step times, e.g. ReCycle's rerouting or Adaptra's
    rescheduling, from ``baselines.oracle``) a plan runs at the best of all of them, so the bound
    also covers policies whose mechanism is not a plan change. Every plan, uneven shares included, may
    also run rescheduled or with part of its slow workers' microbatches rerouted to DP peers (steptune
    does both).
    """

    name = "oracle"
    detect_stop_steps = 0.0
    detect_slow_steps = 0.0
    assignment_error = 0.0
    """Assigns each step's microbatches by their exact costs (``run(workload=)``)."""

    def __init__(self, *, extra_prices: tuple[PriceFn, ...] = ()) -> None:
        super().__init__()
        self.extra_prices = extra_prices
        self._prices: dict[tuple[SimJob, ExecutionPlan, tuple[float, ...]], float] = {}

    def reset(self) -> None:
        super().reset()
        self._prices = {}

    def step_time(self, plan: ExecutionPlan, speeds: tuple[float, ...], ctx: SimContext) -> float:
        key = (ctx.job, plan, tuple(speeds))
        if key not in self._prices:
            prices = [ctx.rescheduled_step_time(plan, speeds)]
            # Plans with uneven TP shares are steptune's alone; no baseline mechanism runs on them.
            if plan.tp_shares is None:
                prices += [float(f(plan, speeds, ctx)) for f in self.extra_prices]
            from steptune.resilience.reroute import best_moves  # prices with this module's model

            prices.append(best_moves(plan, speeds, ctx)[0])  # steptune's (partial) rerouting
            self._prices[key] = min(prices)
        return self._prices[key]

    def _decide(
        self, observed: tuple[float, ...], plan: ExecutionPlan, state: ClusterState, ctx: SimContext
    ) -> Decision:
        free = ReconfigCosts(tp_s=0.0, pp_s=0.0)
        cands = [plan, ctx.base_plan]
        shared = replace(state, tp_shares=True)  # steptune's uneven shares
        for st, all_costs in ((state, (free, ctx.job.reconfig)), (shared, (free, ctx.job.reconfig))):
            for src in (plan, ctx.base_plan):
                for costs in all_costs:
                    for per_replica in (False, True):  # steptune replans each replica's partition
                        cand = _try_replan(st, src, math.inf, costs, per_replica)
                        if cand is not None:
                            cands.append(cand)
        # Greyhound's S3 (one repartition for all replicas), and greedy microbatch moves priced exactly
        # (the planner's DP step assigns by speed; with slow links the DP sync term matters too).
        cands += [c for src in (plan, ctx.base_plan) if (c := uniform_repartition(state, src)) is not None]
        cands += [shares_only(shared, src) for src in (plan, ctx.base_plan)]  # steptune's, for rerouting
        # The moves are priced by the plain step time (per-replica cached; the other mechanisms' prices
        # would re-simulate every move), the final pick by the best of all prices.
        cands += [improve_counts(c, lambda p: ctx.step_time(p, observed)) for c in cands]
        # Many candidates are the same plan under another version number: price each plan once.
        unique = dict.fromkeys(replace(c, version=plan.version) for c in cands)
        best = min(unique, key=lambda p: self.step_time(p, observed, ctx))
        return Decision(best if best == plan else replace(best, version=plan.version + 1))


# The run loop ------------------------------------------------------------------------------------


def _speeds(
    failures: tuple[FailureEvent, ...], n: int, t: float, delays: tuple[float, float], links: bool = False
) -> list[float]:
    """Speeds at time ``t`` as seen ``delays`` = (fail-stop, fail-slow) seconds late; (0, 0): the truth.
    With ``links``: ``n`` compute factors, then ``n`` link factors."""
    out = [1.0] * (2 * n if links else n)
    for f in failures:
        if f.kind == "fail-stop":
            if t >= f.start_s + delays[0]:
                out[f.device] = 0.0
        elif f.start_s + delays[1] <= t < f.end_s + delays[1]:
            out[f.device + (n if f.target == "link" else 0)] *= f.factor
    return out


StepTimeOf = Callable[[int, ExecutionPlan, tuple[float, ...]], float]
"""``(step, plan, true speeds) -> seconds``: a workload whose steps differ (``run(step_time_of=)``)."""


def run(
    job: SimJob,
    policy: Policy,
    failures: tuple[FailureEvent, ...] | list[FailureEvent],
    duration_s: float,
    *,
    step_time_of: StepTimeOf | None = None,
    workload: BatchWorkload | None = None,
) -> SimResult:
    """Simulate ``duration_s`` seconds of ``job`` under ``failures`` with ``policy`` deciding recoveries.

    ``step_time_of``: the true seconds of each step when the workload varies from step to step (the
    live jobs' own microbatches, ``livesim.LiveWorkload``); policies still plan with the job's mean
    microbatch, as a planner that cannot see the next batch would. None: every step costs the cost
    model's time.

    ``workload``: each step draws its own packed global batch (``simload``); a policy with
    ``assignment_error`` None deals it to the replicas by count, one with a float assigns it by
    predicted cost (that log-error; 0: exact), and the step's compute time scales by the busiest
    replica's extra work."""
    failures = tuple(failures)
    if step_time_of is not None and workload is not None:
        raise ValueError("give step_time_of or workload, not both")
    if step_time_of is not None and getattr(policy, "step_time", None) is not None:
        raise ValueError(
            f"policy {policy.name!r} prices its own steps (rerouting, rescheduling); step_time_of cannot "
            "replace that price: run it without step_time_of"
        )
    n = job.num_devices
    if duration_s <= 0:
        raise ValueError(f"duration_s must be > 0, got {duration_s}")
    if any(f.device >= n for f in failures):
        raise ValueError(f"failure device ids must be < {n} (tp*pp*dp devices of the job)")
    if not job.comm and any(f.target == "link" for f in failures):
        raise ValueError("link fail-slows need a communication model: SimJob(comm=True)")
    fwd, bwd, nbytes, heads = _layer_times(job)
    memory = (
        job.memory_bytes if job.memory_bytes is not None else cluster_preset(job.cluster).device.memory_bytes
    )
    costs = tuple(a + b for a, b in zip(fwd, bwd, strict=True))

    def cluster_state(speeds: tuple[float, ...]) -> ClusterState:
        return ClusterState(
            speeds=speeds, layer_costs=costs, num_heads=heads, layer_bytes=nbytes, memory_bytes=memory
        )

    gmb = job.global_microbatches
    base = initial_plan(cluster_state((1.0,) * n), tp=job.tp, pp=job.pp, dp=job.dp, global_microbatches=gmb)
    comm = comm_model(job.model, job.cluster, job.tokens_per_microbatch, n) if job.comm else None
    ones = (1.0,) * (2 * n if comm else n)
    step_time, replica_times = _make_step_model(fwd, bwd, comm)
    healthy = step_time(base, ones)
    share = 0.0 if comm is None else 1.0 - _make_step_time(fwd, bwd)(base, ones) / healthy
    lf, lb, lw = layer_phase_times(job)
    ctx = SimContext(
        job=job,
        base_plan=base,
        healthy_step_s=healthy,
        step_time=step_time,
        layer_f=lf,
        layer_b=lb,
        layer_w=lw,
        gpus_per_node=cluster_preset(job.cluster).gpus_per_node,
        comm=comm,
        comm_share=share,
        rescheduled_step_time=_make_step_time(fwd, bwd, comm, max_extra=RESCHEDULE_MAX_EXTRA),
    )
    delays = (
        policy.detect_stop_steps * healthy,
        policy.detect_slow_steps * healthy + float(getattr(policy, "detect_slow_delay_s", 0.0)),
    )
    reset = getattr(policy, "reset", None)
    if reset is not None:
        reset()  # a policy with per-run state starts afresh
    priced = _policy_step_time(policy, ctx)
    # Expected validation stall of false fail-slow alarms per step (Greyhound: ~1.5 s per alarm).
    overhead = float(getattr(policy, "false_alarm_s_per_step", 0.0))
    # Every moment the truth or the policy's view can change: where a halted job resumes looking.
    edges = [x for f in failures for x in (f.start_s, f.end_s)]
    changes = sorted({x + d for x in edges for d in (0.0, *delays)} - {math.inf})
    t, plan, steps, good_steps = 0.0, base, 0, 0
    stall = lost = halted = 0.0
    timeline: list[tuple[float, float, int]] = []
    log: list[str] = []
    ckpt_step, ckpt_t, since_ckpt_s = 0, 0.0, 0.0  # good_steps at the last checkpoint
    while t < duration_s:
        observed = tuple(_speeds(failures, n, t, delays, comm is not None))
        view = effective_speeds(observed, n, share)
        decision = policy.on_step(t, steps, observed, plan, cluster_state(view), ctx)
        if decision.plan != plan or decision.stall_s > 0:
            log.append(
                f"t={t:.1f}s: plan v{plan.version} -> v{decision.plan.version}, stall {decision.stall_s}s"
            )
            plan = decision.plan
            stall += min(decision.stall_s, duration_s - t)
            t += decision.stall_s
            if decision.restart:
                lost += since_ckpt_s
                good_steps, since_ckpt_s, ckpt_t = ckpt_step, 0.0, t
            continue  # the world may have changed during the stall
        truth = tuple(_speeds(failures, n, t, (0.0, 0.0), comm is not None))
        st = priced(plan, truth)
        if math.isinf(st):
            resume = min((x for x in changes if x > t), default=duration_s)
            halted += min(resume, duration_s) - t
            t = resume
            continue
        if step_time_of is not None:
            st = step_time_of(steps, plan, truth)
        elif workload is not None:
            sigma = getattr(policy, "assignment_error", None)
            guess = None if sigma is None else workload.predicted(steps, float(sigma))
            g = workload_factor(plan, replica_times(plan, truth), workload.costs(steps), guess)
            sync = dp_sync_s(plan, truth, ctx)
            st = (st - sync) * g + sync
        in_plan = {d for g in plan.tp_groups for d in g}
        abort = min(
            (
                f.start_s
                for f in failures
                if f.kind == "fail-stop" and f.device in in_plan and t < f.start_s < t + st
            ),
            default=math.inf,
        )
        if abort < duration_s:
            lost += abort - t
            t = abort
            continue
        st += overhead + job.step_overhead_s
        if t + st > duration_s:
            break  # a step cut off by the end of the run counts for nothing
        timeline.append((t, st, plan.version))
        t += st
        steps += 1
        good_steps += 1
        since_ckpt_s += st
        if t >= ckpt_t + job.checkpoint_interval_s:
            ckpt_step, ckpt_t, since_ckpt_s = good_steps, t, 0.0
    return SimResult(
        policy=policy.name,
        duration_s=duration_s,
        tokens=good_steps * job.tokens_per_step,
        steps=steps,
        lost_steps=steps - good_steps,
        stall_s=stall,
        lost_s=lost,
        halted_s=halted,
        timeline=tuple(timeline),
        log=tuple(log),
    )
