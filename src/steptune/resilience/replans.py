"""Whole-plan constructors: the initial plan, uneven TP shares over the live members, and one
bottleneck-optimal partition for every replica. Pure functions, like ``planners``."""

from __future__ import annotations

import math
from dataclasses import replace

from steptune.resilience.plan import (
    ClusterState,
    ExecutionPlan,
    StageMemory,
    _water_fill,
    group_speed,
    water_fill,
)
from steptune.resilience.planners import plan_pp

__all__ = ["initial_plan", "shares_only", "uniform_repartition"]


def shares_only(state: ClusterState, plan: ExecutionPlan) -> ExecutionPlan:
    """``plan`` with each TP group's dead members dropped and its units water-filled over the live ones
    by speed (steptune's uneven shares, ``water_fill``); partition and microbatches kept. A group with no
    live member stays as it is (only rerouting its work can run it). Same version if nothing changed."""
    groups, shares = [], []
    for g in plan.tp_groups:
        live = tuple(d for d in g if state.speeds[d] > 0)
        groups.append(live or g)
        shares.append(
            water_fill(live, state.speeds, state.num_heads)
            if live
            else _water_fill((1.0,) * len(g), state.num_heads)
        )
    out = replace(
        plan,
        tp_groups=tuple(groups),
        tp_shares=tuple(shares) if any(len(set(c)) > 1 for c in shares) else None,
    )
    return plan if out == plan else replace(out, version=plan.version + 1)


def uniform_repartition(state: ClusterState, plan: ExecutionPlan) -> ExecutionPlan | None:
    """``plan`` with one bottleneck-optimal layer partition for every replica, each stage position
    paced by its slowest replica's group (k x min speed); TP groups and microbatches kept. None if no
    partition fits in memory. (Greyhound's S3; a candidate of the simulator's oracle.)"""
    num_r, num_s = plan.num_replicas, plan.num_stages
    speeds = [min(group_speed(plan.group(r, s), state.speeds) for r in range(num_r)) for s in range(num_s)]
    mem = None
    if math.isfinite(state.memory_bytes):
        caps = tuple(
            min(len(plan.group(r, s)) for r in range(num_r)) * state.memory_bytes for s in range(num_s)
        )
        mem = StageMemory(layer_bytes=state.layer_bytes, capacity=caps)
    try:
        part = plan_pp(state.layer_costs, speeds, memory=mem, prefer=plan.layer_partition[0])
    except ValueError:
        return None
    return replace(plan, version=plan.version + 1, layer_partition=(part,) * num_r)


def initial_plan(
    state: ClusterState, *, tp: int, pp: int, dp: int, global_microbatches: int
) -> ExecutionPlan:
    """Version 0 on devices 0..tp*pp*dp-1 (replica-major, then stage, then TP rank), healthy speeds."""
    if tp * pp * dp > len(state.speeds):
        raise ValueError(f"tp*pp*dp = {tp * pp * dp} exceeds the {len(state.speeds)} devices")
    groups = tuple(tuple(range(i * tp, (i + 1) * tp)) for i in range(dp * pp))
    mem = None
    if math.isfinite(state.memory_bytes):
        mem = StageMemory(layer_bytes=state.layer_bytes, capacity=(tp * state.memory_bytes,) * pp)
    part = plan_pp(state.layer_costs, [float(tp)] * pp, memory=mem)
    q, rem = divmod(global_microbatches, dp)
    mb = tuple(q + (r < rem) for r in range(dp))
    plan = ExecutionPlan(version=0, tp_groups=groups, layer_partition=(part,) * dp, microbatches=mb)
    plan.validate(state.num_layers, global_microbatches)
    return plan
