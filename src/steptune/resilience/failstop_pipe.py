"""Fail-stop survival for DP x PP: the dead stage's layers come back from its DP peers.

Layout ``dp`` pipelines of ``pp`` stages (original rank = pipeline * pp + stage), each rank holding a
contiguous range of a tiny decoder's layers (the rest NaN, so a layer that did not travel poisons the loss).
Each step the global batch's microbatches are split over the pipelines by ``plan_dp`` (predicted cost over
each pipeline's modelled rate), every pipeline runs 1F1B over real gloo send/recv (``pipelined.run_stage``),
and gradients are summed over the world layer by layer (``sum_and_step`` with the owned layers), so the
update does not depend on which pipeline ran which microbatch.

When a rank dies, the launcher and the survivors run ``failstop``'s protocol (new gloo group among the
survivors, common safe point, rollback). Then ``survivor_pipes`` gives the new layout: pipelines that lost
nobody keep their stages; the survivors of broken pipelines form one new pipeline over all the layers, in
their old stage order, blocks split evenly. Every layer a survivor now needs and does not hold is sent by a
surviving DP peer that holds it (``restore_moves``): parameters and SGD momentum, at the safe point. Only
when no survivor holds some layer does the job fall back to the last checkpoint (every rank writes its
layers every ``checkpoint_every`` steps).

The baseline (``mode="restart"``) is torchrun's: every rank is killed, the survivors start as fresh
processes in the same post-failure layout and load the last checkpoint, and redo the steps since.
"""

from __future__ import annotations

import datetime
import os
import re
import signal
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch

from steptune.core.dist import LostGroups, connect_store, new_gloo_group
from steptune.resilience.failstop import compare_failstop, doomed, finish, run_failstop, split_sync
from steptune.resilience.live import global_batch, link_bandwidth, stage_model, sum_and_step
from steptune.resilience.pipelined import _BYTES_PER_PARAM, _layers, _Stage, run_stage
from steptune.resilience.planners import plan_dp
from steptune.resilience.recovery import Recovery, Snapshots

__all__ = [
    "Pipes",
    "compare_failstop_pipe",
    "initial_pipes",
    "reference_model",
    "restore_moves",
    "run_failstop_pipe",
    "survivor_pipes",
]

Pipes = list[list[tuple[int, int, int]]]
"""Per pipeline, per stage: (original rank, first layer, end layer). Layer 0 is the embedding, the last
one the head; the blocks in between carry the compute."""


def _split_blocks(num_layers: int, stages: int) -> list[tuple[int, int]]:
    """Contiguous layer ranges, blocks spread evenly (earlier stages take the remainder); the embedding
    goes with the first stage and the head with the last."""
    blocks = num_layers - 2
    if not 1 <= stages <= blocks:
        raise ValueError(f"cannot split {blocks} blocks over {stages} stages (1..{blocks} stages)")
    bounds, start = [], 1
    for s in range(stages):
        n = blocks // stages + (1 if s < blocks % stages else 0)
        bounds.append((0 if s == 0 else start, start + n + (1 if s == stages - 1 else 0)))
        start += n
    return bounds


def initial_pipes(dp: int, pp: int, num_layers: int) -> Pipes:
    """``dp`` identical pipelines of ``pp`` stages; rank = pipeline * pp + stage."""
    split = _split_blocks(num_layers, pp)
    return [[(p * pp + s, a, b) for s, (a, b) in enumerate(split)] for p in range(dp)]


def survivor_pipes(pipes: Pipes, alive: Sequence[int], num_layers: int) -> Pipes:
    """Pipelines with no dead stage stay as they are; the survivors of the broken ones (in old stage order,
    pipeline by pipeline) form one new pipeline over every layer. Raises ``ValueError`` if nobody is left."""
    live = set(alive)
    intact = [p for p in pipes if all(r in live for r, _, _ in p)]
    orphans = [r for p in pipes if p not in intact for r, _, _ in sorted(p, key=lambda x: x[1]) if r in live]
    orphans.sort(key=lambda r: next(a for p in pipes for q, a, _ in p if q == r))  # keep the most layers
    if not intact and not orphans:
        raise ValueError("no rank survived")
    if orphans:
        orphans = orphans[: num_layers - 2]  # more orphans than blocks: the rest stand by
        split = _split_blocks(num_layers, len(orphans))
        intact = [*intact, [(r, a, b) for r, (a, b) in zip(orphans, split, strict=True)]]
    return intact


