"""A per-layer event model of one FSDP2 training step under stock, SymmMem and TIDE (SIMULATED).

One rank by symmetry, on ``steptune.core.events``. Streams: compute (forward, backward, and the layout
copies FSDP2 issues on it: copy-out, ``chunk_cat``), all-gather (copy-in then the collective, prefetching one
unit ahead as FSDP2's implicit prefetch does), reduce-scatter; all-gathers and reduce-scatters share the
network in FIFO order. Every unit is all-gathered in forward and again in backward, except the root unit
(FSDP2 does not reshard the root after forward).

Interference: while communication kernels hold ``k`` SMs, compute progresses at ``1 / s`` of its speed,
``s = waves(T, S - k) / waves(T, S) * (1 + gamma * u_hbm)`` with ``T`` the tiles of the layer's largest GEMM
(``costmodel.wave_slowdown``). The model is fluid: compute work is re-timed whenever a collective ends or
starts, which only happens at collective ends and compute boundaries, so each slice is exact.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from steptune.comm.constants import CommConstants
from steptune.comm.costmodel import LayerComm, System, layer_comm, wave_slowdown
from steptune.core.cost import compute_time
from steptune.core.events import Environment, Event, ProcessGen, Resource
from steptune.core.specs import ClusterSpec, LayerKind, ModelSpec, Phase
from steptune.core.trace import Span

__all__ = ["StepConfig", "StepResult", "simulate_step"]


@dataclass(frozen=True, kw_only=True, slots=True)
class StepConfig:
    num_gpus: int
    tokens_per_gpu: int = 8192
    slot_reuse: bool = True


@dataclass(frozen=True, kw_only=True, slots=True)
class StepResult:
    system: str
    step_time_s: float
    compute_s: float
    """Compute at full speed (no interference), summed over units."""
    layout_s: float
    """Layout copies on the compute stream (copy-out, chunk_cat) plus copy-in."""
    layout_share: float
    """Layout copies on the compute stream as a share of the step."""
    interference_s: float
    """Extra compute time caused by communication holding SMs / HBM."""
    rs_sm_time_s: float
    """SM-seconds of all reduce-scatters in the step."""
    peak_buffer_bytes: int
    rs_buffer_bytes: int
    exposed_comm_s: float
    spans: tuple[Span, ...] = field(repr=False, default=())


def _gemm_tiles(model: ModelSpec, tokens: int, consts: CommConstants) -> int:
    inter = int(model.config.get("intermediate_size") or model.config.get("moe_intermediate_size") or 0)
    n = max(model.hidden_size, inter)
    tm, tn = consts.gemm_tile
    return math.ceil(tokens / tm) * math.ceil(n / tn)


def simulate_step(
    model: ModelSpec,
    cluster: ClusterSpec,
    config: StepConfig,
    system: System | str,
    consts: CommConstants | None = None,
) -> StepResult:
    system = System(system)
    consts = consts or CommConstants()
    w = config.num_gpus
    if w > cluster.num_gpus:
        raise ValueError(f"--gpus {w} exceeds {cluster.name}'s {cluster.num_gpus} GPUs")
    dev = cluster.device
    n = model.num_layers
    seqs = config.tokens_per_gpu / model.seq_len
    comm: list[LayerComm] = [
        layer_comm(layer.params, cluster, w, system, consts, slot_reuse=config.slot_reuse)
        for layer in model.layers
    ]
    tiles = _gemm_tiles(model, config.tokens_per_gpu, consts)

    def work(i: int, phases: tuple[Phase, ...]) -> float:
        flops = sum(model.layers[i].flops(model.seq_len, p) for p in phases) * seqs
        return compute_time(flops, dev, efficiency=consts.matmul_efficiency)

    env = Environment()
    network = Resource(env, name="network")
    active: dict[int, tuple[float, float, float]] = {}  # id -> (end time, SMs, HBM bytes/s)
    ids = iter(range(1 << 30))
    spans: list[Span] = []
    extra = [0.0]
    # FSDP2's root group (embedding, final norm, head) is not resharded after forward.
    root = {i for i, layer in enumerate(model.layers) if layer.kind in (LayerKind.EMBEDDING, LayerKind.HEAD)}
    fwd_ready, bwd_ready = [env.event() for _ in range(n)], [env.event() for _ in range(n)]
    fwd_started, bwd_started = [env.event() for _ in range(n)], [env.event() for _ in range(n)]
    grad_ready = [env.event() for _ in range(n)]

    def slowdown() -> float:
        k = sum(sms for _, sms, _ in active.values())
        u = min(1.0, sum(bw for _, _, bw in active.values()) / dev.memory_bandwidth)
        return wave_slowdown(tiles, dev.num_sms or 132, k) * (1.0 + consts.hbm_contention * u)

    def collective(name: str, dur: float, sms: float, hbm: float, cat: str) -> ProcessGen:
        yield network.request()
        start, key = env.now, next(ids)
        active[key] = (start + dur, sms, hbm / dur if dur > 0 else 0.0)
        yield env.timeout(dur)
        del active[key]
        network.release()
        spans.append(Span(name=name, start=start, duration=dur, stream="comm", category=cat))

    def compute(name: str, amount: float, cat: str, *, interferes: bool = True) -> ProcessGen:
        start, remaining = env.now, amount
        while remaining > 1e-15:
            yield env.timeout(0.0)  # let collectives that start at this instant register first
            s = slowdown() if interferes else 1.0
            horizon = min((end for end, _, _ in active.values()), default=math.inf) - env.now
            if horizon <= 1e-15:
                continue  # a collective ends at this instant: let it leave, then re-time
            dt = min(remaining * s, horizon)
            yield env.timeout(dt)
            remaining -= dt / s
            extra[0] += dt - dt / s
        spans.append(Span(name=name, start=start, duration=env.now - start, stream="compute", category=cat))

    def gate(ev: list[Event], i: int) -> Event:
        return ev[i] if 0 <= i < n else env.timeout(0.0)

    def all_gathers() -> ProcessGen:
        for i in range(n):
            yield gate(fwd_started, i - 1)  # one unit of prefetch
            yield env.timeout(comm[i].copy_in_s)
            yield from collective(f"AG {i}", comm[i].ag_s, comm[i].ag_sms, comm[i].ag_hbm_bytes, "all-gather")
            fwd_ready[i].succeed()
        for i in reversed(range(n)):
            if i in root:
                bwd_ready[i].succeed()  # the root stays unsharded between forward and backward
                continue
            yield gate(bwd_started, i + 1)
            yield env.timeout(comm[i].copy_in_s)
            yield from collective(f"AG {i}", comm[i].ag_s, comm[i].ag_sms, comm[i].ag_hbm_bytes, "all-gather")
            bwd_ready[i].succeed()

    def reduce_scatters() -> ProcessGen:
        for i in reversed(range(n)):
            yield grad_ready[i]
            yield from collective(
                f"RS {i}", comm[i].rs_s, comm[i].rs_sms, comm[i].rs_hbm_bytes, "reduce-scatter"
            )

    def computes() -> ProcessGen:
        for i in range(n):
            yield fwd_ready[i]
            fwd_started[i].succeed()
            if comm[i].copy_out_s:
                yield from compute(f"copy-out {i}", comm[i].copy_out_s, "layout", interferes=False)
            yield from compute(f"F {i}", work(i, (Phase.F,)), "forward")
        for i in reversed(range(n)):
            yield bwd_ready[i]
            bwd_started[i].succeed()
            if comm[i].copy_out_s and i not in root:
                yield from compute(f"copy-out {i}", comm[i].copy_out_s, "layout", interferes=False)
            yield from compute(f"B {i}", work(i, (Phase.B, Phase.W)), "backward")
            if comm[i].chunk_cat_s:
                yield from compute(f"chunk_cat {i}", comm[i].chunk_cat_s, "layout", interferes=False)
            grad_ready[i].succeed()

    env.process(all_gathers(), name="all-gather")
    env.process(reduce_scatters(), name="reduce-scatter")
    env.process(computes(), name="compute")
    step = env.run()
    full = sum(work(i, (Phase.F,)) + work(i, (Phase.B, Phase.W)) for i in range(n))
    layout_compute = sum(s.duration for s in spans if s.category == "layout")
    copy_in = sum(c.copy_in_s for c in comm) * 2
    return StepResult(
        system=system.value,
        step_time_s=step,
        compute_s=full,
        layout_s=layout_compute + copy_in,
        layout_share=layout_compute / step if step else 0.0,
        interference_s=extra[0],
        rs_sm_time_s=sum(c.rs_sm_time for c in comm),
        peak_buffer_bytes=max(c.peak_buffer_bytes for c in comm),
        rs_buffer_bytes=max(c.rs_buffer_bytes for c in comm),
        exposed_comm_s=step - full - extra[0] - layout_compute,
        spans=tuple(spans),
    )
