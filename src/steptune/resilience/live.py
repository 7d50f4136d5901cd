"""A small real training job under ``Runtime``: real decoder, real gloo all-reduce, emulated device time.

``live_rank(rank, group, spec)`` is the per-rank body (spawned ranks; explicit ``group``). Each step packs
the same global batch of long-tailed sequences on every rank (``LENGTH_PRESETS``), runs this rank's share
through a tiny decoder (a proxy of each sequence, at most 16 tokens: the timing comes from the emulated cost
of an 8B model on H100), sums the token losses, all-reduces the gradients (SUM, divided by the global token
count, so the update does not depend on which rank ran which microbatch) and steps SGD.
``compare(spec)`` runs the same seeds healthy, with the fault unmitigated, and with the fault under ResiHP.
"""

from __future__ import annotations

import contextlib
import statistics
import time
from collections.abc import Callable, Container, Sequence
from contextlib import AbstractContextManager
from typing import Any

import numpy as np
import torch
from torch import nn

from steptune.core.dist import allreduce_grads
from steptune.resilience.runtime import LinkFault, Runtime, RuntimeConfig, SlowFault, StepReport
from steptune.resilience.workload import LENGTH_PRESETS, StageModel, pack

__all__ = [
    "allreduce_seconds",
    "compare",
    "global_batch",
    "link_bandwidth",
    "live_rank",
    "microbatch_loss",
    "proxy_model",
    "reference_losses",
    "report_row",
    "run_each",
    "run_live",
    "run_spawned",
    "stage_model",
    "stage_sync_seconds",
    "sum_and_step",
    "summarize",
]

PROXY_MAX = 16


def stage_model(model: str = "llama3.1-8b", cluster: str = "dgx-h100") -> StageModel:
    from steptune.core.specs import cluster_preset, model_preset

    return StageModel(layers=model_preset(model).layers, device=cluster_preset(cluster).device)


def link_bandwidth(cluster: str, ranks: int, ranks_per_node: int | None = None) -> float:
    """Bytes/s of the link ``ranks`` devices of ``cluster`` share: the node's, or the network's when they
    span nodes (``ranks_per_node``: how many share a node; default as many as fit)."""
    from steptune.core.specs import cluster_preset

    c = cluster_preset(cluster)
    per_node = min(ranks_per_node or c.gpus_per_node, c.gpus_per_node)
    return (c.intra if ranks <= per_node else c.inter).bandwidth


def allreduce_seconds(spec: dict[str, Any], ranks: int) -> float:
    """Ring all-reduce of the emulated model's bf16 gradients over the job's link: 2 (n-1)/n bytes / bw."""
    if ranks < 2:
        return 0.0
    full = stage_model(spec.get("model", "llama3.1-8b"), spec.get("cluster", "dgx-h100"))
    nbytes = 2.0 * sum(x.params for x in full.layers)
    bw = link_bandwidth(spec.get("cluster", "dgx-h100"), ranks, spec.get("ranks_per_node"))
    return 2.0 * (ranks - 1) / ranks * nbytes / bw


def stage_sync_seconds(spec: dict[str, Any], layers: Sequence[int], dp: int, ranks: int) -> float:
    """Ring all-reduce among a pipeline stage's ``dp`` replicas of the bf16 gradients of ``layers``
    (indices into the emulated model's layers) over the job's link (``ranks`` in the job)."""
    if dp < 2:
        return 0.0
    full = stage_model(spec.get("model", "llama3.1-8b"), spec.get("cluster", "dgx-h100"))
    nbytes = 2.0 * sum(full.layers[i].params for i in layers)
    bw = link_bandwidth(spec.get("cluster", "dgx-h100"), ranks, spec.get("ranks_per_node"))
    return 2.0 * (dp - 1) / dp * nbytes / bw


def run_spawned(fn: Any, spec: dict[str, Any], ranks: int, pool: Any = None) -> dict[str, Any]:
    """Rank 0's result of ``fn(rank, group, spec)`` on ``ranks`` spawned processes (``pool``: reuse one)."""
    from steptune.testing.spawn import SpawnPool

    if pool is not None:
        return pool.run(fn, spec)[0]  # type: ignore[no-any-return]
    with SpawnPool(ranks, timeout=600) as own:
        return own.run(fn, spec)[0]  # type: ignore[no-any-return]