def restore_moves(old: Pipes, new: Pipes, alive: Sequence[int]) -> list[tuple[int, int, int]]:
    """(layer, source rank, destination rank) for every layer a survivor holds in ``new`` but not in
    ``old``; the source is the lowest surviving rank that holds it in ``old`` (a DP peer). Raises
    ``LookupError`` naming the layers no survivor holds (then only a checkpoint has them)."""
    live = set(alive)
    holds = {r: range(a, b) for p in old for r, a, b in p if r in live}
    moves, lost = [], set()
    for p in new:
        for r, a, b in p:
            for idx in range(a, b):
                if idx in holds.get(r, range(0)):
                    continue
                src = [q for q in sorted(holds) if idx in holds[q]]
                if not src:
                    lost.add(idx)
                else:
                    moves.append((idx, src[0], r))
    if lost:
        raise LookupError(f"no surviving copy of layers {sorted(lost)}: only the checkpoint has them")
    return moves


def _where(pipes: Pipes, orig: int) -> tuple[int, int] | None:
    for p, pipe in enumerate(pipes):
        for s, (r, _, _) in enumerate(pipe):
            if r == orig:
                return p, s
    return None


def _rates(pipes: Pipes, num_layers: int, mean_cost: float) -> tuple[list[float], list[float]]:
    """Per pipeline: microbatches' cost units per second (1 / its largest stage's share of the blocks) and
    its fill time (the other stages' shares of one mean microbatch)."""
    blocks = num_layers - 2
    rates, base = [], []
    for pipe in pipes:
        t = [(min(b, num_layers - 1) - max(a, 1)) / blocks for _, a, b in pipe]
        rates.append(1.0 / max(t))
        base.append(mean_cost * (sum(t) - max(t)))
    return rates, base


def _checkpoint_files(prefix: str) -> dict[int, list[Path]]:
    base = Path(prefix)
    out: dict[int, list[Path]] = {}
    for f in base.parent.glob(base.name + ".rank*.step*"):
        m = re.fullmatch(re.escape(base.name) + r"\.rank\d+\.step(\d+)", f.name)
        if m:
            out.setdefault(int(m.group(1)), []).append(f)
    return out


def _save(prefix: str, orig: int, step: int, me: _Stage, losses: dict[int, float]) -> None:
    tmp = f"{prefix}.rank{orig}.tmp"
    torch.save({"step": step, "layers": {i: me._flat(i) for i in me.owned}, "losses": losses}, tmp)
    os.replace(tmp, f"{prefix}.rank{orig}.step{step}")  # atomic: a reader never sees half a file
    # Keep this rank's newest two: the newest set may be incomplete if a peer dies before writing its part.
    mine = sorted(st for st, files in _checkpoint_files(prefix).items() for f in files
                  if f.name.startswith(f"{Path(prefix).name}.rank{orig}.step"))  # fmt: skip
    for old_step in mine[:-2]:
        Path(f"{prefix}.rank{orig}.step{old_step}").unlink(missing_ok=True)


def _load_latest(prefix: str, me: _Stage, num_layers: int) -> tuple[int, dict[int, float]]:
    """Load this rank's layers from the newest checkpoint step whose files cover every layer.
    Returns (step, losses up to it); (0, {}) when there is none (the seed's initial model)."""
    for step, files in sorted(_checkpoint_files(prefix).items(), reverse=True):
        states = [torch.load(f, weights_only=False) for f in files]
        have = {i: s["layers"][i] for s in states for i in s["layers"]}
        if set(have) >= set(range(num_layers)):
            for i in me.owned:
                me._load(i, have[i])
            return step, dict(states[0]["losses"])
    return 0, {}


def _own(me: _Stage, pipes: Pipes, orig: int, num_layers: int) -> None:
    """Set ``me.owned`` from ``pipes`` and poison every other layer (NaN, no momentum)."""
    spot = _where(pipes, orig)
    me.owned = range(0) if spot is None else range(*pipes[spot[0]][spot[1]][1:])
    for i in range(num_layers):
        if i not in me.owned:
            me.poison(i)


