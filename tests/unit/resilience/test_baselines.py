"""Baseline policies: each does what its paper's mechanism does, never beats the oracle, and the
fail-stop and fail-slow systems are blind to what they were not built for."""

import functools
import math

import pytest

from steptune.resilience.baselines import (
    Adaptra,
    Greyhound,
    MalleusLite,
    Oobleck,
    ReCycle,
    Strengthened,
    baseline,
    oobleck_reinstantiate,
    oracle,
)
from steptune.resilience.plan import ClusterState
from steptune.resilience.policies import NoOp, ResiHPPolicy
from steptune.resilience.replans import initial_plan
from steptune.resilience.sim import FailureEvent, SimJob, SimResult, pipeline_time, rescheduled_time, run
from steptune.resilience.steptune_policy import SteptunePolicy

JOB = SimJob(model="llama2-7b", tp=2, pp=4, dp=4, global_microbatches=32, tokens_per_microbatch=4096)
DUR = 3600.0
STOP = (FailureEvent(kind="fail-stop", device=5, start_s=900.0),)
SLOW = (FailureEvent(kind="fail-slow", device=9, start_s=600.0, duration_s=2400.0, factor=0.5),)
MAKERS = {
    "recycle": ReCycle,
    "oobleck": Oobleck,
    "greyhound": Greyhound,
    "adaptra": Adaptra,
    "strengthened-recycle": lambda: Strengthened(ReCycle()),
    "strengthened-oobleck": lambda: Strengthened(Oobleck()),
    "malleus-lite": MalleusLite,
    "resihp": ResiHPPolicy,
    "steptune": SteptunePolicy,
    "noop": NoOp,
    "oracle": oracle,
}


@functools.cache
def _run(name: str, scenario: str) -> SimResult:
    return run(JOB, MAKERS[name](), STOP if scenario == "stop" else SLOW, DUR)


@pytest.mark.parametrize("scenario", ["stop", "slow"])
@pytest.mark.parametrize("name", sorted(set(MAKERS) - {"oracle"}))
def test_no_policy_beats_the_oracle(name: str, scenario: str) -> None:
    assert _run(name, scenario).tokens_per_s <= _run("oracle", scenario).tokens_per_s * (1 + 1e-9)


@pytest.mark.parametrize("name", ["recycle", "oobleck", "strengthened-recycle", "strengthened-oobleck"])
def test_fail_stop_systems_keep_training_after_a_death(name: str) -> None:
    r = _run(name, "stop")
    assert r.tokens_per_s > 1.5 * _run("noop", "stop").tokens_per_s
    assert r.lost_s < 60 and r.halted_s < 60  # no checkpoint rollback


@pytest.mark.parametrize("name", ["recycle", "oobleck"])
def test_fail_stop_systems_are_blind_to_fail_slow(name: str) -> None:
    assert _run(name, "slow").tokens_per_s == pytest.approx(_run("noop", "slow").tokens_per_s)


@pytest.mark.parametrize("name", ["greyhound", "strengthened-recycle", "malleus-lite", "resihp"])
def test_fail_slow_systems_recover_throughput(name: str) -> None:
    assert _run(name, "slow").tokens_per_s > 1.03 * _run("noop", "slow").tokens_per_s


@pytest.mark.parametrize("ours", ["resihp", "steptune"])
def test_ours_at_least_every_baseline_here(ours: str) -> None:
    for scenario in ("stop", "slow"):
        mine = _run(ours, scenario).tokens_per_s
        for name in set(MAKERS) - {"oracle", "resihp", "steptune"}:
            assert mine >= _run(name, scenario).tokens_per_s * (1 - 1e-9), (name, scenario)


