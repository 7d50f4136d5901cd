"""LostGroups: a lost gloo group is kept (aborted) until ``free``, which waits for in-flight works, lets the
worker threads finish, and only then drops it, so that its peers fail."""

import datetime
import os
import threading
import time

import pytest

from steptune.core.dist import LostGroups, connect_store, master_store, new_gloo_group

pytestmark = [pytest.mark.dist, pytest.mark.timeout(60)]


def _threads() -> int:
    return len(os.listdir("/proc/self/task"))


def _pair(store) -> list:
    groups: list = [None, None]

    def make(rank: int) -> None:
        groups[rank] = new_gloo_group(
            connect_store(store.port), rank, 2, prefix="lost", timeout=datetime.timedelta(seconds=20)
        )

    ranks = [threading.Thread(target=make, args=(r,)) for r in range(2)]
    for t in ranks:
        t.start()
    for t in ranks:
        t.join(30)
    assert all(g is not None for g in groups)
    return groups


@pytest.mark.skipif(not os.path.isdir("/proc/self/task"), reason="counts threads in /proc")
def test_a_kept_group_lives_until_free_and_its_peer_fails_only_then():
    import torch

    store = master_store()
    groups = _pair(store)
    lost = LostGroups()
    lost.add(groups[1])
    groups[1] = None
    assert len(lost) == 1
    work = groups[0].allreduce([torch.ones(4)])  # its peer is lost, not yet freed
    time.sleep(0.5)
    assert not work.is_completed()  # the kept group's sockets are still open: rank 0 waits
    before = _threads()
    t0 = time.monotonic()
    lost.free()
    assert len(lost) == 0
    assert _threads() <= before - 2  # the group's worker threads are joined
    with pytest.raises(RuntimeError):
        work.wait()
    assert time.monotonic() - t0 < 10  # the peer fails once the sockets close, not at the 20 s timeout
    groups[0] = None


class _Work:
    def __init__(self, fails: bool) -> None:
        self.fails, self.waited = fails, False

    def wait(self) -> bool:
        self.waited = True
        if self.fails:
            raise RuntimeError("Connection closed by peer")
        return True


def test_free_waits_for_every_work_and_ignores_their_failures():
    lost = LostGroups()
    lost.add(None, object())  # a holder with no group (a wrapper whose group never formed)
    works = [_Work(True), _Work(False), _Work(True)]
    lost.free(works)
    assert all(w.waited for w in works) and len(lost) == 0


def test_free_with_nothing_held_does_not_pause():
    t0 = time.monotonic()
    for _ in range(20):
        LostGroups().free()
    assert time.monotonic() - t0 < 20 * 0.05  # DRAIN_S is paid only when a group is held