def _pipe_worker(orig: int, world: int, port: int, spec: dict[str, Any], out: Any) -> None:
    torch.set_num_threads(1)
    seed, steps, scale = int(spec["seed"]), int(spec["steps"]), float(spec["time_scale"])
    dp, pp, blocks = int(spec["dp"]), int(spec["pp"]), int(spec.get("blocks", 6))
    num_layers = blocks + 2
    timeout = datetime.timedelta(seconds=20)
    store = connect_store(port, timeout=datetime.timedelta(seconds=60))
    full = stage_model()
    layers = _layers(seed, blocks)
    params = [p for m in layers for p in m.parameters()]
    param_layer = [i for i, m in enumerate(layers) for _ in m.parameters()]
    opt = torch.optim.SGD(params, lr=0.05, momentum=0.9)
    members, gen = list(spec.get("members", range(world))), int(spec.get("gen", 0))
    group = new_gloo_group(store, members.index(orig), len(members), prefix=f"gen{gen}", timeout=timeout)
    me = _Stage(members.index(orig), group, layers, opt)
    pipes = survivor_pipes(initial_pipes(dp, pp, num_layers), members, num_layers)
    _own(me, pipes, orig, num_layers)
    ckpt = spec.get("checkpoint")
    step, losses = 0, {}
    info: dict[str, Any] = {"recoveries": []}
    if spec.get("resume") and ckpt:
        step, losses = _load_latest(ckpt, me, num_layers)
        info["recoveries"].append({"from": "checkpoint", "step": step, "pipes": pipes})
    link = link_bandwidth(spec.get("cluster", "dgx-h100"), world)
    real_block_bytes = sum(x.params for x in full.layers) * _BYTES_PER_PARAM / blocks
    snapshots = Snapshots(*layers, opt)
    recovery = Recovery(store, orig, spec, snapshots, timeout)
    lost = LostGroups()  # a broken group, freed once its worker threads are idle
    while step < steps:
        snapshots.take(step)
        die = doomed(spec, orig, step)
        try:
            synced = split_sync(spec, orig, step, gen)
            losses[step] = _pipe_step(
                me, pipes, members, orig, step, spec, full, param_layer, params, die, synced
            )
            step += 1
            if ckpt and spec.get("checkpoint_every") and step % int(spec["checkpoint_every"]) == 0:
                _save(ckpt, orig, step, me, losses)
        except RuntimeError:
            if spec.get("mode") == "restart":
                os._exit(1)  # torchrun: a failed collective ends the worker; the agent tears everything down
            failed = True
        else:
            failed = False
        while failed:  # outside the except block: its traceback holds the broken group (see failstop)
            lost.add(group)
            me.group = group = None
            lost.free()
            opt.zero_grad()
            joined, step, losses, adopted = recovery.rejoin(gen + 1, step, losses)
            members, group, gen = joined.members, joined.group, joined.generation
            del joined  # it holds the group: when that group breaks, only `lost` may keep it (peers wait)
            me.group, me.rank = group, members.index(orig)
            if adopted is not None:  # a peer committed it
                pipes = adopted
                _own(me, pipes, orig, num_layers)
                info["recoveries"].append({"from": "committed by peers", "step": step, "pipes": pipes})
            t0 = time.perf_counter()
            new = survivor_pipes(pipes, members, num_layers)
            try:
                moves = restore_moves(pipes, new, members)
            except LookupError as err:  # no DP peer has them: the checkpoint is the fallback
                if not ckpt:
                    raise RuntimeError(f"{err}, and this job writes no checkpoint (set checkpoint)") from err
                pipes = new
                _own(me, pipes, orig, num_layers)
                step, losses = _load_latest(ckpt, me, num_layers)
                info["recoveries"].append({"from": "checkpoint", "step": step, "pipes": pipes})
                snapshots.clear()
                break
            moved = [(i, members.index(s), members.index(d)) for i, s, d in moves]
            if not recovery.copy(group, gen, new, lambda moved=moved: me.move(moved, keep_sent=True)):
                info["recoveries"].append({"from": "aborted", "step": step, "generation": gen})
                continue  # a survivor died during the copy: every rank keeps the old layout
            mine = sum(1 for _, s, d in moves if orig in (s, d))  # the emulated transfer of the real layers
            time.sleep(mine * real_block_bytes / link * scale)
            pipes = new
            _own(me, pipes, orig, num_layers)
            info["recoveries"].append(
                {"from": "peers", "step": step, "moves": moves, "pipes": pipes,
                 "restore_s": time.perf_counter() - t0}
            )  # fmt: skip
            snapshots.clear()
            failed = False
    finish(out, (orig, {k: losses[k] for k in sorted(losses)}, {**info, "pipes": pipes}))


