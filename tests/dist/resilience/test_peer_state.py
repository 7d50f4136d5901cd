"""``resilience.peer_state``: where a rank stands after a failed attempt, and how the survivors settle on
one state without a per-step copy (thread ranks on real gloo groups)."""

import pytest
import torch
from torch import nn

from steptune.core.dist import abort_group
from steptune.resilience import peer_state
from steptune.resilience.peer_state import DIRTY, EXACT, STEPPED, PeerState, SettleFailed, StateLost
from steptune.resilience.recovery import Snapshots, tensor_bytes
from steptune.testing import run_threads

pytestmark = [pytest.mark.dist, pytest.mark.timeout(60)]


def _net(seed=0):
    # Built before the thread ranks start: torch's global RNG is shared by the threads.
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8), nn.Linear(8, 1))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    return model, opt, sched


def _train_step(model, opt, seed=1):
    x = torch.randn(6, 4, generator=torch.Generator().manual_seed(seed))
    model(x).square().sum().backward()
    opt.step()
    opt.zero_grad()


def _same(a, b):
    pairs = zip(a.state_dict().values(), b.state_dict().values(), strict=True)
    return all(torch.equal(x, y) for x, y in pairs)


def test_standing_tells_an_untouched_state_from_a_whole_optimizer_step_and_from_any_other_write():
    model, opt, sched = _net()
    state = PeerState(model, opt, sched)
    state.take(3)
    model(torch.randn(6, 4)).sum().backward()  # a forward moves BN's statistics, a backward no parameter
    assert state.standing() == (3, EXACT)
    opt.step()
    assert state.standing() == (4, STEPPED)
    opt.step()  # twice in one attempt: not a step this rank can vouch for
    assert state.standing() == (3, DIRTY)
    state.take(3)
    with torch.no_grad():
        model[0].weight.add_(1.0)  # a write of the user's own, not through the optimizer
    assert state.standing() == (3, DIRTY)
    for write_after in (False, True):  # a write before the step, or after it, is seen around the step
        state.take(3)
        with torch.no_grad():
            if not write_after:
                model[2].bias.add_(1.0)
            opt.step()
            if write_after:
                model[2].bias.add_(1.0)
        assert state.standing() == (3, DIRTY)
    other = torch.optim.SGD(model.parameters(), lr=0.1)  # two optimizers, only one stepped: half a step
    both = PeerState(model, opt, other)
    both.take(3)
    opt.step()
    assert both.standing() == (3, DIRTY)
    other.step()
    assert both.standing() == (4, STEPPED)
    both.close()
    state.close()  # a state replaced by another track(): its hooks are gone
    state.take(3)
    opt.step()
    assert state.standing() == (3, DIRTY)  # seen as a write, no longer as a step


def test_restore_start_undoes_the_forwards_buffer_updates_and_the_schedulers_step():
    model, opt, sched = _net()
    ref, _, _ = _net()
    state = PeerState(model, opt, sched)
    state.take(0)
    model(torch.randn(6, 4))
    opt.step()  # no gradients: changes nothing, and keeps the scheduler's order warning away
    sched.step()
    assert not torch.equal(model[1].running_mean, ref[1].running_mean)
    state.restore_start()
    assert _same(model, ref) and sched.last_epoch == 0


def test_settle_brings_a_rank_one_step_behind_to_the_rank_ahead_and_leaves_ranks_there_untouched(monkeypatch):
    monkeypatch.setattr(peer_state, "CHUNK_BYTES", 1000)  # the state travels in several messages
    ahead, _, _ = _net()
    o = torch.optim.AdamW(ahead.parameters(), lr=1e-2)
    _train_step(ahead, o)  # what step 0 gives: the state at the start of step 1

    nets = [_net() for _ in range(3)]

    def rank_fn(rank, group):
        model, opt, sched = nets[rank]
        state = PeerState(model, opt, sched)
        if rank == 0:  # its step-0 all-reduce failed: at the start of step 0
            state.take(0)
        else:  # step 0 completed here; step 1 failed before its update
            _train_step(model, opt)
            state.take(1)
        model(torch.ones(6, 4) * rank)  # the abandoned attempt's forward
        resume, source = state.settle(group, rank, 3, state.standing())
        return resume, source, model.state_dict(), opt.state_dict()["state"][0]["step"]

    out = run_threads(rank_fn, 3)
    assert [(r, s) for r, s, _, _ in out] == [(1, 1)] * 3
    for _, _, sd, step in out:
        assert all(torch.equal(sd[k], v) for k, v in ahead.state_dict().items())
        assert float(step) == 1.0  # AdamW's state travelled too


def _settle_on_ranks(world, prepare):
    """Each of ``world`` thread ranks takes step 0's start on its own copy of the net, runs
    ``prepare(rank, model, opt, state)``, then settles: the results, or the ``StateLost`` raised."""
    nets = [_net() for _ in range(world)]

    def rank_fn(rank, group):
        model, opt, sched = nets[rank]
        state = PeerState(model, opt, sched)
        state.take(0)
        prepare(rank, model, opt, state)
        try:
            return state.settle(group, rank, world, state.standing())
        except StateLost as err:
            return err

    return run_threads(rank_fn, world)


