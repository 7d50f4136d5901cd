"""Pure parts of the resilience runtime: LPT assignment, fault windows, the iteration-threshold baseline."""

import pytest

from steptune.resilience.runtime import IterationThreshold, SlowFault, lpt_assign


def test_lpt_gives_a_slow_rank_proportionally_less_work():
    costs = [1.0] * 40
    even = lpt_assign(costs, [1.0] * 4)
    assert sorted(len(x) for x in even) == [10] * 4
    skewed = lpt_assign(costs, [1.0, 0.5, 1.0, 1.0])
    assert len(skewed[1]) == 6 and sum(len(x) for x in skewed) == 40
    assert sorted(i for x in skewed for i in x) == list(range(40))  # every microbatch exactly once


def test_fault_window():
    f = SlowFault(rank=1, factor=1.6, start=5, duration=3)
    assert [f.factor_at(1, s) for s in range(4, 9)] == [1.0, 1.6, 1.6, 1.6, 1.0]
    assert f.factor_at(0, 6) == 1.0


def test_iteration_threshold_alarms_on_spikes_after_warmup():
    th = IterationThreshold(0.10, window=10, warmup=5)
    assert [th.observe(t) for t in [1.0, 5.0, 1.0, 1.0, 1.0]] == [False] * 5
    assert th.observe(1.2) is True and th.observe(1.05) is False


def test_bad_injection_and_layout_say_what_to_write(capsys):
    from steptune.cli import main

    with pytest.raises(SystemExit):
        main(["resilience", "run", "--bogus"])
    assert main(["resilience", "run", "--inject", "kill:rank=1"]) != 0
    assert main(["resilience", "run", "--layout", "dp=2,pp=2", "--ranks", "3"]) != 0
    assert main(["resilience", "run", "--layout", "dp=1,tp=2,pp=2"]) != 0
    assert main(["resilience", "run", "--layout", "dp=2,tp=2", "--ranks", "2"]) != 0
    assert main(["resilience", "run", "--inject", "slow:rank=7,factor=2,at=3"]) != 0
    link = ["--inject", "slow-link:rank=1,factor=2,at=20", "--ranks-per-node", "1"]
    assert main(["resilience", "run", "--layout", "dp=2,tp=2", *link]) == 2
    assert "not with tp > 1" in capsys.readouterr().err
    assert main(["resilience", "run", "--layout", "dp=1,pp=4", *link]) == 2
    assert "use dp >= 2" in capsys.readouterr().err


def test_link_localization_from_ring_probes():
    from steptune.resilience.live import stage_model
    from steptune.resilience.runtime import LinkFault, Runtime

    rt = Runtime(_Four(), stage_model())
    # Probe r times link r -> r+1. Rank 2's NIC carries links 1->2 and 2->3.
    nic = rt._localize([1.0, 4.1, 3.9, 1.02], 1.0)
    assert nic is not None and nic.kind == "fail-slow-link"
    assert nic.unit == 2 and nic.link == (1, 2) and abs(nic.slowdown - 4.1) < 1e-9
    # One slow cable between 3 and 0: the link, not a rank.
    cable = rt._localize([1.0, 1.0, 1.05, 3.0], 1.0)
    assert cable is not None and cable.unit is None and cable.link == (3, 0)
    # Every link alike (the fabric): no link or rank to blame.
    fabric = rt._localize([2.0, 2.1, 2.05, 2.0], 1.0)
    assert fabric is not None and fabric.unit is None and fabric.link is None
    # Probes as fast as modelled: the collective's alarm is not validated.
    assert rt._localize([1.0, 1.02, 0.98, 1.05], 1.0) is None
    with pytest.raises(ValueError, match="factor"):
        Runtime(_Four(), stage_model(), link_faults=[LinkFault(rank=1, factor=0.0, start=0)])
    # A collective is timed on the ranks that take part in it
    with pytest.raises(ValueError, match="on rank 0: time a collective on the ranks that take part"):
        rt.comm_timed(0.1, ranks=[1, 3]).__enter__()
    with pytest.raises(ValueError, match=r"ranks of the group, in \[0, 4\)"):
        rt.comm_timed(0.1, ranks=[0, 4]).__enter__()


class _Four:
    """Rank 0 of a four-rank group, for what Runtime does without messaging."""

    def rank(self) -> int:
        return 0

    def size(self) -> int:
        return 4


class _One:
    """A one-rank group: enough for Runtime's all-gathers."""

    def rank(self) -> int:
        return 0

    def size(self) -> int:
        return 1

    def allgather(self, outs, ins):
        for out, inp in zip(outs[0], ins, strict=True):
            out.copy_(inp)

        class _Done:
            def wait(self) -> None:
                pass

        return _Done()


