"""Pieces of the live pipelined job and the planner/simulator options it uses (no processes)."""

import math

import pytest
from hypothesis import given
from hypothesis import strategies as st

from steptune.core.specs import cluster_preset, model_preset
from steptune.resilience.livesim import sim_job_for
from steptune.resilience.pipelined import _moves, one_f_one_b_order, parse_layout
from steptune.resilience.plan import ClusterState, ReconfigCosts
from steptune.resilience.progressive import progressive_replan
from steptune.resilience.replans import initial_plan
from steptune.resilience.sim import SimJob, layer_phase_times
from steptune.resilience.steptime import estimate_step_time
from steptune.resilience.workload import StageModel


@given(st.integers(1, 6), st.integers(0, 12))
def test_one_f_one_b_order(num_stages, m):
    for stage in range(num_stages):
        order = one_f_one_b_order(stage, num_stages, m)
        assert sorted(order) == sorted([("F", k) for k in range(m)] + [("B", k) for k in range(m)])
        for k in range(m):
            assert order.index(("F", k)) < order.index(("B", k))
        live = (
            max(sum(1 if x == "F" else -1 for x, _ in order[: i + 1]) for i in range(len(order))) if m else 0
        )
        assert live == min(num_stages - stage, m)  # 1F1B: at most pp - stage activations held


def test_parse_layout():
    assert parse_layout("dp=2,pp=2") == (2, 2, 1)
    assert parse_layout("dp=4") == (4, 1, 1)
    assert parse_layout("dp=2,tp=2") == (2, 1, 2)
    for bad in ("dp=2,tp=2,pp=2", "dp=1,tp=3", "dp=0", "zz=1", "dp=two"):
        with pytest.raises(ValueError, match="layout"):
            parse_layout(bad)


def _state(speeds):
    layers = model_preset("llama3.1-8b").layers
    costs = [max(sum(StageModel(layers=(x,), device=cluster_preset("dgx-h100").device).time([4000] * 8, p)
                     for p in "FBW"), 1e-9) for x in layers]  # fmt: skip
    return ClusterState(speeds=speeds, layer_costs=costs, num_heads=1)


def test_per_replica_partitions_beat_a_shared_one_for_one_slow_stage():
    healthy = _state((1.0,) * 4)
    plan = initial_plan(healthy, tp=1, pp=2, dp=2, global_microbatches=16)
    slow = _state((1.0, 1 / 1.6, 1.0, 1.0))
    kw = {"expected_fault_duration_s": math.inf, "reconfig_costs": ReconfigCosts(tp_s=1.0, pp_s=5.0)}
    shared, _ = progressive_replan(slow, plan, **kw)
    own, log = progressive_replan(slow, plan, per_replica_partitions=True, **kw)
    assert len(set(shared.layer_partition)) == 1
    assert own.layer_partition[0][0] > own.layer_partition[0][1]  # the slow stage gives layers away
    assert own.layer_partition[1] == plan.layer_partition[1]  # the healthy replica keeps its split
    t_shared, t_own = estimate_step_time(slow, shared), estimate_step_time(slow, own)
    assert t_own < 0.97 * t_shared, log
    moves = _moves(plan, own, pp=2)
    first = sum(plan.layer_partition[0][:1])
    assert moves and all(src == 1 and dst == 0 and i >= first for i, src, dst in moves)
    assert len(moves) == own.layer_partition[0][0] - plan.layer_partition[0][0]


def test_sim_job_packed_microbatch_matches_the_stage_model():
    lengths = [3000, 500, 12000, 800]
    q = float(sum(x * x for x in lengths))
    job = SimJob(model="llama3.1-8b", cluster="dgx-h100", tp=1, pp=1, dp=1, global_microbatches=1,
                 tokens_per_microbatch=sum(lengths), microbatch_sq_tokens=q)  # fmt: skip
    f, b, w = layer_phase_times(job)
    stage = StageModel(layers=model_preset("llama3.1-8b").layers, device=cluster_preset("dgx-h100").device)
    assert sum(f) == pytest.approx(stage.time(lengths, "F"), rel=1e-6)
    assert sum(b) + sum(w) == pytest.approx(stage.time(lengths, "B") + stage.time(lengths, "W"), rel=1e-6)
    single = SimJob(model="llama3.1-8b", cluster="dgx-h100", tokens_per_microbatch=sum(lengths))
    assert sum(layer_phase_times(single)[0]) > sum(f)  # one long sequence pays more attention


def test_sim_job_for_a_live_spec():
    job = sim_job_for({"dp": 2, "pp": 2, "steps": 3, "seed": 0}, ranks=4, overhead_s=1.5)
    assert (job.tp, job.pp, job.dp, job.global_microbatches) == (1, 2, 2, 16)
    assert 10_000 < job.tokens_per_microbatch <= 32768 and job.step_overhead_s == 1.5
    assert job.microbatch_sq_tokens < job.tokens_per_microbatch**2  # packed, not one sequence
    assert sim_job_for({"steps": 3}, ranks=4).dp == 4


def _move_rank(rank, group):
    import torch

    from steptune.resilience.pipelined import _layers, _Stage, owned_layers
    from steptune.resilience.plan import ExecutionPlan

    layers = _layers(0, 4)  # 6 modules, identical on every rank
    opt = torch.optim.SGD([p for m in layers for p in m.parameters()], lr=0.1, momentum=0.9)
    me = _Stage(rank, group, layers, opt)
    old = ExecutionPlan(
        version=0, tp_groups=((0,), (1,), (2,)), layer_partition=((2, 2, 2),), microbatches=(1,)
    )
    new = ExecutionPlan(
        version=1, tp_groups=((0,), (1,), (2,)), layer_partition=((3, 2, 1),), microbatches=(1,)
    )
    me.owned = owned_layers(old.layer_partition[0], rank)
    for i in range(6):
        for p in layers[i].parameters():
            if i in me.owned:  # a value only the owner has: its rank and layer
                with torch.no_grad():
                    p.fill_(100 * rank + i)
                opt.state[p] = {"momentum_buffer": torch.full_like(p, -(100 * rank + i))}
            else:
                me.poison(i)
    moves = _moves(old, new, pp=3)
    me.move(moves)  # rank 1 gives layer 2 to rank 0 and takes layer 4 from rank 2
    me.owned = owned_layers(new.layer_partition[0], rank)
    out = {}
    for i in range(6):
        p = next(layers[i].parameters())
        buf = opt.state.get(p, {}).get("momentum_buffer")
        out[i] = (float(p.detach().flatten()[0]), None if buf is None else float(buf.flatten()[0]))
    return moves, list(me.owned), out


def test_layer_moves_both_ways_carry_params_and_momentum():
    from steptune.testing import run_threads

    results = run_threads(_move_rank, 3, timeout=30)
    moves = results[0][0]
    assert moves == [(2, 1, 0), (4, 2, 1)]
    for rank, (_, owned, values) in enumerate(results):
        for i in range(6):
            value, momentum = values[i]
            if i in owned:
                src = {2: 1, 4: 2}.get(i, rank)  # where the layer lived before
                assert (value, momentum) == (100 * src + i, -(100 * src + i)), (rank, i)
            else:
                assert math.isnan(value) and momentum is None, (rank, i)