def test_settle_prefers_an_exact_rank_over_stepped_ones_and_needs_no_copy_when_all_hold_the_state():
    def one_stepped(rank, model, opt, state):
        if rank == 1:
            _train_step(model, opt)  # stepped, then a later collective failed: holds step 0's end

    assert _settle_on_ranks(2, one_stepped) == [(1, 1), (1, 1)]
    assert _settle_on_ranks(2, lambda *_: None) == [(0, None), (0, None)]


def test_no_usable_state_on_any_survivor_is_an_error_that_names_the_snapshot_mode():
    def written(rank, model, opt, state):
        with torch.no_grad():
            model[0].weight.mul_(2)

    for err in _settle_on_ranks(2, written):
        assert isinstance(err, StateLost) and "restore='snapshot'" in str(err)


def test_a_death_while_settling_is_a_settle_failure_for_the_caller_to_rejoin_from():
    # Not a bare RuntimeError: Elastic rejoins the next generation on SettleFailed only, so an error in
    # loading a received state (a bug) is not taken for a death.
    nets = [_net() for _ in range(2)]

    def rank_fn(rank, group):
        model, opt, sched = nets[rank]
        state = PeerState(model, opt, sched)
        state.take(0)
        if rank == 1:
            abort_group(group)  # as a dead peer's sockets close
            return None
        with pytest.raises(SettleFailed):
            state.settle(group, rank, 2, state.standing())
        return state.standing()  # unchanged: the next generation settles from the same standing

    assert run_threads(rank_fn, 2, group_timeout=2)[0] == (0, EXACT)


def test_held_bytes_are_the_buffers_for_peer_and_two_whole_copies_for_snapshot():
    model, opt, sched = _net()
    _train_step(model, opt)  # AdamW holds its moments now
    state = PeerState(model, opt, sched)
    assert state.held_bytes() == 0
    state.take(0)
    assert state.held_bytes() == sum(b.numel() * b.element_size() for b in model.buffers()) > 0
    snaps = Snapshots(model, opt)
    one = tensor_bytes(model.state_dict()) + tensor_bytes(opt.state_dict())
    assert one > 3 * sum(p.numel() * 4 for p in model.parameters())  # weights, two moments, BN, steps
    snaps.take(0)
    snaps.take(1)
    assert snaps.held_bytes() == 2 * one
    snaps.take(3)  # step 2's start was never taken (a window of accumulation 1-2): step 1's stays with 3's
    assert snaps.held_bytes() == 2 * one and sorted(snaps._kept) == [1, 3]
    snaps.take(4)  # never more than two copies
    assert snaps.held_bytes() == 2 * one and sorted(snaps._kept) == [3, 4]


_SCHEDULERS = {
    "step": lambda opt: torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5),
    "chained": lambda opt: torch.optim.lr_scheduler.ChainedScheduler(  # no last_epoch of its own
        [torch.optim.lr_scheduler.StepLR(opt, 1, gamma=0.5), torch.optim.lr_scheduler.ConstantLR(opt, 1.0, 9)]
    ),
    "plateau": lambda opt: torch.optim.lr_scheduler.ReduceLROnPlateau(opt, patience=0),  # needs the metric
}


@pytest.mark.parametrize(
    ("kind", "history"),
    [("step", "per_step"), ("chained", "per_step"), ("plateau", "per_step"), ("step", "per_epoch"),
     ("step", "first_step")],
)  # fmt: skip
def test_a_per_step_scheduler_behind_a_collective_that_failed_after_the_update_is_stepped(kind, history):
    # Every survivor stepped its optimizer in step 1, then a metric all-reduce failed before sched.step():
    # step 1 counts as done, so a scheduler that stepped once in step 0 is stepped now (else it stays one
    # step behind for the rest of the run). One that did not step in step 0 (stepped per epoch), with no
    # whole step seen, or whose step needs the metric (ReduceLROnPlateau) is left as it is.
    nets = [_net() for _ in range(2)]
    scheds = [_SCHEDULERS[kind](opt) for _, opt, _ in nets]

    def rank_fn(rank, group):
        model, opt, _ = nets[rank]
        sched = scheds[rank]
        state = PeerState(model, opt, sched)
        if history != "first_step":
            state.take(0)
            _train_step(model, opt)
            if history == "per_step":
                sched.step(*([1.0] if kind == "plateau" else []))
        state.take(1)
        _train_step(model, opt)
        assert state.standing() == (2, STEPPED)
        resume = state.settle(group, rank, 2, state.standing())
        return resume, state.completed, opt.param_groups[0]["lr"]

    out = run_threads(rank_fn, 2)
    if history == "per_step" and kind != "plateau":
        name = type(scheds[0]).__name__
        assert out == [((2, 0), [name], pytest.approx(1e-2 * 0.25))] * 2
    else:
        assert out == [((2, 0), [], pytest.approx(1e-2))] * 2
