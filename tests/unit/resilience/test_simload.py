"""Sequence-length variability in the cluster simulator (``simload``): SIMULATED."""

from __future__ import annotations

import numpy as np
import pytest

from steptune.resilience import sim
from steptune.resilience.oracle import Oracle
from steptune.resilience.policies import NoOp, ResiHPPolicy
from steptune.resilience.simload import BatchWorkload, replica_work, workload_factor


@pytest.fixture(scope="module")
def code() -> BatchWorkload:
    return BatchWorkload.for_job("llama2-7b", token_budget=16384, microbatches=32, lengths="code", seed=3)


def test_costs_are_relative_to_the_mean_and_the_same_for_every_caller(code: BatchWorkload) -> None:
    w = np.stack([code.costs(s) for s in range(200)])
    assert abs(w.mean() - 1.0) < 0.02
    cv = w.std(axis=1).mean()
    assert 0.2 < cv < 0.45, cv  # packed long-tailed lengths (the 128-GPU trace: 0.34 per microbatch)
    assert np.array_equal(code.costs(7), code.costs(7))
    assert not np.array_equal(code.costs(7), code.costs(8))
    assert np.array_equal(code.predicted(7, 0.0), code.costs(7))
    err = np.abs(np.log(code.predicted(7, 0.03) / code.costs(7)))
    assert 0.0 < err.mean() < 0.06


def test_count_deal_takes_batch_order_and_cost_assignment_balances(code: BatchWorkload) -> None:
    w = code.costs(0)
    x = replica_work((8, 8, 8, 8), w)
    assert x == pytest.approx([w[i * 8 : (i + 1) * 8].mean() for i in range(4)])
    by_count, by_cost = [], []
    for s in range(50):
        w = code.costs(s)
        by_count.append(max(replica_work((8,) * 4, w)) / w.mean())
        by_cost.append(max(replica_work((8,) * 4, w, w)) / w.mean())
    assert np.mean(by_cost) < 1.02 < np.mean(by_count)
    # Uneven counts: the split balances work per planned microbatch, so a replica planned for half
    # as many gets about half the work.
    x = replica_work((12, 12, 12, 4), w, w)
    assert max(x) / min(x) < 1.15


def test_equal_microbatches_keep_the_plan_counts_exactly() -> None:
    # The cost-aware split must not quietly fix the plan's counts (a DP rebalance the policy did not
    # pay for): with equal costs every replica gets exactly its count, however unequal the replicas.
    ones = np.ones(40)
    assert replica_work((13, 13, 13, 1), ones, ones) == pytest.approx([1.0] * 4)
    plan = sim.ExecutionPlan(
        version=0, tp_groups=((0,), (1,), (2,), (3,)), layer_partition=((4,),) * 4, microbatches=(10,) * 4
    )
    assert workload_factor(plan, (1.0, 0.9, 0.9, 0.9), np.ones(40), np.ones(40)) == pytest.approx(1.0)


def test_workload_factor_prices_the_busiest_replica_including_rerouted_ones(code: BatchWorkload) -> None:
    plan = sim.ExecutionPlan(
        version=0,
        tp_groups=((0,), (1,), (2,), (3,)),
        layer_partition=((4,),) * 4,
        microbatches=(8, 8, 8, 8),
    )
    w = code.costs(1)
    x = replica_work(plan.microbatches, w)
    assert workload_factor(plan, (1.0,) * 4, w) == pytest.approx(max(x))
    # A slow replica dominates: its own extra work matters, not the busiest fast one's.
    assert workload_factor(plan, (1.0, 1.0, 1.0, 2.0), w) == pytest.approx(max(max(x[:3]) / 2, x[3]))
    # A replica with a dead stage (rerouted) still carries its own microbatches, at the slowest priced
    # replica's time.
    assert workload_factor(plan, (1.0, 1.0, float("inf"), 1.0), w) == pytest.approx(max(x))
    assert workload_factor(plan, (float("inf"),) * 4, w) == 1.0


def _job() -> sim.SimJob:
    return sim.SimJob(
        model="llama2-7b", tp=2, pp=4, dp=4, global_microbatches=32, tokens_per_microbatch=16384
    )