class _FakeEvent:
    """A CUDA event on a fake device clock: work is queued (the clock moves), the host returns at once."""

    device_now = 0.0
    synced = 0

    def __init__(self, enable_timing: bool = False) -> None:
        self.t: float | None = None

    def record(self) -> None:
        self.t = _FakeEvent.device_now

    def synchronize(self) -> None:
        _FakeEvent.synced += 1

    def elapsed_time(self, end: "_FakeEvent") -> float:
        assert self.t is not None and end.t is not None
        return (end.t - self.t) * 1e3


@pytest.mark.parametrize("timing", ["auto", "cuda", "wall"])
def test_real_timing_on_cuda_reads_events_not_the_host_clock(monkeypatch, timing):
    """With emulate=False on a GPU, the host clock around a block reads the kernels' launch (about 0 here),
    not their run (0.5 s of device time): timed() takes CUDA events and end_step waits for them."""
    import torch

    from steptune.resilience.live import stage_model
    from steptune.resilience.runtime import Runtime, RuntimeConfig

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.cuda, "Event", _FakeEvent)
    _FakeEvent.synced = 0
    rt = Runtime(_One(), stage_model(), config=RuntimeConfig(emulate=False, timing=timing))
    with rt.timed([512, 512]):
        _FakeEvent.device_now += 0.5  # kernels queued: 0.5 s on the device, no host time
    with rt.comm_timed(0.1):
        _FakeEvent.device_now += 0.2
    report = rt.end_step(tokens=1024)
    if timing == "wall":
        assert _FakeEvent.synced == 0 and report.rank_compute_s[0] < 0.05
    else:
        assert _FakeEvent.synced == 2 and report.rank_compute_s[0] == pytest.approx(0.5)
        assert report.comm_s[0] == pytest.approx(0.2)
        assert rt._pending == [] and rt._pending_comm == []


def test_timing_is_checked():
    from steptune.resilience.live import stage_model
    from steptune.resilience.runtime import Runtime, RuntimeConfig

    with pytest.raises(ValueError, match="'auto', 'cuda' or 'wall'"):
        Runtime(_One(), stage_model(), config=RuntimeConfig(timing="events"))


def test_config_and_faults_out_of_range_are_refused_where_they_are_made():
    from steptune.resilience.runtime import RuntimeConfig

    for kw, says in (
        ({"time_scale": 0}, "time_scale must be a finite number > 0"),
        ({"time_scale": -0.01}, "time_scale"),
        ({"time_scale": float("nan")}, "time_scale"),
        ({"time_scale": "0.01"}, "time_scale"),
        ({"noise_sigma": -1}, "noise_sigma must be a finite number in \\[0, 1\\]"),
        ({"iteration_threshold": -1}, "iteration_threshold"),
        ({"emulate": "no"}, "emulate and adapt are True or False"),
        # found in a user sweep (2026-12-05): each was taken, then went wrong later or slept for ~1600 s
        ({"noise_sigma": 50}, "noise_sigma must be a finite number in \\[0, 1\\]"),
        ({"seed": -1}, "seed must be a whole number >= 0"),
    ):
        with pytest.raises(ValueError, match=says):
            RuntimeConfig(**kw)
    from steptune.resilience.detect import ResiHPConfig
    from steptune.resilience.predict import PredictorConfig

    for make, kw, says in (
        (PredictorConfig, {"warmup": 0}, "warmup must be a whole number >= 3"),  # a healthy rank "26x slow"
        (PredictorConfig, {"warmup": 30, "window": 10}, "window must be a whole number >= 30"),
        (ResiHPConfig, {"consecutive": 0}, "consecutive must be a whole number >= 1"),  # an alarm every step
        (ResiHPConfig, {"gate": 0.9}, "gate must be a finite number >= 1"),
        (ResiHPConfig, {"cusum_h": 0}, "cusum_h must be a finite number > 0"),
    ):
        with pytest.raises(ValueError, match=says):
            make(**kw)
    for kw, says in (
        ({"factor": float("inf")}, "a number from 1 to 1000"),  # slept forever in step 1 before
        ({"factor": 0.5}, "a number from 1 to 1000"),
        ({"start": -5}, "whole number >= 0"),
        ({"duration": 0}, "whole number >= 1"),
        ({"rank": 0.5}, "a rank is a whole number"),
    ):
        with pytest.raises(ValueError, match=says):
            SlowFault(**{"rank": 0, "factor": 2.0, "start": 1, **kw})


