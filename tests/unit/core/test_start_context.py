import time

import pytest

from steptune.core.dist import START_METHOD_ENV, start_context


def test_the_argument_wins_over_the_environment_which_wins_over_spawn(monkeypatch):
    monkeypatch.delenv(START_METHOD_ENV, raising=False)
    assert start_context().get_start_method() == "spawn"
    monkeypatch.setenv(START_METHOD_ENV, "forkserver")
    assert start_context().get_start_method() == "forkserver"
    assert start_context("spawn").get_start_method() == "spawn"


def test_an_unknown_method_names_the_choices_and_the_variable(monkeypatch):
    monkeypatch.setenv(START_METHOD_ENV, "fork")
    with pytest.raises(ValueError, match=r"'spawn' or 'forkserver', got 'fork'") as err:
        start_context()
    assert "(the argument, or $STEPTUNE_START_METHOD)" in str(err.value)


@pytest.mark.timeout(120)
def test_a_forkserver_rank_starts_with_torch_dynamo_imported():
    # A rank's first optimizer call imports torch._dynamo (2.3 s of CPU here) unless the server did.
    with start_context("forkserver").Pool(1) as pool:
        assert pool.apply(eval, ("'torch._dynamo' in __import__('sys').modules",))


def test_a_pool_interrupted_ends_its_ranks_at_once_and_a_close_waits_its_grace_in_all():
    # A sweep: Ctrl-C to `resilience run`'s launcher alone took 16 s on 3 ranks (5 s each, in turn)
    from steptune.testing.spawn import SpawnPool

    class Busy:  # a rank that leaves only when killed: until then each join waits out its timeout
        def __init__(self, asked):
            self.asked, self.killed = asked, False

        def join(self, timeout=None):
            self.asked.append(timeout)
            time.sleep(0 if self.killed else timeout or 0)

        def is_alive(self):
            return not self.killed

        def kill(self):
            self.killed = True

    pool = SpawnPool(3)
    pool.close_grace_s = 0.3
    asked = []
    pool._procs = [Busy(asked) for _ in range(3)]
    pool.__exit__(KeyboardInterrupt, KeyboardInterrupt(), None)
    assert asked == [5, 5, 5]  # only _kill's joins of killed ranks: no stop request waited out
    asked.clear()
    pool._procs, pool._tasks = [Busy(asked) for _ in range(3)], []
    t0 = time.monotonic()
    pool.close()
    assert time.monotonic() - t0 < 0.3 * 2  # 0.3 s for the three together (was 5 s each), then killed
    assert sum(asked[:3]) <= 0.3 + 1e-6, asked