def test_rescheduling_absorbs_a_slow_stage_and_never_hurts() -> None:
    even = (1.0,) * 4
    assert rescheduled_time(even, (2.0,) * 4, 8, 3) == pipeline_time(even, (2.0,) * 4, 8)  # nothing to absorb
    for slow in range(4):
        f = tuple(1.6 if s == slow else 1.0 for s in range(4))
        fb = tuple(2 * x for x in f)
        for m in (1, 4, 8, 16):
            assert rescheduled_time(f, fb, m, 3) <= pipeline_time(f, fb, m) * (1 + 1e-12)
            # deeper warm-ups only add options
            assert rescheduled_time(f, fb, m, 3) <= rescheduled_time(f, fb, m, 1) * (1 + 1e-12)
    # a slow second stage: running one microbatch deeper hides part of the warm-up's wait on it
    f, fb = (1.0, 1.6, 1.0, 1.0), (2.0, 3.2, 2.0, 2.0)
    assert rescheduled_time(f, fb, 4, 3) < pipeline_time(f, fb, 4) * 0.95


def test_oobleck_loses_the_whole_node() -> None:
    state = ClusterState(speeds=(1.0,) * 32, layer_costs=(1.0,) * 34, num_heads=32)
    plan = initial_plan(state, tp=2, pp=4, dp=4, global_microbatches=32)
    dead = frozenset({5})  # node 0 holds devices 0-7: replica 0 entirely
    new = oobleck_reinstantiate(plan, state, dead, gpus_per_node=8)
    assert new is not None
    used = {d for g in new.tp_groups for d in g}
    assert not used & set(range(8)) and new.num_replicas == 3 and sum(new.microbatches) == 32


def test_oobleck_reinstantiates_a_smaller_template() -> None:
    # 4 devices per node, TP 2 x PP 4 = 8 devices per replica: a lost node leaves 4, a TP-1 template.
    state = ClusterState(speeds=(1.0,) * 32, layer_costs=(1.0,) * 34, num_heads=32)
    plan = initial_plan(state, tp=2, pp=4, dp=4, global_microbatches=32)
    new = oobleck_reinstantiate(plan, state, frozenset({2}), gpus_per_node=4)
    assert new is not None and new.num_replicas == 4
    assert [len(new.group(0, s)) for s in range(4)] == [1, 1, 1, 1]
    assert new.microbatches[0] < new.microbatches[1]  # the half-speed pipeline gets less work


def test_recycle_reroutes_only_after_detection_and_restarts_without_peers() -> None:
    r = _run("recycle", "stop")
    assert any("stall 5.0" in line for line in r.log)  # one safe point for the new schedule
    # Every DP peer of stage 0 dead: nothing to reroute to, and no whole replica to restart on.
    allstage0 = tuple(FailureEvent(kind="fail-stop", device=d, start_s=900.0) for d in (0, 8, 16, 24))
    res = run(JOB, ReCycle(), allstage0, DUR)
    assert res.halted_s > DUR - 900.0 - 60
    # Stage 0 of replicas 0 and 1 and stage 1 of replica 2 dead: each stage keeps a peer.
    mixed = tuple(FailureEvent(kind="fail-stop", device=d, start_s=900.0) for d in (0, 8, 18))
    res = run(JOB, ReCycle(), mixed, DUR)
    assert res.stall_s < JOB.restart_cost_s + 10  # rerouting suffices: every stage has a peer


def test_greyhound_does_not_see_small_step_changes() -> None:
    weak = (FailureEvent(kind="fail-slow", device=9, start_s=600.0, factor=0.95),)
    g = run(JOB, Greyhound(), weak, DUR)
    assert g.tokens_per_s == pytest.approx(run(JOB, NoOp(), weak, DUR).tokens_per_s)


def test_baseline_factory() -> None:
    assert baseline("recycle").name == "recycle"
    with pytest.raises(ValueError, match="unknown baseline"):
        baseline("bamboo")
    with pytest.raises(ValueError, match="absorb"):
        ReCycle(absorb=1.5)
    assert math.isinf(Oobleck().detect_slow_steps)
