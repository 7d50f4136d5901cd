"""Random valid schedules and known-bad ones, for testing executors and simulators.

A random valid schedule is a random linear extension of the dependency graph (F before the next
stage's F, the last F before its backward, a backward before the previous stage's backward, I
before W), cut into per-device orders under a random placement. Any such order is deadlock-free
whatever the costs, since the global order is a topological order shared by every device.
"""

from __future__ import annotations

import random

from steptune.pipeline.schedule import Action, ActionKind, Schedule

__all__ = ["invalid_schedules", "random_schedule"]


def random_schedule(
    rng: random.Random, *, num_devices: int, num_stages: int, num_microbatches: int, split_prob: float = 0.5
) -> Schedule:
    if num_stages < num_devices:
        raise ValueError(f"need at least one stage per device: {num_stages} stages < {num_devices} devices")
    # Every device gets at least one stage; the rest are placed at random.
    placement = list(range(num_devices)) + [
        rng.randrange(num_devices) for _ in range(num_stages - num_devices)
    ]
    rng.shuffle(placement)
    last = num_stages - 1
    split = {(s, m): rng.random() < split_prob for s in range(num_stages) for m in range(num_microbatches)}
    done: set[tuple[int, str, int]] = set()
    ready: list[Action] = [Action(0, ActionKind.F, m) for m in range(num_microbatches)]
    orders: list[list[Action]] = [[] for _ in range(num_devices)]
    while ready:
        a = ready.pop(rng.randrange(len(ready)))
        orders[placement[a.stage]].append(a)
        s, m = a.stage, a.microbatch
        done.add((s, a.kind.value, m))
        bwd = ActionKind.I if split[(s, m)] else ActionKind.B
        if a.kind is ActionKind.F:
            ready.append(Action(s + 1, ActionKind.F, m) if s < last else Action(s, bwd, m))
        elif a.kind in (ActionKind.I, ActionKind.B):
            if a.kind is ActionKind.I:
                ready.append(Action(s, ActionKind.W, m))
            if s > 0:
                prev = ActionKind.I if split[(s - 1, m)] else ActionKind.B
                ready.append(Action(s - 1, prev, m))
    return Schedule(
        name="random",
        num_stages=num_stages,
        num_microbatches=num_microbatches,
        placement=tuple(placement),
        orders=tuple(tuple(o) for o in orders),
    ).validate()


def invalid_schedules(rng: random.Random, count: int = 20) -> list[tuple[str, Schedule]]:
    """``count`` broken schedules: cycle, missing action, duplicate, wrong device, backward first."""
    out: list[tuple[str, Schedule]] = []
    kinds = ("cycle", "missing", "duplicate", "wrong_device", "backward_first")
    while len(out) < count:
        kind = kinds[len(out) % len(kinds)]
        p = rng.choice((2, 3, 4))
        base = random_schedule(rng, num_devices=p, num_stages=p + rng.randrange(2), num_microbatches=p + 1)
        orders = [list(o) for o in base.orders]
        d = rng.randrange(p)
        if kind == "cycle":
            # Swap two microbatches' forwards on one device and their backwards on another: each
            # device's order is plausible alone, together they wait on each other.
            orders = [list(o) for o in base.orders]
            s0 = base.stages_of(0)[0]
            fs = [i for i, a in enumerate(orders[0]) if a.kind is ActionKind.F and a.stage == s0]
            if len(fs) < 2 or p < 2:
                continue
            i, j = fs[0], fs[-1]
            orders[0][i], orders[0][j] = orders[0][j], orders[0][i]
            # and reverse the backward order of the first stage's consumer chain on another device
            d2 = base.placement[min(s0 + 1, base.num_stages - 1)]
            bw = [k for k, a in enumerate(orders[d2]) if a.kind is not ActionKind.F]
            if not bw:
                continue
            orders[d2] = [a for a in orders[d2] if a.kind is ActionKind.F] + list(
                reversed([a for a in orders[d2] if a.kind is not ActionKind.F])
            )
        elif kind == "missing":
            orders[d].pop(rng.randrange(len(orders[d])))
        elif kind == "duplicate":
            orders[d].append(orders[d][rng.randrange(len(orders[d]))])
        elif kind == "wrong_device":
            a = orders[d].pop(rng.randrange(len(orders[d])))
            orders[(d + 1) % p].append(a)
        else:
            f = next(i for i, a in enumerate(orders[d]) if a.kind is ActionKind.F)
            a = orders[d].pop(f)
            orders[d].append(a)  # its forward now comes after the backward that needs it
        out.append(
            (
                kind,
                Schedule(
                    name=f"invalid-{kind}",
                    num_stages=base.num_stages,
                    num_microbatches=base.num_microbatches,
                    placement=base.placement,
                    orders=tuple(tuple(o) for o in orders),
                ),
            )
        )
    return out
