"""The multi-rank harness itself: thread ranks and a spawn pool on real gloo groups."""

import time

import pytest

from steptune.testing import RankFailure, SpawnPool, probes, run_threads

pytestmark = [pytest.mark.dist, pytest.mark.timeout(90)]


@pytest.mark.parametrize("world", [2, 4])
def test_threads_all_reduce(world):
    total = sum(range(1, world + 1))
    assert run_threads(probes.all_reduce_sum, world) == [[float(total)] * 4] * world


@pytest.mark.parametrize("world", [2, 4])
def test_threads_send_recv_ring(world):
    assert run_threads(probes.ring_send_recv, world) == [float((r - 1) % world) for r in range(world)]


@pytest.mark.parametrize("world", [2, 4])
def test_threads_failing_rank_fails_fast(world):
    t0 = time.monotonic()
    with pytest.raises(RankFailure, match="injected failure on rank 1") as info:
        run_threads(probes.raise_on, world, timeout=30)
    assert info.value.rank == 1  # the cause, not a peer's "connection closed"
    assert time.monotonic() - t0 < 3.0  # peers unblock in milliseconds, not at the 30 s timeout


def test_threads_hung_rank_times_out():
    t0 = time.monotonic()
    with pytest.raises(TimeoutError, match=r"ranks \[1\]"):
        run_threads(probes.sleep_on, 2, 1, 30.0, timeout=2.0)
    assert time.monotonic() - t0 < 5.0


@pytest.fixture(scope="module")
def pool():
    with SpawnPool(2, timeout=60) as p:
        yield p


def test_spawn_all_reduce_and_send_recv(pool):
    assert pool.run(probes.whoami) == [(0, 2), (1, 2)]
    assert pool.run(probes.all_reduce_sum, 3) == [[3.0] * 3, [3.0] * 3]
    assert pool.run(probes.ring_send_recv) == [1.0, 0.0]


def test_spawn_failing_rank_fails_fast_then_pool_recovers(pool):
    t0 = time.monotonic()
    with pytest.raises(RankFailure, match="injected failure on rank 1"):
        pool.run(probes.raise_on)
    assert time.monotonic() - t0 < 10.0
    spawns = pool.num_spawns
    assert pool.run(probes.all_reduce_sum) == [[3.0] * 4, [3.0] * 4]  # a fresh world
    assert pool.num_spawns == spawns + 1


def test_spawn_hung_rank_times_out(pool):
    with pytest.raises(TimeoutError, match="did not answer"):
        pool.run(probes.sleep_on, 1, 30.0, timeout=3.0)
    assert pool.run(probes.whoami) == [(0, 2), (1, 2)]


def test_spawn_blames_the_rank_whose_process_died_not_the_peer_it_left_waiting(pool):
    # Found in review: rank 0's "Connection closed by peer" was reported, and rank 1's exit never named.
    t0 = time.monotonic()
    with pytest.raises(RankFailure, match="process exited with code 3") as info:
        pool.run(probes.exit_on)
    assert info.value.rank == 1, info.value
    assert time.monotonic() - t0 < 10.0
    assert pool.run(probes.whoami) == [(0, 2), (1, 2)]


def test_spawn_keeps_the_first_traceback_when_a_peer_dies_after_it(pool):
    # Found in review of the blame fix: any dead rank was blamed, even one that died after a peer's error.
    with pytest.raises(RankFailure, match="injected failure on rank 0") as info:
        pool.run(probes.raise_then_die)
    assert info.value.rank == 0 and "then rank 1's process exited with code 6" in str(info.value)
    assert pool.run(probes.whoami) == [(0, 2), (1, 2)]


def test_spawn_says_at_once_what_cannot_be_pickled(pool):
    # Found in review: both cases waited out the whole timeout, then reported ranks that "did not answer".
    t0 = time.monotonic()
    with pytest.raises(TypeError, match="must pickle"):
        pool.run(lambda rank, group: rank)
    with pytest.raises(RankFailure, match="cannot be sent back"):
        pool.run(probes.unpicklable_result, timeout=30)
    assert time.monotonic() - t0 < 10.0
    assert pool.run(probes.whoami) == [(0, 2), (1, 2)]


def test_spawn_default_group_registers_with_torch():
    with SpawnPool(2, timeout=60, default_group=True) as p:
        assert p.run(probes.registered_ring) == [1.0, 0.0]