def test_equal_microbatches_reproduce_the_plain_simulation() -> None:
    job = _job()
    fails = (sim.FailureEvent(kind="fail-slow", device=5, start_s=300.0, duration_s=900.0, factor=0.5),)
    flat = BatchWorkload.for_job("llama2-7b", token_budget=16384, microbatches=32, lengths="uniform")
    assert np.allclose(flat.costs(0), 1.0)
    for policy in (NoOp(), ResiHPPolicy()):
        plain = sim.run(job, policy, fails, 3600.0)
        varied = sim.run(job, policy, fails, 3600.0, workload=flat)
        assert varied.steps == plain.steps
        assert [t for _, t, _ in varied.timeline] == pytest.approx([t for _, t, _ in plain.timeline])


def test_cost_aware_assignment_beats_the_count_deal_on_a_healthy_job(code: BatchWorkload) -> None:
    job = _job()
    noop = sim.run(job, NoOp(), (), 3600.0, workload=code)
    resihp = sim.run(job, ResiHPPolicy(), (), 3600.0, workload=code)
    oracle = sim.run(job, Oracle(), (), 3600.0, workload=code)
    plain = sim.run(job, NoOp(), (), 3600.0)
    assert noop.tokens < plain.tokens  # the busiest replica paces each step
    assert resihp.tokens_per_s > 1.01 * noop.tokens_per_s
    assert oracle.tokens >= resihp.tokens


def test_step_time_of_and_workload_are_exclusive(code: BatchWorkload) -> None:
    with pytest.raises(ValueError, match="not both"):
        sim.run(_job(), NoOp(), (), 60.0, step_time_of=lambda s, p, v: 1.0, workload=code)


def test_simulate_cli_draws_lengths_only_when_asked(tmp_path) -> None:
    import json

    from steptune.cli import main

    out = {}
    for lengths in ("code", "mean"):
        path = tmp_path / f"{lengths}.json"
        argv = ["resilience", "simulate", "--scenario", "fail-slow-medium", "--policy", "noop"]
        argv += ["--model", "llama2-7b", "--duration", "600", "--lengths", lengths, "--json", str(path)]
        assert main(argv) == 0
        out[lengths] = json.loads(path.read_text())
    assert out["code"]["lengths"] == "code" and out["mean"]["lengths"] is None
    # dealt by count, the drawn batches leave one replica busier than the mean every step
    code, mean = (out[k]["policies"]["noop"]["tokens_per_s"] for k in ("code", "mean"))
    assert code < mean


def test_in_a_deep_pipeline_the_order_of_microbatches_matters_more_than_the_split() -> None:
    """Why ``simload`` stays out of the bench's figures: under the exact 1F1B schedule, balancing the
    replicas' totals does not shorten a 16-stage step; running the microbatches longest first does."""
    from steptune.pipeline.costs import StageCosts
    from steptune.pipeline.simulate import makespan

    wl = BatchWorkload.for_job("llama2-7b", token_budget=16384, microbatches=128)
    ns, m = 16, 32
    unit, zero = (1.0,) * ns, (0.0,) * ns
    costs = StageCosts(f=unit, i=(2.0,) * ns, w=zero, act_bytes=zero, out_bytes=zero, static_bytes=zero)
    base = makespan(sim.cached_one_f_one_b(ns, m), costs)

    def step(replicas: list[np.ndarray]) -> float:
        return (
            max(
                makespan(
                    sim.cached_one_f_one_b(ns, len(mb)),
                    costs,
                    durations=lambda a, mb=mb: mb[a.microbatch] * (1.0 if a.kind.value == "F" else 2.0),
                )
                for mb in replicas
            )
            / base
        )

    by_count, by_cost, longest_first = [], [], []
    for s in range(8):
        w = wl.costs(s)
        by_count.append(step([w[i * m : (i + 1) * m] for i in range(4)]))
        lists: list[list[int]] = [[] for _ in range(4)]
        loads = [0.0] * 4
        for i in np.argsort(-w, kind="stable"):
            r = min((q for q in range(4) if len(lists[q]) < m), key=lambda q: loads[q])
            loads[r] += w[i]
            lists[r].append(int(i))
        by_cost.append(step([w[sorted(x)] for x in lists]))
        longest_first.append(step([np.sort(w[x])[::-1] for x in lists]))
    assert np.mean(by_count) > 1.2  # bubbles from unequal microbatches in batch order
    assert abs(np.mean(by_cost) / np.mean(by_count) - 1) < 0.02  # balanced totals do not help
    assert np.mean(longest_first) < 1.1  # ordering does