def global_batch(
    seed: int, step: int, spec: dict[str, Any] | None = None
) -> tuple[list[list[int]], list[Any]]:
    """The step's packed sequence lengths and their token proxies (identical on every rank)."""
    spec = spec or {}
    rng = np.random.default_rng((seed, step))
    mbs = pack(rng, LENGTH_PRESETS[spec.get("lengths", "code")], int(spec.get("token_budget", 32768)),
               int(spec.get("microbatches", 16)))  # fmt: skip
    tokens = [torch.randint(0, 64, (1, min(PROXY_MAX, max(1, sum(mb) // 2048)) + 1),
                            generator=torch.Generator().manual_seed(seed * 100003 + step * 1000 + i))
              for i, mb in enumerate(mbs)]  # fmt: skip
    return mbs, tokens


def proxy_model(seed: int) -> nn.Module:
    from steptune.pipeline.stages import tiny_decoder_layers

    return nn.Sequential(
        *tiny_decoder_layers(vocab=64, hidden=32, num_layers=2, seq_len=PROXY_MAX, seed=seed)
    )


def microbatch_loss(model: nn.Module, x: torch.Tensor, total_tokens: int) -> torch.Tensor:
    """The microbatch's token-weighted share of the global mean loss (the update ignores who ran it)."""
    from steptune.pipeline.stages import lm_loss

    return lm_loss(model(x[:, :-1]), x[:, 1:]) * (x.shape[1] - 1) / total_tokens


def sum_and_step(
    params: Sequence[nn.Parameter],
    opt: Any,
    group: Any,
    loss_sum: torch.Tensor,
    owned: Container[int] | None = None,
    timed: AbstractContextManager[None] | None = None,
) -> float:
    """All-reduce (SUM) the gradients and the loss on ``group``, then step; returns the global loss.

    With ``owned`` (indices into ``params``), only those contribute and receive the sum; the others add
    zeros and keep no gradient, so ranks holding different layers (pipeline stages) sync layer-wise.
    """
    with timed or contextlib.nullcontext():  # ``timed``: e.g. ``Runtime.comm_timed`` around the collective
        allreduce_grads(params, group, owned)
        group.allreduce([loss_sum]).wait()
    opt.step()
    opt.zero_grad()
    return float(loss_sum)


def live_rank(rank: int, group: Any, spec: dict[str, Any]) -> dict[str, Any]:
    steps, seed = int(spec.get("steps", 60)), int(spec.get("seed", 0))
    faults = [SlowFault(**f) for f in spec.get("faults", [])]
    link_faults = [LinkFault(**f) for f in spec.get("link_faults", [])]
    cfg = RuntimeConfig(
        adapt=bool(spec.get("adapt", True)), time_scale=float(spec.get("time_scale", 0.02)), seed=seed
    )
    stage = stage_model(spec.get("model", "llama3.1-8b"), spec.get("cluster", "dgx-h100"))
    rt = Runtime(group, stage, cfg, faults=faults, link_faults=link_faults)
    sync_s = allreduce_seconds(spec, group.size())
    model = proxy_model(seed)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    losses = []
    for step in range(steps):
        mbs, tokens = global_batch(seed, step, spec)
        total = sum(t.shape[1] - 1 for t in tokens)
        loss_sum = torch.zeros(())
        for i in rt.assign(mbs):
            with rt.timed(mbs[i]):
                loss = microbatch_loss(model, tokens[i], total)
                loss.backward()
                loss_sum += loss.detach()
        group.barrier().wait()  # outside the timed block: waiting for a slow rank is not link time
        sync = rt.comm_timed(sync_s)  # the 8B model's gradient all-reduce, emulated over the link
        losses.append(sum_and_step(list(model.parameters()), opt, group, loss_sum, timed=sync))
        rt.end_step()
    return {
        "rank": rank,
        "losses": losses,
        "reports": [report_row(r) for r in rt.reports],
    }


def reference_losses(spec: dict[str, Any], model: nn.Module, forward: Any = None) -> list[float]:
    """The live jobs' training in one process (no DP, PP or TP): SGD, lr 0.05, momentum 0.9, the same
    global batches and token weighting. ``forward(model, x)`` gives logits (default ``model(x)``). Every
    layout's losses must reproduce these."""
    from steptune.pipeline.stages import lm_loss

    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    out = []
    for step in range(int(spec["steps"])):
        _, tokens = global_batch(int(spec["seed"]), step, spec)
        total = sum(t.shape[1] - 1 for t in tokens)
        loss_sum = 0.0
        for t in tokens:
            logits = forward(model, t[:, :-1]) if forward else model(t[:, :-1])
            loss = lm_loss(logits, t[:, 1:]) * (t.shape[1] - 1) / total
            loss.backward()
            loss_sum += float(loss.detach())
        opt.step()
        opt.zero_grad()
        out.append(loss_sum)
    return out


def report_row(r: StepReport) -> dict[str, Any]:
    """A step report as the live jobs' JSON rows carry it (compute alarms, link alarms, timings)."""
    return {
        "step": r.step,
        "wall_s": r.wall_s,
        "tokens": r.tokens,
        "alarms": [(a.unit, round(a.slowdown, 3)) for a in r.alarms if a.kind != "fail-slow-link"],
        "link_alarms": [
            {"rank": a.unit, "link": a.link, "slowdown": round(a.slowdown, 3)}
            for a in r.alarms
            if a.kind == "fail-slow-link"
        ],
        "comm_s": list(r.comm_s),
        "threshold_alarm": r.threshold_alarm,
        "speeds": list(r.speeds),
        "rank_compute_s": list(r.rank_compute_s),
    }


def run_live(spec: dict[str, Any], ranks: int = 4, pool: Any = None) -> dict[str, Any]:
    """One run on ``ranks`` spawned processes (``pool``: reuse a ``SpawnPool``'s ranks)."""
    return run_spawned(live_rank, spec, ranks, pool)


def _throughput(reports: list[dict[str, Any]], first: int) -> float:
    rows = [r for r in reports if r["step"] >= first]
    return sum(r["tokens"] for r in rows) / sum(r["wall_s"] for r in rows)


def _link_delay(spec: dict[str, Any], reports: list[dict[str, Any]]) -> int | None:
    starts = [int(f["start"]) for f in spec.get("link_faults", [])]
    found = [r["step"] for r in reports if r.get("link_alarms")]
    return found[0] - min(starts) if starts and found else None


def summarize(spec: dict[str, Any], ranks: int, runs: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """The issue's fields from the healthy, unmitigated and adapted runs of one comparison."""
    healthy, adapted = runs["healthy"], runs["adapted"]
    fault = spec["faults"][0] if spec.get("faults") else None
    start = fault["start"] if fault else 0
    detections = [r["step"] for r in adapted["reports"] if r["alarms"]]
    delay = detections[0] - start if detections else None
    window = (detections[0] + 1) if detections else start
    skip = 5  # warm-up steps excluded from healthy figures
    steps = len(healthy["reports"])
    if max(window, skip) >= steps:
        found = f"detected after step {detections[0]}" if detections else "not detected"
        raise ValueError(
            f"the comparison measures throughput from step {max(window, skip)} (fault {found}), but the runs "
            f"have {steps} steps: use more --steps (the predictor warms up for the first steps; 80 with a "
            "fault at step 20 is the documented setting)"
        )
    return {
        "ranks": ranks,
        "spec": spec,
        "false_alarms": sum(len(r["alarms"]) + len(r.get("link_alarms", [])) for r in healthy["reports"]),
        "link_alarms": [
            {**a, "step": r["step"]} for r in adapted["reports"] for a in r.get("link_alarms", [])
        ],
        "link_detection_delay_steps": _link_delay(spec, adapted["reports"]),
        "fixed_threshold_false_alarms": sum(r["threshold_alarm"] for r in healthy["reports"]),
        "detection_delay_steps": delay,
        "detected_rank": adapted["reports"][detections[0]]["alarms"][0][0] if detections else None,
        "estimated_slowdown": adapted["reports"][detections[0]]["alarms"][0][1] if detections else None,
        "throughput_window_from_step": max(window, skip),  # the first step the throughputs count
        "throughput_tokens_per_s": {
            name: _throughput(run["reports"], max(window, skip)) for name, run in runs.items()
        },
        "healthy_step_cv": statistics.pstdev(r["wall_s"] for r in healthy["reports"][skip:])
        / statistics.mean(r["wall_s"] for r in healthy["reports"][skip:]),
        "losses": {"healthy": healthy["losses"], "adapted": adapted["losses"]},
        "runs": {name: run["reports"] for name, run in runs.items()},
    }


def run_each(
    jobs: dict[str, Callable[[], dict[str, Any]]], progress: Callable[[str], None] | None = None
) -> dict[str, dict[str, Any]]:
    """Run ``jobs`` in order; ``progress`` (e.g. a print to stderr) hears when each starts and ends, so a
    comparison of several minutes is not silent."""
    runs: dict[str, dict[str, Any]] = {}
    for i, (name, job) in enumerate(jobs.items(), 1):
        if progress is not None:
            progress(f"run {i}/{len(jobs)} ({name}) ...")
        t0 = time.perf_counter()
        runs[name] = job()
        if progress is not None:
            progress(f"run {i}/{len(jobs)} ({name}) done in {time.perf_counter() - t0:.0f} s")
    return runs


def compare(
    spec: dict[str, Any], ranks: int = 4, progress: Callable[[str], None] | None = None
) -> dict[str, Any]:
    """Healthy, unmitigated and adapted runs of the same seeds; the issue's JSON fields."""
    from steptune.testing.spawn import SpawnPool

    with SpawnPool(ranks, timeout=600) as pool:  # one spawn for the three runs
        jobs = {
            "healthy": lambda: run_live({**spec, "faults": [], "link_faults": []}, ranks, pool),
            "unmitigated": lambda: run_live({**spec, "adapt": False}, ranks, pool),
            "adapted": lambda: run_live({**spec, "adapt": True}, ranks, pool),
        }
        runs = run_each(jobs, progress)
    return summarize(spec, ranks, runs)