def test_runtime_refuses_what_would_silently_do_nothing_or_crash_later():
    from steptune.resilience.live import stage_model
    from steptune.resilience.runtime import Runtime, RuntimeConfig

    fault = SlowFault(rank=0, factor=5.0, start=2)
    with pytest.raises(ValueError, match=r"emulate=False.*inject nothing"):
        Runtime(_One(), stage_model(), RuntimeConfig(emulate=False, timing="wall"), faults=[fault])
    with pytest.raises(TypeError, match="takes a list of faults"):
        Runtime(_One(), stage_model(), faults=fault)  # type: ignore[arg-type]
    rt = Runtime(_One(), stage_model(), RuntimeConfig(time_scale=1e-6))
    for mbs, error, says in (
        (
            [[], [1024]],
            ValueError,
            r"microbatch 0: each sequence length must be a whole number >= 1, got \[\]",
        ),
        ([[0], [1024]], ValueError, "microbatch 0"),
        ([[-1024]], ValueError, "microbatch 0"),
        ([[1024.5]], ValueError, "microbatch 0"),
        ([1024, 512], TypeError, r"assign\(\) takes a list of them"),  # a flat list of lengths
    ):
        with pytest.raises(error, match=says):
            rt.assign(mbs)
    import numpy as np

    assert rt.assign([np.array([512, 512]), [np.int64(1024)]]) == [0, 1]  # arrays and numpy ints are fine
    with rt.timed([1024]), pytest.raises(RuntimeError, match="do not nest"), rt.timed([512]):
        pass
    ctx = rt.timed([1024])
    ctx.__enter__()
    with pytest.raises(RuntimeError, match="inside a timed"):
        rt.end_step(tokens=1024)
    ctx.__exit__(None, None, None)
    assert rt.end_step().tokens == 2048  # the assign() above
    assert rt.end_step().tokens == 0  # a step with no assign() is not credited the last one's tokens
    # found in a user sweep (2026-12-05): these were taken, or failed later with AttributeError or
    # ZeroDivisionError
    with pytest.raises(ValueError, match="a whole number"):
        rt.end_step(tokens="abc")
    with pytest.raises(ValueError, match="one or more of 'F', 'B', 'W'"):
        rt.timed([1024], phases=()).__enter__()
    with pytest.raises(ValueError, match="the collective's healthy time"):
        rt.comm_timed(float("nan")).__enter__()
    with pytest.raises(TypeError, match="a StageModel"):
        Runtime(_One(), "llama3.1-8b")  # type: ignore[arg-type]


def test_injections_and_layouts_given_twice_or_spaced_are_refused(capsys):
    from steptune.cli import main
    from steptune.resilience.pipelined import parse_layout

    for spec, says in (
        ("slow:rank=1,factor=1.6,at=2,rank=0", "rank is given twice"),  # rank 0 was slowed before
        ("slow:rank1,factor=1.6,at=2", "'rank1' is not key=value"),
        ("slow:rank=1, factor=1.6,at=2", "no spaces"),
    ):
        assert main(["resilience", "run", "--inject", spec]) == 2
        assert says in capsys.readouterr().err
    with pytest.raises(ValueError, match="dp is given twice"):
        parse_layout("dp=2,dp=1")
    args = ["resilience", "run", "--compare", "--steps", "3", "--inject", "slow:rank=1,factor=2,at=2"]
    assert main(args) == 2  # before spawning three jobs
    assert "leaves nothing to measure" in capsys.readouterr().err


def test_a_scenario_csv_with_a_bom_reads_and_a_second_fail_stop_of_a_device_is_refused(tmp_path):
    from steptune.resilience.scenarios import read_csv

    path = tmp_path / "s.csv"
    path.write_text("kind,device,start_s,duration_s,factor\nfail-stop,3,600,inf,1\n", encoding="utf-8-sig")
    assert [e.device for e in read_csv(path)] == [3]
    path.write_text("kind,device,start_s,duration_s,factor\nfail-stop,3,600,inf,1\nfail-stop,3,900,inf,1\n")
    with pytest.raises(ValueError, match=r"s.csv:3: device 3 already fails \(fail-stop\) at line 2"):
        read_csv(path)


def test_an_elastic_node_rank_outside_the_job_is_refused():
    from steptune.resilience.elastic import launch, toy_train

    with pytest.raises(ValueError, match=r"node_rank must be in 0\.\.0 \(one per host of nnodes=1\), got 3"):
        launch(toy_train, 2, 3, node_rank=3)


