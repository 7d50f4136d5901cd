"""The launcher's side of fail-stop survival (``failstop.Coordinator``), on a real in-process store."""

import json
import time

import pytest
import torch

from steptune.core.dist import master_store
from steptune.resilience.elastic import Elastic, PeerLost
from steptune.resilience.failstop import Coordinator
from steptune.resilience.peer_state import EXACT, STEPPED


def _announce(store, gen, ranks, step):
    for r in ranks:  # as recovery._listed does
        store.set(f"alive/{gen}/{r}", str(step))
        store.add(f"rejoining/{gen}", 1)


def test_a_death_lists_the_rest_and_a_finished_rank_is_never_listed():
    store = master_store()
    coord = Coordinator(store, {0, 1, 2, 3})
    coord.finished_rank(3)
    coord.died({1: -9})
    assert json.loads(store.get("members/1")) == [0, 2] and coord.lost == {1: -9}
    coord.finished_rank(0)  # listed, generation 1 not formed: the rest again
    assert json.loads(store.get("members/2")) == [2] and not coord.done


def test_everyone_rejoining_with_nobody_dead_is_listed_again_until_it_stops_making_progress():
    store = master_store()
    coord = Coordinator(store, {0, 1})
    coord.tick()
    assert not store.check(["members/1"])  # nobody announced: nothing to do
    for gen, step in ((1, 4), (2, 5)):  # a slow peer at step 4, then again at step 5: progress
        _announce(store, gen, [0, 1], step)
        coord.tick()
        assert json.loads(store.get(f"members/{gen}")) == [0, 1]
    for gen in (3, 4):  # listed again at step 5: 3 times in a row now
        _announce(store, gen, [0, 1], 5)
        coord.tick()
        assert store.check([f"members/{gen}"])
    _announce(store, 5, [0, 1], 5)  # a fourth time at step 5: a collective that cannot complete
    with pytest.raises(RuntimeError, match="at step 5 4 times in a row with no rank dead"):
        coord.tick()


def test_a_rank_silent_while_its_peers_rejoin_is_killed_as_hung_and_the_rest_listed():
    # Before, nobody was listed: the peers waited 60 s for a list and the job stopped without naming rank 1.
    store, killed = master_store(), []
    coord = Coordinator(store, {0, 1, 2}, hang_s=0.2, kill=killed.extend)
    _announce(store, 1, [0, 2], 3)  # rank 1 is stopped (SIGSTOP): it never announces
    coord.tick()
    assert not killed and not store.check(["members/1"])  # silent from now on
    time.sleep(0.1)
    coord.tick()
    assert not killed  # not for long enough
    time.sleep(0.15)
    coord.tick()
    assert killed == [1] and coord.lost == {1: -9} and 0.2 <= coord.hung[1] < 1, coord.hung
    assert json.loads(store.get("members/1")) == [0, 2]
    # Listed but silent before the group forms: ranks 0 and 2 announce for generation 1, rank 2 then hangs.
    coord = Coordinator(store := master_store(), {0, 1, 2}, hang_s=0.1, kill=killed.extend)
    coord.died({0: -9})
    _announce(store, 1, [1], 3)
    coord.tick()
    time.sleep(0.15)
    coord.tick()
    assert killed == [1, 2] and json.loads(store.get("members/2")) == [1], killed


def test_a_silent_rank_past_its_peers_step_is_not_taken_for_hung():
    # Found in review: ranks whose last step's sync completed return and work after their loop (an eval,
    # a save) while the others rejoin to redo that step; they were killed as hung and their results lost.
    store, killed = master_store(), []
    coord = Coordinator(store, {0, 1, 2}, hang_s=0.05, kill=killed.extend)
    for rank, done in ((0, 4), (1, 3), (2, 3)):  # rank 0 completed step 3; ranks 1 and 2 failed it
        store.set(f"progress/{rank}", str(done))
    _announce(store, 1, [1], 3)
    coord.tick()
    time.sleep(0.1)
    coord.tick()
    assert killed == [2] and coord.hung.keys() == {2}, (killed, coord.hung)  # rank 2 is stuck in step 3
    assert json.loads(store.get("members/1")) == [0, 1]  # rank 0 is listed: it finishes or rejoins
    # ... but one that entered a later attempt and stays silent is stuck there (review: it was exempt forever)
    store, killed = master_store(), []
    coord = Coordinator(store, {0, 1}, hang_s=0.05, kill=killed.extend)
    store.set("progress/0", "4")
    store.set("attempt/0", "4")
    store.set("progress/1", "3")
    _announce(store, 1, [1], 3)
    coord.tick()
    time.sleep(0.1)
    coord.tick()
    assert killed == [0], killed