@contextmanager
def _emulated(seconds: float, on_enter: Any = None) -> Iterator[None]:
    """Hold the block to ``seconds`` of wall time (the emulated device time of the real layers)."""
    t0 = time.perf_counter()
    if on_enter is not None:
        on_enter()
    yield
    rest = seconds - (time.perf_counter() - t0)
    if rest > 0:
        time.sleep(rest)


def _pipe_step(me: _Stage, pipes: Pipes, members: list[int], orig: int, step: int, spec: dict[str, Any],
               full: Any, param_layer: list[int], params: list[Any], die: bool,
               synced: Any = None) -> float:  # fmt: skip
    """One training step of this rank: its stage of its pipeline, then the layer-wise gradient sync
    (``synced``: a context around its all-reduces)."""
    seed, scale = int(spec["seed"]), float(spec["time_scale"])
    num_layers = len(me.layers)
    mbs, tokens = global_batch(seed, step)
    total = sum(t.shape[1] - 1 for t in tokens)
    costs = [sum(full.time(mb, ph) for ph in "FBW") for mb in mbs]
    rates, base = _rates(pipes, num_layers, sum(costs) / len(costs))
    assignment = plan_dp(costs, rates, base=base)
    loss_sum = torch.zeros(())
    spot = _where(pipes, orig)
    if spot is not None:
        p, s = spot
        pipe = pipes[p]
        share = (min(pipe[s][2], num_layers - 1) - max(pipe[s][1], 1)) / (num_layers - 2)
        rank_of = {r: i for i, r in enumerate(members)}
        prev = rank_of[pipe[s - 1][0]] if s > 0 else None
        nxt = rank_of[pipe[s + 1][0]] if s < len(pipe) - 1 else None
        ops = [0]

        def kill_midway() -> None:  # a hard failure mid-pipeline: neighbours are waiting on this rank
            ops[0] += 1
            if die and ops[0] == len(assignment[p]):
                os.kill(os.getpid(), signal.SIGKILL)

        def timed(i: int, phases: tuple[str, ...]) -> Any:
            return _emulated(sum(full.time(mbs[i], ph) for ph in phases) * share * scale, kill_midway)

        loss_sum = run_stage(me, prev, nxt, s, len(pipe), assignment[p], tokens, total, timed)
    owned = {k for k, i in enumerate(param_layer) if i in me.owned}
    return sum_and_step(params, me.opt, me.group, loss_sum, owned, timed=synced)


def run_failstop_pipe(spec: dict[str, Any]) -> dict[str, Any]:
    """One DP x PP fail-stop job (``spec``: dp, pp, steps, seed, time_scale, kill_rank, kill_step,
    mode, checkpoint, checkpoint_every); see ``failstop.run_failstop``."""
    return run_failstop({**spec, "ranks": int(spec["dp"]) * int(spec["pp"])}, _pipe_worker)


def compare_failstop_pipe(spec: dict[str, Any], reference: list[float] | None = None) -> dict[str, Any]:
    """Failure-free, survive-in-place (state from DP peers) and restart-from-checkpoint, same seeds
    (``reference``: see ``failstop.compare_failstop``; ``reference_model`` gives the single-process model)."""
    base = {"dp": 2, "pp": 2, **spec}
    return compare_failstop({**base, "ranks": int(base["dp"]) * int(base["pp"])}, _pipe_worker, reference)


def reference_model(spec: dict[str, Any]) -> torch.nn.Module:
    """The whole decoder the pipelines split, in one module (for ``live.reference_losses``)."""
    return torch.nn.Sequential(*_layers(int(spec.get("seed", 0)), int(spec.get("blocks", 6))))