def test_overlapping_comm_groups_are_judged_apart():
    # Found in review (2026-12-05): groups were keyed by (lowest rank, size), so TP {0, 1} and DP {0, 2}
    # were one detector unit
    from steptune.resilience.live import stage_model
    from steptune.resilience.runtime import Runtime

    rt = Runtime(_Four(), stage_model())
    assert rt._comm_group([0, 1]) != rt._comm_group([0, 2])
    assert rt._comm_group([2, 0]) == rt._comm_group([0, 2]) and rt._comm_group(None) == rt._comm_group(
        range(4)
    )


def test_a_rank_left_without_work_gets_a_probe_microbatch():
    # A sweep: a rank judged 20x slow got no microbatch, so it never showed it had healed (a quarter of the
    # job lost from step 16 to the end)
    from steptune.resilience.live import stage_model
    from steptune.resilience.runtime import Runtime, RuntimeConfig

    class _Second(_Four):
        def rank(self) -> int:
            return 1

    batch = [[512]] * 7 + [[256]]
    rt = Runtime(_Second(), stage_model())
    rt.speeds = [1.0, 0.05, 1.0, 1.0]
    assert rt.assign(batch) == []
    rt._idle[1] = 9
    assert rt.assign(batch) == []
    rt._idle[1] = 10
    assert rt.assign(batch) == [7] and rt._probed[1]  # the cheapest microbatch, once it has idled 10 steps
    # 100x slow: a probe would take more than half a step per step waited (a review: 1000x made the job 16x
    # slower), so it waits until the wait has doubled enough
    rt.speeds = [1.0, 0.01, 1.0, 1.0]
    assert rt.assign(batch) == []
    rt._idle[1] = rt._probe_wait[1] = 80
    assert rt.assign(batch) == [7]
    never = Runtime(_Second(), stage_model(), RuntimeConfig(probe_every=0))
    never.speeds, never._idle = [1.0, 0.01, 1.0, 1.0], [0, 100, 0, 0]
    assert never.assign(batch) == []
    with pytest.raises(ValueError, match="probe_every"):
        RuntimeConfig(probe_every=-1)
    with pytest.raises(ValueError, match=r"below 2\*\*63"):
        RuntimeConfig(seed=2**64)


def test_elastic_json_writes_what_a_training_function_returns_as_strict_json():
    # A sweep: tuple keys raised after the job (results lost), NaN was written, arrays became repr strings
    import json

    import numpy as np
    import torch

    from steptune.resilience.elastic_cli import _jsonable

    notes: list[str] = []
    results = {(0, 1): 0.5, "nan": float("nan"), "a": np.arange(3), "t": torch.tensor([1.5]), "s": {3, 1},
               "i": np.int64(7), "o": object}  # fmt: skip
    got = _jsonable({"results": results}, "$", notes)
    text = json.dumps(got, allow_nan=False)
    assert json.loads(text)["results"] == {
        "(0, 1)": 0.5, "nan": None, "a": [0, 1, 2], "t": [1.5], "s": [1, 3], "i": 7, "o": repr(object)
    }  # fmt: skip
    assert any("nan" in n and "null" in n for n in notes) and any("repr" in n for n in notes)


def test_a_replica_left_without_work_gets_a_probe_microbatch():
    # The DP x PP and DP x TP jobs assign replicas with plan_dp, which had no probe: a replica judged very
    # slow never ran again, so it could not show it had healed
    from steptune.resilience.live import stage_model
    from steptune.resilience.planners import plan_dp
    from steptune.resilience.runtime import Runtime

    rt = Runtime(_Four(), stage_model())
    costs = [2.0] * 7 + [1.0]
    replicas = [[0, 1], [2, 3]]
    rates, base = [1.0, 0.05], [0.5, 0.5]
    assert plan_dp(costs, rates, base=base)[1] == []
    rt._idle = [0, 0, 10, 9]  # one member ran something within the wait: the replica is not idle
    assert rt.add_probes(plan_dp(costs, rates, base=base), costs, rates, replicas, base)[1] == []
    rt._idle = [0, 0, 10, 10]
    plan = rt.add_probes(plan_dp(costs, rates, base=base), costs, rates, replicas, base)
    assert plan == [list(range(7)), [7]] and rt._probed == [False, False, True, True]
    rt._probe_wait[3] = 40  # the slow member's doubled wait holds for its whole replica
    assert rt.add_probes(plan_dp(costs, rates, base=base), costs, rates, replicas, base)[1] == []
    assert rt._probed == [False] * 4
    with pytest.raises(ValueError, match="one plan entry, rate and member list per unit"):
        rt.add_probes([[0], []], costs, [1.0, 1.0, 1.0], replicas)
