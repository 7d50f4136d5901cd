"""Simulated FSDP training step of a ``ModelSpec`` on a ``ClusterSpec`` (one rank, by symmetry).

Every layer is one FSDP unit. Forward all-gathers each unit's bf16 parameters (prefetching up to
``prefetch`` units ahead), backward all-gathers them again in reverse order and reduce-scatters
the gradients; all collectives share one network FIFO, compute runs on one stream. The result is
a *simulated* timeline: FLOPs at a fixed efficiency, alpha-beta collectives (core.cost), no
kernel interference, no layout copies. Its assumptions are listed in docs/core.md.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from steptune.core.cost import Collective, compute_time, group_collective_time
from steptune.core.events import Environment, Event, ProcessGen, Resource
from steptune.core.specs import ClusterSpec, ModelSpec, Phase
from steptune.core.trace import Span, Trace

__all__ = ["FSDPStepConfig", "FSDPStepResult", "simulate_fsdp_step"]


@dataclass(frozen=True, kw_only=True, slots=True)
class FSDPStepConfig:
    num_gpus: int
    """Ranks in the FSDP group (consecutive ranks of the cluster)."""
    tokens_per_gpu: int = 8192
    """Tokens each rank processes per step: sequences of the model's seq_len (one shorter sequence when
    fewer tokens than that; attention is charged for the sequence length actually run)."""
    efficiency: float = 0.5
    """Fraction of the device's dense bf16 peak that matmuls reach."""
    prefetch: int = 1
    """Units all-gathered ahead of the one computing (FSDP2's default is 1)."""
    grad_bytes: int = 2
    """Bytes per gradient element on the wire (2: bf16 reduce, 4: fp32 reduce)."""

    def __post_init__(self) -> None:
        if self.num_gpus < 1 or self.tokens_per_gpu < 1 or self.prefetch < 0:
            raise ValueError(
                f"FSDPStepConfig needs num_gpus >= 1, tokens_per_gpu >= 1 and prefetch >= 0; got "
                f"num_gpus={self.num_gpus}, tokens_per_gpu={self.tokens_per_gpu}, prefetch={self.prefetch}"
            )
        if not 0 < self.efficiency <= 1:
            raise ValueError(
                f"FSDPStepConfig.efficiency: a fraction of peak in (0, 1], got {self.efficiency}"
            )
        if self.grad_bytes not in (1, 2, 4):
            raise ValueError(f"FSDPStepConfig.grad_bytes: 1, 2 or 4 (fp8, bf16, fp32), got {self.grad_bytes}")


@dataclass(frozen=True, kw_only=True, slots=True)
class FSDPStepResult:
    step_time: float
    compute_time: float
    comm_time: float
    """Sum of collective durations (overlapped or not)."""
    exposed_comm: float
    """Step time not covered by compute: what communication costs end to end."""
    mfu: float
    spans: tuple[Span, ...] = field(repr=False)

    def trace(self) -> Trace:
        t = Trace()
        t.spans.extend(self.spans)
        return t


def simulate_fsdp_step(model: ModelSpec, cluster: ClusterSpec, config: FSDPStepConfig) -> FSDPStepResult:
    if config.num_gpus > cluster.num_gpus:
        raise ValueError(
            f"num_gpus={config.num_gpus} exceeds {cluster.name}'s {cluster.num_gpus} GPUs; "
            f"pick fewer or a cluster preset with more nodes"
        )
    if config.prefetch < 0:
        raise ValueError(f"prefetch must be >= 0, got {config.prefetch}")
    g = cluster.gpus_per_node
    if config.num_gpus > g and config.num_gpus % g:
        raise ValueError(
            f"num_gpus={config.num_gpus} spans nodes of {cluster.name} but is not a multiple of its "
            f"gpus_per_node={g}: pick {g * (config.num_gpus // g)} or {g * (config.num_gpus // g + 1)}"
        )
    env = Environment()
    compute, network = Resource(env, name="compute"), Resource(env, name="network")
    n = model.num_layers
    seq = min(model.seq_len, config.tokens_per_gpu)  # fewer tokens than seq_len: one shorter sequence
    seqs = config.tokens_per_gpu / seq
    dev = cluster.device

    def ctime(i: int, phases: tuple[Phase, ...]) -> float:
        flops = sum(model.layers[i].flops(seq, p) for p in phases) * seqs
        return compute_time(flops, dev, efficiency=config.efficiency)

    def ctime_coll(kind: Collective, nbytes: float) -> float:
        return group_collective_time(kind, nbytes, config.num_gpus, cluster)

    spans: list[Span] = []
    fwd_ready, bwd_ready = [env.event() for _ in range(n)], [env.event() for _ in range(n)]
    fwd_started, bwd_started = [env.event() for _ in range(n)], [env.event() for _ in range(n)]
    grad_ready = [env.event() for _ in range(n)]

    def run(res: Resource, name: str, dur: float, stream: str, cat: str) -> ProcessGen:
        yield res.request()
        start = env.now
        yield env.timeout(dur)
        res.release()
        spans.append(Span(name=name, start=start, duration=dur, stream=stream, category=cat))

    def gate(ev: list[Event], i: int) -> Event:
        return ev[i] if 0 <= i < n else env.timeout(0.0)

    def all_gathers() -> ProcessGen:
        for i in range(n):  # forward order, at most `prefetch` units ahead of compute
            yield gate(fwd_started, i - config.prefetch - 1)
            yield from run(
                network,
                f"AG {model.layers[i].name}",
                ctime_coll(Collective.ALL_GATHER, 2 * model.layers[i].params),
                "comm",
                "all-gather",
            )
            fwd_ready[i].succeed()
        for i in reversed(range(n)):
            yield gate(bwd_started, i + config.prefetch + 1)
            yield from run(
                network,
                f"AG {model.layers[i].name}",
                ctime_coll(Collective.ALL_GATHER, 2 * model.layers[i].params),
                "comm",
                "all-gather",
            )
            bwd_ready[i].succeed()

    def reduce_scatters() -> ProcessGen:
        for i in reversed(range(n)):
            yield grad_ready[i]
            yield from run(
                network,
                f"RS {model.layers[i].name}",
                ctime_coll(Collective.REDUCE_SCATTER, config.grad_bytes * model.layers[i].params),
                "comm",
                "reduce-scatter",
            )

    def computes() -> ProcessGen:
        for i in range(n):
            yield fwd_ready[i]
            fwd_started[i].succeed()
            yield from run(compute, f"F {model.layers[i].name}", ctime(i, (Phase.F,)), "compute", "forward")
        for i in reversed(range(n)):
            yield bwd_ready[i]
            bwd_started[i].succeed()
            yield from run(
                compute, f"B {model.layers[i].name}", ctime(i, (Phase.B, Phase.W)), "compute", "backward"
            )
            grad_ready[i].succeed()

    env.process(all_gathers(), name="all-gather")
    env.process(reduce_scatters(), name="reduce-scatter")
    env.process(computes(), name="compute")
    step = env.run()
    comp = sum(s.duration for s in spans if s.stream == "compute")
    comm = sum(s.duration for s in spans if s.stream == "comm")
    flops = model.flops(seq) * seqs
    mfu = flops / (step * dev.peak_flops) if step > 0 else 0.0
    return FSDPStepResult(
        step_time=step,
        compute_time=comp,
        comm_time=comm,
        exposed_comm=step - comp,
        mfu=mfu,
        spans=tuple(spans),
    )
