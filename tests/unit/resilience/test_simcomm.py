"""The simulator's communication model: the alpha-beta formulas, the healthy step against the pipeline
simulator with communication in the stage times, and link fail-slows."""

import functools
from dataclasses import replace

import pytest

from steptune.core.specs import LinkSpec, model_preset
from steptune.pipeline.anchors import one_f_one_b
from steptune.pipeline.costs import StageCosts
from steptune.pipeline.schedule import ActionKind
from steptune.pipeline.simulate import simulate
from steptune.resilience.baselines import Adaptra, Greyhound, ReCycle, Strengthened, oracle
from steptune.resilience.plan import ClusterState
from steptune.resilience.policies import NoOp, ResiHPPolicy
from steptune.resilience.replans import initial_plan
from steptune.resilience.sim import FailureEvent, SimJob, SimResult, layer_phase_times, run
from steptune.resilience.simcomm import CommModel, comm_model, effective_speeds
from steptune.resilience.steptune_policy import SteptunePolicy

NV = LinkSpec(name="nv", bandwidth=100.0, latency=0.5)
IB = LinkSpec(name="ib", bandwidth=10.0, latency=2.0)
TOY = CommModel(
    num_devices=8,
    gpus_per_node=4,
    intra=NV,
    inter=IB,
    act_bytes=(100.0, 200.0, 200.0, 0.0),
    tp_calls=(0, 2, 2, 0),
    grad_bytes=(40.0, 80.0, 80.0, 20.0),
)


def test_tp_all_reduce_is_a_ring_on_the_groups_link() -> None:
    ones = (1.0,) * 8
    # Two decoder layers, 2 all-reduces each of 200 bytes, ring over 2 devices in one node.
    assert TOY.tp_s((0, 1), 1, 2, ones) == pytest.approx(2 * 1 / 2 * 800 / 100 + 2 * 1 * 4 * 0.5)
    assert TOY.tp_s((0,), 1, 2, ones) == 0.0  # no TP
    assert TOY.tp_s((3, 4), 1, 1, ones) == pytest.approx(400 / 10 + 2 * 2 * 2.0)  # across nodes: IB
    slow = (1.0,) * 8 + (1.0, 0.25) + (1.0,) * 6  # device 1's links at a quarter
    assert TOY.tp_s((0, 1), 1, 2, slow) == pytest.approx(800 / 25 + 2 * 1 * 4 * 0.5)


def test_p2p_splits_over_the_larger_group_and_runs_at_the_slowest_link() -> None:
    ones = (1.0,) * 8
    assert TOY.p2p_s((0, 1), (2,), 0, ones) == pytest.approx(0.5 + 100 / 2 / 100)
    assert TOY.p2p_s((2, 3), (4, 5), 1, ones) == pytest.approx(2.0 + 200 / 2 / 10)
    slow = (1.0,) * 8 + (1.0,) * 5 + (0.5, 1.0, 1.0)
    assert TOY.p2p_s((2, 3), (4, 5), 1, slow) == pytest.approx(2.0 + 200 / 2 / 5)
    f, b = TOY.stage_extra(((0, 1), (2, 3)), (2, 2), ones)
    assert f == pytest.approx(
        (
            TOY.tp_s((0, 1), 0, 2, ones) + TOY.p2p_s((0, 1), (2, 3), 1, ones),
            0.0 + TOY.tp_s((2, 3), 2, 2, ones),
        )
    )
    assert b == pytest.approx(
        (f[0] - TOY.p2p_s((0, 1), (2, 3), 1, ones), f[1] + TOY.p2p_s((2, 3), (0, 1), 1, ones))
    )


def test_dp_sync_is_a_ring_per_stage_position() -> None:
    ones = (1.0,) * 8
    groups = ((0, 1), (2, 3), (4, 5), (6, 7))  # 2 replicas x 2 stages, replicas on different nodes
    parts = ((2, 2), (2, 2))
    # Stage 0 holds 120 bytes of gradients, stage 1 100; each device reduces half its stage's.
    assert TOY.dp_sync_s(groups, parts, ones) == pytest.approx(2 * 1 / 2 * 60 / 10 + 2 * 1 * 2.0)
    assert TOY.dp_sync_s(groups[:2], parts[:1], ones) == 0.0  # one replica: nothing to sync
    slow = (1.0,) * 8 + (1.0,) * 6 + (0.1, 1.0)  # device 6 (stage 1 of replica 1)
    assert TOY.dp_sync_s(groups, parts, slow) == pytest.approx(50 / 1.0 + 4.0)


def test_effective_speeds_fold_a_slow_link_into_the_device() -> None:
    assert effective_speeds((0.5, 1.0), 2, 0.2) == (0.5, 1.0)  # no link entries
    v = effective_speeds((0.5, 1.0, 0.0, 1.0, 1.0, 1.0, 1.0, 0.25), 4, 0.2)
    assert v == pytest.approx((0.5, 1.0, 0.0, 1 / (0.8 + 0.2 / 0.25)))


JOB = SimJob(
    model="llama2-7b", tp=2, pp=4, dp=4, global_microbatches=32, tokens_per_microbatch=4096, comm=True
)


