import pytest

from steptune.core.events import Environment, Queue, Resource, SimulationError


def test_timeouts_fire_in_time_then_insertion_order():
    env = Environment()
    log = []

    def proc(name, delay):
        yield env.timeout(delay)
        log.append((env.now, name))

    for name, delay in [("c", 2.0), ("a", 1.0), ("b", 1.0), ("d", 0.5)]:
        env.process(proc(name, delay), name=name)
    assert env.run() == 2.0
    assert log == [(0.5, "d"), (1.0, "a"), (1.0, "b"), (2.0, "c")]


@pytest.mark.parametrize(
    "capacity,finish", [(1, [1.0, 2.0, 3.0]), (2, [1.0, 1.0, 2.0]), (3, [1.0, 1.0, 1.0])]
)
def test_resource_capacity_serializes(capacity, finish):
    env = Environment()
    res = Resource(env, capacity=capacity)
    done = []

    def job():
        yield from res.use(1.0)
        done.append(env.now)

    for i in range(3):
        env.process(job(), name=f"job{i}")
    env.run()
    assert done == finish
    assert res.utilization() == pytest.approx(3.0 / (capacity * max(finish)))


def test_queue_producer_consumer_and_join():
    env = Environment()
    q = Queue(env)
    got = []

    def producer():
        for i in range(3):
            yield env.timeout(1.0)
            q.put(i)
        return "produced"

    def consumer():
        for _ in range(3):
            item = yield q.get()
            got.append((env.now, item))

    p = env.process(producer(), name="producer")
    env.process(consumer(), name="consumer")

    def joiner():
        value = yield p
        got.append(("joined", value, env.now))

    env.process(joiner(), name="joiner")
    env.run()
    assert got == [(1.0, 0), (2.0, 1), (3.0, 2), ("joined", "produced", 3.0)]


def test_all_of_and_waiting_on_past_event():
    env = Environment()
    out = []

    def proc():
        a, b = env.timeout(1.0, "a"), env.timeout(3.0, "b")
        values = yield env.all_of([a, b])
        out.append((env.now, values))
        again = yield a  # already processed: resumes at once with its value
        out.append((env.now, again))

    env.process(proc())
    env.run()
    assert out == [(3.0, ["a", "b"]), (3.0, "a")]


def test_deadlock_is_reported():
    env = Environment()
    never = env.event()

    def stuck():
        yield never

    env.process(stuck(), name="stuck-proc")
    with pytest.raises(SimulationError, match=r"deadlock.*stuck-proc"):
        env.run()


def test_process_error_names_the_process():
    env = Environment()

    def bad():
        yield env.timeout(1.0)
        raise RuntimeError("boom")

    env.process(bad(), name="bad-proc")
    with pytest.raises(SimulationError, match=r"bad-proc.*t=1"):
        env.run()


def test_run_until_stops_the_clock():
    env = Environment()
    res = Resource(env)

    def job():
        yield from res.use(10.0)

    env.process(job())
    assert env.run(until=4.0) == 4.0
    with pytest.raises(SimulationError, match="without a request"):
        Resource(env).release()
    with pytest.raises(ValueError):
        env.timeout(-1.0)
