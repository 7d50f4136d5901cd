"""Run a schedule on real ranks: our executor, torch's runtime on the same schedule, and the simulator.

Models: ``"sleep:PRESET"`` (sleep layers timed from the preset's analytic per-layer costs, the
head split as the schedule says: real pipeline timing on a 2-core machine, since sleeping ranks
do not contend for cores) or ``"tiny-decoder"`` (a small real decoder, for gradient checks).

Every rank builds the whole model from the same seed and keeps only its stages, so a rank can
also build the single-process reference for the gradient check without any communication.
Timing: ``repeats`` steps of each engine, interleaved (ours, torch, ours, torch, ...), a barrier
before each, the median reported. The simulated step uses a per-action overhead and a P2P latency
calibrated on the same ranks just before (a zero-cost schedule and a ping-pong).
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from steptune.core.dist import default_store, irecv, isend
from steptune.core.specs import LinkSpec
from steptune.pipeline.costs import LayerCosts, split_layer, stage_costs
from steptune.pipeline.executor import ExecutorConfig, PipelineExecutor
from steptune.pipeline.schedule import Schedule
from steptune.pipeline.simulate import simulate
from steptune.pipeline.stages import boundary_shape, lm_loss, sleep_layers, split_layers, tiny_decoder_layers
from steptune.pipeline.vocab_head import carry_layers, pack_targets, shard_head, sharded_lm_loss

__all__ = ["ModelBundle", "build_bundle", "rank_main", "simulated_step"]

HIDDEN = 16


@dataclass(kw_only=True)
class ModelBundle:
    layers: list[torch.nn.Module]
    inputs: list[torch.Tensor]
    targets: list[torch.Tensor]
    loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
    costs: LayerCosts | None
    """Per-unit costs (sleep models only): what the simulator is given."""


def _mse(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return ((out - target) ** 2).mean()


def sleep_costs(model: str, schedule: Schedule) -> LayerCosts:
    from steptune.pipeline.bench import BenchConfig, bench_model_costs

    layers, _, _ = bench_model_costs(
        BenchConfig(
            model=model,
            heterogeneous=True,
            num_devices=schedule.num_devices,
            num_microbatches=schedule.num_microbatches,
        )
    )
    return split_layer(layers, layers.num_layers - 1, int(schedule.meta.get("head_split", 1)))


def build_bundle(model: str, schedule: Schedule, *, seed: int = 0) -> ModelBundle:
    if schedule.partition is None:
        raise ValueError(
            "the schedule has no partition (layers per stage); tune one or add 'partition' to its JSON"
        )
    n_units = sum(schedule.partition)
    m = schedule.num_microbatches
    g = torch.Generator().manual_seed(seed)
    if model.startswith("sleep:"):
        costs = sleep_costs(model.split(":", 1)[1], schedule)
        if costs.num_layers != n_units:
            raise ValueError(
                f"{model} has {costs.num_layers} units (after the head split), the schedule's partition "
                f"covers {n_units}: tune the schedule for this model"
            )
        xs = [torch.randn(1, HIDDEN, generator=g) for _ in range(m)]
        ys = [torch.randn(1, HIDDEN, generator=g) for _ in range(m)]
        return ModelBundle(
            layers=list(sleep_layers(costs, hidden=HIDDEN)), inputs=xs, targets=ys, loss_fn=_mse, costs=costs
        )
    if model == "tiny-decoder":
        shards = int(schedule.meta.get("head_split", 1))  # the tuner's vocabulary shards of the head
        if n_units < 2 + shards:
            raise ValueError(
                f"tiny-decoder needs at least {2 + shards} units (embedding, a block, {shards} head unit(s))"
            )
        vocab, seq = 64, 8
        layers = tiny_decoder_layers(
            vocab=vocab, hidden=16, num_layers=n_units - 1 - shards, num_heads=2, seq_len=seq, seed=seed
        )
        xs = [torch.randint(0, vocab, (2, seq), generator=g) for _ in range(m)]
        ys = [torch.randint(0, vocab, (2, seq), generator=g) for _ in range(m)]
        if shards == 1:
            return ModelBundle(layers=list(layers), inputs=xs, targets=ys, loss_fn=lm_loss, costs=None)
        head = layers[-1]
        sharded = [*carry_layers(layers[0], layers[1:-1]), *shard_head(head.norm, head.out.weight, shards)]
        packed = [pack_targets(x, y) for x, y in zip(xs, ys, strict=True)]
        return ModelBundle(layers=sharded, inputs=packed, targets=ys, loss_fn=sharded_lm_loss, costs=None)
    raise ValueError(f"unknown model {model!r}; use sleep:PRESET (e.g. sleep:gemma-2b) or tiny-decoder")


def simulated_step(schedule: Schedule, costs: LayerCosts, *, latency: float, overhead: float) -> float:
    assert schedule.partition is not None
    link = LinkSpec(name="calibrated", bandwidth=1e12, latency=latency)
    return simulate(schedule, stage_costs(costs, schedule.partition, link=link, overhead=overhead)).makespan


def _barrier(group: Any) -> None:
    dist.all_reduce(torch.zeros(1), group=group)


def _calibrate(rank: int, group: Any, schedule: Schedule) -> tuple[float, float]:
    """(P2P latency, per-action overhead) measured on these ranks."""
    # Ping-pong between ranks 0 and 1 (one rank sends nothing: latency 0; a send to a rank outside the
    # group would block forever).
    buf = torch.zeros(1, HIDDEN)
    rounds = 20 if group.size() > 1 else 0
    _barrier(group)
    t0 = time.perf_counter()
    for k in range(rounds):
        if rank == 0:
            isend(buf, 1, group, tag=900_000 + k).wait()
            irecv(buf, 1, group, tag=910_000 + k).wait()
        elif rank == 1:
            irecv(buf, 0, group, tag=900_000 + k).wait()
            isend(buf, 0, group, tag=910_000 + k).wait()
    latency = torch.tensor([(time.perf_counter() - t0) / (2 * rounds) if rounds else 0.0])
    dist.broadcast(latency, 0, group=group)
    # The executor's own cost: the same schedule on zero-time sleep layers.
    n_units, m = sum(schedule.partition or ()), schedule.num_microbatches
    nothing = (0.0,) * n_units
    zero = LayerCosts(
        f=nothing, i=nothing, w=nothing, act_bytes=nothing, out_bytes=nothing, static_bytes=nothing
    )
    bundle = ModelBundle(
        layers=list(sleep_layers(zero, hidden=HIDDEN)),
        inputs=[torch.randn(1, HIDDEN) for _ in range(m)],
        targets=[torch.randn(1, HIDDEN) for _ in range(m)],
        loss_fn=_mse,
        costs=zero,
    )
    step = _our_engine(rank, group, schedule, bundle)
    step()  # warm-up
    times = [step() for _ in range(5)]
    # Zero-cost makespan = hops x latency + actions x overhead on the critical path; solve for overhead.
    sim_hops = simulated_step(schedule, zero, latency=float(latency), overhead=0.0)
    sim_unit = simulated_step(schedule, zero, latency=0.0, overhead=1.0)
    overhead = max(0.0, (statistics.median(times) - sim_hops) / sim_unit)
    return float(latency), overhead


def _our_engine(rank: int, group: Any, schedule: Schedule, bundle: ModelBundle) -> Callable[[], float]:
    """Build our executor once; the returned callable runs and times one step (barriers around it)."""
    assert schedule.partition is not None
    stages = split_layers(bundle.layers, schedule.partition)
    meta = boundary_shape(stages, bundle.inputs[0])
    mine = {s: stages[s] for s in schedule.stages_of(rank)}
    ex = PipelineExecutor(
        schedule,
        mine,
        rank=rank,
        group=group,
        boundary=meta,
        loss_fn=bundle.loss_fn,
        config=ExecutorConfig(timeout=120.0, publish="timeout"),  # no store call per action: it is timed
        store=default_store(),
        prefix="pp/run",
    )
    xs = bundle.inputs if 0 in mine else None
    ys = bundle.targets if schedule.num_stages - 1 in mine else None

    def step() -> float:
        _barrier(group)
        t0 = time.perf_counter()
        ex.step(xs, ys)
        _barrier(group)
        return time.perf_counter() - t0

    return step


def _our_step(rank: int, group: Any, schedule: Schedule, bundle: ModelBundle) -> float:
    return _our_engine(rank, group, schedule, bundle)()


def _torch_engine(rank: int, group: Any, schedule: Schedule, bundle: ModelBundle) -> Callable[[], float]:
    """Build torch's runtime on the same schedule once; the callable runs and times one step."""
    from torch.distributed.pipelining import PipelineStage

    from steptune.pipeline.torch_compat import load_into_torch_runtime

    assert schedule.partition is not None
    stages = split_layers(bundle.layers, schedule.partition)
    # No static input_args/output_args: example tensors that do not require grad make torch mark the
    # stage outputs as needing no gradient (it then backpropagates None). It infers shapes itself.
    pstages = [
        PipelineStage(stages[s], s, schedule.num_stages, torch.device("cpu"), group=group)
        for s in schedule.stages_of(rank)
    ]
    runtime = load_into_torch_runtime(
        schedule, stages=pstages, rank=rank, loss_fn=bundle.loss_fn, scale_grads=True
    )
    x = torch.cat(bundle.inputs) if 0 in schedule.stages_of(rank) else None
    if x is not None and x.is_floating_point():
        x.requires_grad_(True)  # the same work as our executor, which lets float stage-0 inputs need grad
    y = torch.cat(bundle.targets) if schedule.num_stages - 1 in schedule.stages_of(rank) else None

    def step() -> float:
        _barrier(group)
        t0 = time.perf_counter()
        if x is not None:
            runtime.step(x, target=y, losses=[])
        else:
            runtime.step(target=y, losses=[])
        _barrier(group)
        return time.perf_counter() - t0

    return step