def test_healthy_step_with_comm_matches_the_pipeline_simulator() -> None:
    r = run(JOB, NoOp(), (), 60.0)
    free = run(replace(JOB, comm=False), NoOp(), (), 60.0)
    (plan,) = {v for _, _, v in r.timeline}
    assert plan == 0
    cm = comm_model(JOB.model, JOB.cluster, JOB.tokens_per_microbatch, JOB.num_devices)
    f, b, w = layer_phase_times(JOB)
    # The first plan of the free-comm run is the same (the planner does not see communication).
    costs = [max(x, 1e-9) + max(y + z, 1e-9) for x, y, z in zip(f, b, w, strict=True)]
    state = ClusterState(
        speeds=(1.0,) * 32,
        layer_costs=costs,
        num_heads=32,
        layer_bytes=[x.params * 16.0 for x in model_preset("llama2-7b").layers],
        memory_bytes=80e9,
    )
    base = initial_plan(state, tp=2, pp=4, dp=4, global_microbatches=32)
    part, groups = base.layer_partition[0], base.tp_groups[:4]
    ones = (1.0,) * 64
    ef, eb = cm.stage_extra(groups, part, ones)
    bounds = [sum(part[:s]) for s in range(5)]
    f_s = [sum(max(x, 1e-9) for x in f[bounds[s] : bounds[s + 1]]) / 2 + ef[s] for s in range(4)]
    b_s = [
        sum(
            max(y + z, 1e-9)
            for y, z in zip(b[bounds[s] : bounds[s + 1]], w[bounds[s] : bounds[s + 1]], strict=True)
        )
        / 2
        + eb[s]
        for s in range(4)
    ]
    expected = simulate(
        one_f_one_b(4, 8),
        StageCosts.uniform(4),
        with_spans=False,
        durations=lambda a: f_s[a.stage] if a.kind is ActionKind.F else b_s[a.stage],
    ).makespan + cm.dp_sync_s(base.tp_groups, base.layer_partition, ones)
    assert all(st == pytest.approx(expected, rel=1e-9) for _, st, _ in r.timeline)
    # Communication costs something, but a few percent: compute dominates at 4K tokens.
    assert 1.0 < r.timeline[0][1] / free.timeline[0][1] < 1.2


def _links(factor: float, devices: range) -> tuple[FailureEvent, ...]:
    return tuple(
        FailureEvent(kind="fail-slow", device=d, start_s=600.0, factor=factor, target="link") for d in devices
    )


def test_slow_links_slow_the_step_monotonically() -> None:
    healthy = run(JOB, NoOp(), (), 1800.0).tokens_per_s
    rates = [run(JOB, NoOp(), _links(x, range(8)), 1800.0).tokens_per_s for x in (0.9, 0.5, 0.1)]
    assert healthy > rates[0] > rates[1] > rates[2] > 0  # every link of replica 0


def test_link_fail_slows_need_the_comm_model() -> None:
    with pytest.raises(ValueError, match="comm=True"):
        run(replace(JOB, comm=False), NoOp(), _links(0.5, range(1)), 60.0)
    with pytest.raises(ValueError, match="target"):
        FailureEvent(kind="fail-stop", device=0, start_s=1.0, target="link")
    with pytest.raises(ValueError, match="target"):
        FailureEvent(kind="fail-slow", device=0, start_s=1.0, factor=0.5, target="nic")


# One replica's links at 0.1 for 40 minutes, and a compute fail-slow elsewhere.
SCEN = (
    *(
        FailureEvent(kind="fail-slow", device=d, start_s=300.0, duration_s=2400.0, factor=0.1, target="link")
        for d in range(8, 10)
    ),
    FailureEvent(kind="fail-slow", device=20, start_s=900.0, duration_s=1200.0, factor=0.5),
)
MAKERS = {
    "noop": NoOp,
    "resihp": ResiHPPolicy,
    "steptune": SteptunePolicy,
    "greyhound": Greyhound,
    "adaptra": Adaptra,
    "strengthened-recycle": lambda: Strengthened(ReCycle()),
    "oracle": oracle,
}


@functools.cache
def _run(name: str) -> SimResult:
    return run(JOB, MAKERS[name](), SCEN, 3600.0)


@pytest.mark.parametrize("name", sorted(set(MAKERS) - {"oracle"}))
def test_no_policy_beats_the_oracle_under_slow_links(name: str) -> None:
    assert _run(name).tokens_per_s <= _run("oracle").tokens_per_s * (1 + 1e-9)


def test_steptune_beats_every_other_policy_under_slow_links() -> None:
    # Its candidates are priced by the simulator, which sees the slow links themselves; the planner's
    # per-device speed folds a link into its device and misjudges the fix (Greyhound's exact DP moves
    # beat ResiHP here).
    mine = _run("steptune").tokens_per_s
    for name in set(MAKERS) - {"oracle", "steptune"}:
        assert mine > _run(name).tokens_per_s, name


def test_resihp_reacts_to_a_slow_link() -> None:
    assert _run("resihp").tokens_per_s > _run("noop").tokens_per_s
    assert any("plan" in line for line in _run("resihp").log)