def test_without_hang_s_a_silent_rank_is_waited_for_and_a_late_one_is_not_killed():
    store, killed = master_store(), []
    patient = Coordinator(store, {0, 1}, kill=killed.extend)
    _announce(store, 1, [0], 3)
    patient.tick()
    time.sleep(0.05)
    patient.tick()
    assert not killed and not store.check(["members/1"])
    store2 = master_store()
    coord = Coordinator(store2, {0, 1}, hang_s=0.1, kill=killed.extend)
    _announce(store2, 1, [0], 3)
    coord.tick()
    _announce(store2, 1, [1], 3)  # late, but within hang_s: everyone is listed again
    time.sleep(0.15)
    coord.tick()
    assert not killed and json.loads(store2.get("members/1")) == [0, 1] and coord.hung == {}


def test_everyone_rejoining_with_nobody_dead_in_every_step_is_stopped_although_the_step_advances():
    # A collective after the optimizer step that fails on every rank each step: before, one relist per step
    # forever (never the same step three times), the job "finished" with rc 0.
    store = master_store()
    coord = Coordinator(store, {0, 1, 2})
    for gen, step in enumerate((2, 3, 4, 6, 7, 8, 9, 10, 11), start=1):  # 4 -> 6: a step without one
        _announce(store, gen, [0, 1, 2], step)
        coord.tick()
        assert json.loads(store.get(f"members/{gen}")) == [0, 1, 2]
    _announce(store, 10, [0, 1, 2], 12)
    with pytest.raises(
        RuntimeError, match=r"in each of steps 6\.\.12 \(7 relists in a row\) with no rank dead"
    ):
        coord.tick()


def test_a_rank_that_raised_stops_a_survival_job_but_not_the_restart_baseline():
    with pytest.raises(RuntimeError, match=r"ranks \[2\] exited with an exception"):
        Coordinator(master_store(), {0, 1, 2}).died({2: 1})
    restart = Coordinator(master_store(), {0, 1, 2}, survive=False)
    restart.died({2: 1})
    assert restart.alive == {0, 1}


def test_a_local_error_in_sync_is_the_callers_not_a_peers_death():
    # Found in review: packing sparse gradients failed inside the part mapped to PeerLost, so every rank
    # "lost a peer" at the same step forever.
    ctx = Elastic(master_store(), 0, [0], timeout_s=5)
    emb = torch.nn.Embedding(4, 2, sparse=True)
    ctx.track(emb)
    with pytest.raises(RuntimeError) as info, ctx.attempt():
        emb(torch.tensor([1])).sum().backward()
        ctx.sync(emb)
    assert not isinstance(info.value, PeerLost), info.value


def test_a_tensor_gloo_cannot_reduce_in_all_reduce_is_the_callers_error_not_a_peers_death():
    ctx = Elastic(master_store(), 0, [0], timeout_s=5)
    ctx.track(torch.nn.Linear(2, 1))
    with pytest.raises(ValueError, match="device 'meta' cannot be reduced"), ctx.attempt():
        ctx.all_reduce(torch.ones(2, device="meta"))
    assert ctx.all_reduce(torch.ones(2)).tolist() == [1.0, 1.0]


class _Counting:
    """A store that counts the calls made on it."""

    def __init__(self, store):
        self.store, self.calls = store, 0

    def __getattr__(self, name):
        attr = getattr(self.store, name)
        if not callable(attr):
            return attr

        def call(*args, **kwargs):
            self.calls += 1
            return attr(*args, **kwargs)

        return call


