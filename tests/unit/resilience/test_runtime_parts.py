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


def test_bad_injection_and_layout_say_what_to_write():
    from steptune.cli import main

    with pytest.raises(SystemExit):
        main(["resilience", "run", "--bogus"])
    assert main(["resilience", "run", "--inject", "kill:rank=1"]) != 0
    assert main(["resilience", "run", "--layout", "dp=2,pp=2", "--ranks", "3"]) != 0
    assert main(["resilience", "run", "--layout", "dp=1,tp=2,pp=2"]) != 0
    assert main(["resilience", "run", "--layout", "dp=2,tp=2", "--ranks", "2"]) != 0
    assert main(["resilience", "run", "--inject", "slow:rank=7,factor=2,at=3"]) != 0


def test_link_localization_from_ring_probes():
    from steptune.resilience.live import stage_model
    from steptune.resilience.runtime import LinkFault, Runtime

    class _Four:
        def rank(self) -> int:
            return 0

        def size(self) -> int:
            return 4

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