def _grad_check(rank: int, group: Any, schedule: Schedule, model: str) -> float:
    """Max relative gradient difference vs a single-process reference, the max over ranks."""
    ref = build_bundle(model, schedule)
    full = torch.nn.Sequential(*ref.layers)
    for x, y in zip(ref.inputs, ref.targets, strict=True):
        (ref.loss_fn(full(x), y) / len(ref.inputs)).backward()
    run = build_bundle(model, schedule)
    _our_step(rank, group, schedule, run)
    assert schedule.partition is not None
    bounds = [0]
    for n in schedule.partition:
        bounds.append(bounds[-1] + n)
    worst = 0.0
    for s in schedule.stages_of(rank):
        for k in range(bounds[s], bounds[s + 1]):
            for a, b in zip(run.layers[k].parameters(), ref.layers[k].parameters(), strict=True):
                if b.grad is None:
                    continue
                assert a.grad is not None
                worst = max(
                    worst, ((a.grad - b.grad).abs().max() / b.grad.abs().max().clamp_min(1e-30)).item()
                )
    out = torch.tensor([worst])
    dist.all_reduce(out, op=dist.ReduceOp.MAX, group=group)
    return float(out)


def rank_main(
    rank: int,
    group: Any,
    schedule_json: dict[str, Any],
    model: str,
    repeats: int = 3,
    with_torch: bool = False,
    check: bool = False,
) -> dict[str, Any]:
    """One rank's part of ``steptune pipeline run``; every rank returns the same report."""
    torch.set_num_threads(1)
    schedule = Schedule.from_json(schedule_json)
    engines = {"ours": _our_engine(rank, group, schedule, build_bundle(model, schedule))}
    if with_torch:
        engines["torch"] = _torch_engine(rank, group, schedule, build_bundle(model, schedule))
    for step in engines.values():
        step()  # warm-up: torch infers shapes and builds buffers at its first step
    times: dict[str, list[float]] = {k: [] for k in engines}
    for _ in range(repeats):  # interleaved, so drift on a shared machine hits both alike
        for name, step in engines.items():
            times[name].append(step())
    ours, theirs = times["ours"], times.get("torch", [])
    report: dict[str, Any] = {
        "schedule": schedule.name,
        "model": model,
        "num_ranks": schedule.num_devices,
        "measured_step_s": statistics.median(ours),
        "measured_all_s": ours,
    }
    if with_torch:
        report["torch_runtime_step_s"] = statistics.median(theirs)
        report["torch_runtime_all_s"] = theirs
    bundle = build_bundle(model, schedule)
    if bundle.costs is not None:
        latency, overhead = _calibrate(rank, group, schedule)
        report.update(
            simulated_step_s=simulated_step(schedule, bundle.costs, latency=latency, overhead=overhead),
            simulated_uncalibrated_step_s=simulated_step(schedule, bundle.costs, latency=0.0, overhead=0.0),
            calibrated_latency_s=latency,
            calibrated_overhead_s=overhead,
        )
    if check:
        report["grad_max_rel_diff"] = _grad_check(rank, group, schedule, model)
    return report