def test_node_0s_idle_poll_costs_the_same_few_store_calls_for_any_number_of_ranks():
    from steptune.resilience.elastic_nodes import _Watch

    costs = []
    for world, nnodes in ((4, 2), (256, 32)):
        store = _Counting(master_store())
        watch = _Watch(store, world, world // nnodes, nnodes, node_timeout_s=60)
        assert watch.poll() is None
        store.calls = 0
        assert watch.poll() is None  # nothing happened since: no rank's keys are read
        costs.append(store.calls)
    assert costs[0] == costs[1] <= 4, costs  # it used to be 3 per rank and 2 per node (800 at 256 ranks)


def test_node_0s_poll_sees_a_report_once_it_is_counted_and_fences_a_silent_host():
    from steptune.resilience import elastic_nodes

    store = master_store()
    watch = elastic_nodes._Watch(store, 4, 2, 2, node_timeout_s=60)
    store.add("node/1/beat", 1)
    assert watch.poll() is None
    store.set("finished/1", "1")
    assert watch.poll() is None and watch.coord.finished == set()  # set, not yet counted: unseen
    store.add("events", 1)
    assert watch.poll() is None and watch.coord.finished == {1}
    count, since = watch.beats[1]
    watch.beats[1] = (count, since - 61)  # node 1 has not beaten for 61 s
    assert watch.poll() is None
    assert store.check(["node/1/lost"]) and watch.coord.lost == {2: None, 3: None}
    assert json.loads(store.get("members/1")) == [0] and watch.live_nodes() == []  # 1 finished: not listed
    # The fenced host's ranks stop with NotListed, which their agent reports as an error: not the job's.
    store.set("error/2", "NotListed: rank 2 ...")
    store.add("events", 1)
    store.add("node/1/beat", 1)  # and a late beat does not bring the host back
    assert watch.poll() is None and watch.live_nodes() == []


def test_node_0s_poll_reads_an_uncounted_report_within_a_second():
    # An agent that died between setting its report and counting it: the report is still read.
    from steptune.resilience import elastic_nodes

    store = master_store()
    watch = elastic_nodes._Watch(store, 2, 1, 2, node_timeout_s=60)
    assert watch.poll() is None
    store.set("error/1", "Traceback: a bug")
    assert watch.poll() is None  # within the second: not read yet
    watch.scanned -= elastic_nodes._RESCAN_S
    assert "rank 1 raised" in watch.poll()


def test_a_deadline_store_gives_up_on_a_silent_call_and_then_fails_fast():
    import threading

    from steptune.core.dist import DeadlineStore, StoreUnanswered

    release = threading.Event()

    class Silent:
        port = 1234

        def get(self, key):
            return b"v"

        def check(self, keys):
            release.wait()  # a reply that never comes
            return True

        def set(self, key, value):
            raise ValueError("refused")

    store = DeadlineStore(Silent(), 0.2)
    assert store.port == 1234 and store.get("k") == b"v"
    with pytest.raises(ValueError, match="refused"):  # the store's own errors come through as they are
        store.set("k", "v")
    t0 = time.monotonic()
    with pytest.raises(StoreUnanswered, match=r"did not answer check within 0\.2 s"):
        store.check(["k"])
    with pytest.raises(StoreUnanswered, match="has not answered check"):
        store.get("k")  # behind the blocked call: at once
    assert time.monotonic() - t0 < 2
    release.set()


def _exits(ctx, code):
    raise SystemExit(code)


def test_a_ranks_sys_exit_0_is_a_return_and_sys_exit_n_an_error_that_says_so():
    # Found in a sweep: sys.exit(0) was taken for a death and survived; sys.exit(3)'s message pointed to
    # a traceback that SystemExit does not print.
    from types import SimpleNamespace

    from steptune.resilience.elastic import _outcome

    ctx = SimpleNamespace(generation=1, recoveries=[{"generation": 1}])
    assert _outcome(2, {"fn": _exits, "args": (0,)}, ctx) == {
        "result": None, "generation": 1, "recoveries": [{"generation": 1}]
    }  # fmt: skip
    assert _outcome(2, {"fn": _exits, "args": (None,)}, ctx)["result"] is None
    err = _outcome(2, {"fn": _exits, "args": (3,)}, ctx)["error"]
    assert "rank 2 called sys.exit(3) inside the training function: the job is stopped" in err, err
    assert "_exits" in err  # where it was called
    assert "pickle" in _outcome(0, {"fn": lambda ctx: lambda: 1, "args": ()}, ctx)["error"]


@pytest.mark.parametrize("restore", ["peer", "snapshot"])
def test_the_state_taken_at_a_windows_first_step_is_kept_while_gradients_accumulate(restore):
    # One rank, gradients accumulated over steps 0-2, the optimizer stepped at step 2.
    ctx = Elastic(master_store(), 0, [0], timeout_s=5)
    model = torch.nn.Linear(2, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    ctx.track(model, opt, restore=restore)
    for step in range(4):
        with ctx.attempt():
            model(torch.ones(1, 2)).sum().backward()
            assert ctx._taken[0] == (0 if step < 3 else 3), (step, ctx._taken)
            if step == 2:
                ctx.sync(model)
                opt.step()
                opt.zero_grad(set_to_none=False)  # zeros, not None: the step's version bump ends the window
    if restore == "peer":
        assert ctx._state.standing(current=3) == (3, EXACT)  # at the window's first step
        with torch.no_grad():
            opt.step()
        assert ctx._state.standing(current=5) == (6, STEPPED)  # the end of the failed step
    else:
        assert sorted(ctx._state._kept) == [0, 3]  # the window before is kept
