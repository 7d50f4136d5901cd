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
from steptune.resilience.plan import ClusterState, ExecutionPlan, ReconfigCosts, shares_speed
from steptune.resilience.replans import initial_plan
from steptune.resilience.simcomm import CommModel, comm_model, effective_speeds
from steptune.resilience.simload import BatchWorkload, workload_factor
from steptune.resilience.workload import StageModel

__all__ = [
    "Decision",
    "FailureEvent",
    "Policy",
    "SimContext",
    "SimJob",
    "SimResult",
    "StepTimeHook",
    "StepTimeOf",
    "cached_one_f_one_b",
    "dp_sync_s",
    "improve_counts",
    "layer_phase_times",
    "pipeline_time",
    "reconfig_cost",
    "run",
]

_KINDS = ("fail-stop", "fail-slow")
_TARGETS = ("compute", "link")
MIN_FACTOR = 1e-6
"""Slowest fail-slow speed the simulator prices (a million-fold slowdown); slower is a hang: a fail-stop."""
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
        # each message names its field first: the scenario CSV's column of the same name
        if self.kind not in _KINDS:
            raise ValueError(f"kind: failure kind {self.kind!r} must be one of {_KINDS}")
        if self.target not in _TARGETS or (self.target == "link" and self.kind != "fail-slow"):
            raise ValueError(
                f"target: failure target {self.target!r} must be one of {_TARGETS} (link: fail-slows)"
            )
        if self.device < 0:
            raise ValueError(f"device: a device id is >= 0, got {self.device}")
        if not 0 <= self.start_s < math.inf:
            raise ValueError(f"start_s: a failure starts at a finite time >= 0 seconds, got {self.start_s}")
        if not self.duration_s > 0:
            raise ValueError(f"duration_s: a failure lasts > 0 seconds (or inf), got {self.duration_s}")
        if not math.isfinite(self.factor):  # a fail-stop ignores it, but a NaN would reach JSON and traces
            raise ValueError(f"factor: a failure's factor is a finite number, got {self.factor}")
        if self.kind == "fail-slow" and not 0 < self.factor <= 1:
            hint = f"; a {self.factor:g}x slowdown is factor {1 / self.factor:.4g}" if self.factor > 1 else ""
            raise ValueError(
                f"factor: fail-slow factor {self.factor} must lie in (0, 1] (0.5 = half speed){hint}"
            )
        if self.kind == "fail-slow" and self.factor < MIN_FACTOR:
            raise ValueError(
                f"factor: fail-slow factor {self.factor:g} is below {MIN_FACTOR:g} (a million-fold "
                "slowdown): a device that slow is hung; write it as a fail-stop"
            )

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
    cut_s: float = 0.0
    """Seconds of the last step, cut off by the end of the run (it trains nothing). With the steps' own
    time, the stalls, the lost and the halted seconds it sums to ``duration_s`` (a restart's discarded
    steps are in both ``timeline`` and ``lost_s``: count them once)."""

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
    config = model.config
    return fwd, bwd, nbytes, int(config.get("num_attention_heads", config.get("num_heads", 0)))


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
    gpus = cluster_preset(job.cluster).num_gpus
    if n > gpus:  # a sweep (2026-12-05): 256 devices "ran" on a 64-GPU preset
        raise ValueError(
            f"SimJob(tp={job.tp}, pp={job.pp}, dp={job.dp}) needs {n} devices and cluster {job.cluster!r} "
            f"has {gpus}: lower tp, pp or dp, or pick a larger cluster"
        )
    fwd, bwd, nbytes, heads = _layer_times(job)
    if heads == 0 and job.tp > 1:
        # it ran as one head: steptune's uneven TP shares put the whole group's work on one member (a sweep)
        raise ValueError(
            f"SimJob(tp={job.tp}): the {job.model} preset names no attention head count, so its TP shares "
            "cannot be planned: use tp=1, or a preset with num_attention_heads"
        )
    heads = max(heads, 1)
    if heads > 1 and heads % job.tp:
        raise ValueError(
            f"SimJob(tp={job.tp}): {job.model} has {heads} attention heads, which tp must divide (the "
            "planners split heads evenly): pick a tp that divides them"
        )
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
    stall = lost = halted = cut = 0.0
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
            cut = duration_s - t  # a step cut off by the end of the run counts for nothing
            break
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
        cut_s=cut,
        timeline=tuple(timeline),
        log=tuple(log),
    )
