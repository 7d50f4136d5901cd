"""The unified pipeline executor: runs any valid schedule on an explicit process group.

Per rank, it executes the schedule's compute order and orchestrates communication around it:
- every output is sent with ``isend`` as soon as it is produced (tagged by boundary, microbatch and
  direction); sends are retired at the end of the step;
- a window of ``irecv``s is posted ahead, in this rank's consumption order, bounded by
  ``recv_window``; a receive is waited on only right before the compute that consumes it;
- adjacent stages on the same rank hand tensors over locally, without communication;
- backward is split: I computes the gradient of the stage input and of every layer output,
  W later turns each layer output's gradient into its weight gradients and frees the activations;
  B is I then W.

Contract: the schedule is validated and dry-run through the simulator before any communication,
so a cyclic order is refused with the simulator's message naming what each device waits for.
Every wait has a timeout; when one fires, the error shows every rank's last position (published
in the store when one is given). Buffers: this executor owns its receive buffers and the
activations it keeps between F and W; the caller owns the stage modules and their ``.grad``.

Known cost: W recomputes, inside each layer, the activation gradients that lead to that layer's
deeper weights (I and W are split per layer, not per op as torch's ``stage_backward_weight``
does); the sleep harness's layers have no such inner path, so its timing is exact.
"""

from __future__ import annotations

import datetime
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from steptune.core.dist import irecv, isend
from steptune.pipeline.costs import StageCosts
from steptune.pipeline.schedule import Action, ActionKind, Schedule, ScheduleError
from steptune.pipeline.simulate import simulate
from steptune.pipeline.stages import _NOT_A_TENSOR

__all__ = ["ExecutorConfig", "ExecutorTimeout", "PipelineExecutor", "check_schedule"]

BoundaryMeta = tuple[torch.Size | tuple[int, ...], torch.dtype]


class ExecutorTimeout(RuntimeError):
    """A wait exceeded the watchdog timeout, or a peer's did (gloo then closes the connection); the message
    lists every rank's last position."""


@dataclass(frozen=True, kw_only=True, slots=True)
class ExecutorConfig:
    recv_window: int = 4
    """Receives posted ahead of the one being consumed (each holds one activation buffer)."""
    timeout: float = 60.0
    """Seconds a single wait may take before the watchdog turns it into an error."""
    publish: str = "action"
    """With a store: "action" writes this rank's position before every action (a hang is visible from
    outside while it lasts; one store round trip per action); "timeout" writes it only when a wait times
    out, then waits up to min(timeout, 10 s) for the peers' (no cost while the step runs)."""

    def __post_init__(self) -> None:  # a sweep (2026-12-05): -1 gave a KeyError, nan a ValueError later
        if (
            isinstance(self.recv_window, bool)
            or not isinstance(self.recv_window, int)
            or self.recv_window < 0
        ):
            raise ValueError(
                f"ExecutorConfig.recv_window must be a whole number >= 0, got {self.recv_window!r}"
            )
        t = self.timeout
        if isinstance(t, bool) or not isinstance(t, int | float) or not (math.isfinite(t) and t > 0):
            raise ValueError(f"ExecutorConfig.timeout must be a finite number of seconds > 0, got {t!r}")
        if self.publish not in ("action", "timeout"):
            raise ValueError(f'ExecutorConfig.publish must be "action" or "timeout", got {self.publish!r}')


def check_schedule(schedule: Schedule) -> None:
    """Refuse an invalid or deadlocking schedule before any communication (raises ScheduleError)."""
    schedule.validate()
    unit = StageCosts.uniform(schedule.num_stages, act_bytes=0.0)
    simulate(schedule, unit, with_spans=False)


@dataclass(slots=True)
class _Recv:
    key: tuple[str, int, int]  # ("f" | "b", stage, microbatch) of the consumer
    src: int
    tag: int
    buf: torch.Tensor
    work: Any = None


class PipelineExecutor:
    """Runs ``schedule`` for one rank. ``stages`` maps each stage index this rank holds to its module.

    ``boundary[s]`` is the (shape, dtype) of stage ``s``'s output for one microbatch (its gradient
    has the same), needed to allocate receive buffers. The last stage's output goes to
    ``loss_fn(output, target)``; each microbatch's loss is scaled by 1 / num_microbatches, so the
    accumulated gradients are those of the mean loss.
    """

    def __init__(
        self,
        schedule: Schedule,
        stages: dict[int, torch.nn.Module],
        *,
        rank: int,
        group: Any,
        boundary: Sequence[BoundaryMeta],
        loss_fn: Callable[[torch.Tensor, Any], torch.Tensor],
        config: ExecutorConfig | None = None,
        store: Any = None,
        prefix: str = "pp",
    ) -> None:
        check_schedule(schedule)
        size = group.size() if hasattr(group, "size") else None
        if size is not None and size != schedule.num_devices:
            # A gloo receive from a rank outside the group blocks in the call itself, before any timed
            # wait: refuse here instead of hanging in the first step.
            raise ValueError(
                f"the group has {size} rank(s) but the schedule places its stages on "
                f"{schedule.num_devices} devices; run it on a group of {schedule.num_devices}"
            )
        if not 0 <= rank < schedule.num_devices:
            raise ValueError(
                f"rank {rank} is not one of the schedule's devices 0..{schedule.num_devices - 1}"
            )
        not_stages = sorted(s for s, m in stages.items() if not callable(getattr(m, "forward_collect", None)))
        if not_stages:
            raise TypeError(
                f"stage(s) {not_stages} are plain modules; the executor needs each stage's unit outputs: "
                "wrap the layers with steptune.pipeline.stages.split_layers(layers, partition) (a Stage each)"
            )
        misfiled = [(s, m.index) for s, m in stages.items() if getattr(m, "index", s) != s]
        if misfiled:
            raise ValueError(
                f"stages={{{misfiled[0][0]}: <stage {misfiled[0][1]}>}}: the module given as stage "
                f"{misfiled[0][0]} is stage {misfiled[0][1]} (Stage.index); key each stage by its own index"
            )
        mine = set(schedule.stages_of(rank))
        if set(stages) != mine:
            raise ValueError(
                f"rank {rank} holds stages {sorted(mine)} under this schedule's placement, "
                f"but was given {sorted(stages)}"
            )
        if len(boundary) < schedule.num_stages - 1:
            raise ValueError(
                f"boundary needs the output shape of stages 0..{schedule.num_stages - 2}, "
                f"got {len(boundary)} entries"
            )
        self.schedule = schedule
        self.stages = stages
        self.rank = rank
        self.group = group
        self.boundary = list(boundary)
        self.loss_fn = loss_fn
        self.config = config or ExecutorConfig()
        self.store = store
        self.prefix = prefix
        self._position = "before its first action"
        self.order = schedule.orders[rank]
        self.last = schedule.num_stages - 1
        self.losses: list[float] = []
        self._recvs = self._plan_recvs()
        self._recv_index = {r[0]: i for i, r in enumerate(self._recvs)}

    # --- planning ------------------------------------------------------------------------------

    def _tag(self, direction: str, boundary_stage: int, mb: int) -> int:
        return (boundary_stage * self.schedule.num_microbatches + mb) * 2 + (0 if direction == "f" else 1)

    def _plan_recvs(self) -> list[tuple[tuple[str, int, int], int, int, BoundaryMeta]]:
        """Receives this rank needs, in the order its computes consume them."""
        place, out = self.schedule.placement, []
        for a in self.order:
            s, m = a.stage, a.microbatch
            if a.kind is ActionKind.F and s > 0 and place[s - 1] != self.rank:
                out.append((("f", s, m), place[s - 1], self._tag("f", s - 1, m), self.boundary[s - 1]))
            elif a.kind in (ActionKind.I, ActionKind.B) and s < self.last and place[s + 1] != self.rank:
                out.append((("b", s, m), place[s + 1], self._tag("b", s, m), self.boundary[s]))
        return out

    # --- watchdog ------------------------------------------------------------------------------

    def _publish(self, position: str) -> None:
        self._position = position
        if self.store is not None and self.config.publish == "action":
            self.store.set(f"{self.prefix}/pos/{self.rank}", position)

    def _positions(self) -> str:
        if self.store is None:
            return f"rank {self.rank}: {self._position} (no store given, so no other rank's position)"
        if self.config.publish == "timeout":  # the peers publish when their own waits time out
            try:
                self.store.set(f"{self.prefix}/pos/{self.rank}", self._position)
            except Exception as exc:  # a dead store must not hide the error being reported
                return f"rank {self.rank}: {self._position} (the store did not take it: {exc})"
            grace = min(self.config.timeout, 10.0)
        else:
            grace = 0.2
        deadline = time.monotonic() + grace
        lines = []
        for r in range(self.schedule.num_devices):
            key = f"{self.prefix}/pos/{r}"
            try:
                left = max(deadline - time.monotonic(), 0.05)
                self.store.wait([key], datetime.timedelta(seconds=left))
                lines.append(f"rank {r}: {self.store.get(key).decode()}")
            except Exception:
                why = f" within {grace:g} s: busy, hung or dead?" if self.config.publish == "timeout" else ""
                lines.append(f"rank {r}: (no position published{why})")
        return "; ".join(lines)

    def _wait(self, work: Any, what: str) -> None:
        try:
            work.wait(datetime.timedelta(seconds=self.config.timeout))
        except RuntimeError as exc:
            if (err := self._peer_error(exc, what)) is None:
                raise
            raise err from exc

    def _peer_error(self, exc: RuntimeError, what: str) -> ExecutorTimeout | None:
        """A timed-out wait, or a connection a peer closed (gloo closes a pair whose wait timed out), as an
        ``ExecutorTimeout`` listing the positions; None for any other error (raised unchanged)."""
        text = str(exc).lower()
        if "timed out" in text:
            head = f"rank {self.rank} waited more than {self.config.timeout:g} s for {what}"
        elif "closed" in text or "connection" in text:
            head = f"rank {self.rank} lost its connection to a peer at {what} (its watchdog fired first?)"
        else:
            return None
        return ExecutorTimeout(f"{head} ({exc}); positions: {self._positions()}")

    # --- one step --------------------------------------------------------------------------------

    def step(
        self, inputs: Sequence[torch.Tensor] | None = None, targets: Sequence[Any] | None = None
    ) -> list[float]:
        """Run one step over all microbatches. Returns the losses (on the rank holding the last stage)."""
        sched, rank = self.schedule, self.rank
        mbs = sched.num_microbatches
        if 0 in self.stages and (inputs is None or len(inputs) != mbs):
            raise ValueError(f"rank {rank} holds stage 0: pass {mbs} microbatch inputs")
        if 0 in self.stages:  # before any communication: a peer would wait out the watchdog
            assert inputs is not None
            bad = next((m for m, x in enumerate(inputs) if not isinstance(x, torch.Tensor)), None)
            if bad is not None:
                raise TypeError(_NOT_A_TENSOR.format(what=f"microbatch {bad} is", got=inputs[bad]))
        if self.last in self.stages and (targets is None or len(targets) != mbs):
            raise ValueError(f"rank {rank} holds the last stage: pass {mbs} targets")
        next_recv = 0
        pending: dict[tuple[str, int, int], _Recv] = {}
        local: dict[tuple[str, int, int], torch.Tensor] = {}
        sends: list[tuple[Any, str]] = []
        state: dict[tuple[int, int], dict[str, Any]] = {}
        losses: list[float] = [0.0] * mbs

        def post_until(limit: int) -> None:
            nonlocal next_recv
            while next_recv < min(limit, len(self._recvs)):
                key, src, tag, (shape, dtype) = self._recvs[next_recv]
                rv = _Recv(key=key, src=src, tag=tag, buf=torch.empty(shape, dtype=dtype))
                try:
                    rv.work = irecv(rv.buf, src, self.group, tag=tag)
                except RuntimeError as exc:
                    if (err := self._peer_error(exc, f"posting a receive from rank {src}")) is None:
                        raise
                    raise err from exc
                pending[key] = rv
                next_recv += 1

        def take(key: tuple[str, int, int]) -> torch.Tensor:
            if key in local:
                return local.pop(key)
            # Post receives through this one, plus the window ahead.
            post_until(self._recv_index[key] + 1 + self.config.recv_window)
            rv = pending.pop(key)
            self._wait(rv.work, f"{key[0]}-input of stage {key[1]} microbatch {key[2]} from rank {rv.src}")
            return rv.buf

        def emit(tensor: torch.Tensor, key: tuple[str, int, int], dst: int, tag: int) -> None:
            if dst == rank:
                local[key] = tensor
            else:
                shape, dtype = self.boundary[key[1] - 1 if key[0] == "f" else key[1]]
                what = "output" if key[0] == "f" else "input gradient"
                if tensor.dtype != dtype:  # the receiver's buffer is this dtype: bytes would be misread
                    raise TypeError(
                        f"microbatch {key[2]}'s {what} at the boundary to stage {key[1]} is {tensor.dtype}, "
                        f"the boundary's is {dtype}: declare the dtype the stage really returns in "
                        "boundary= (boundary_shape(layers, example) reads it), or cast in the unit"
                    )
                if tuple(tensor.shape) != tuple(shape):  # the peer's buffer is sized for this: it would
                    # compute on uninitialised memory (a short last microbatch; found in a 2026-12-05 sweep)
                    raise ValueError(
                        f"microbatch {key[2]}'s {what} at the boundary to stage {key[1]} has shape "
                        f"{tuple(tensor.shape)}, the boundary's is {tuple(shape)}: every microbatch must "
                        "cross it at one shape; pad the short one, or drop it (DataLoader(drop_last=True))"
                    )
                what = f"send {key} to rank {dst}"
                try:
                    sends.append((isend(tensor.contiguous(), dst, self.group, tag=tag), what))
                except RuntimeError as exc:
                    if (err := self._peer_error(exc, what)) is None:
                        raise
                    raise err from exc

        post_until(self.config.recv_window)
        for pos, a in enumerate(self.order):
            self._publish(f"action {pos}/{len(self.order)} {a}")
            s, m = a.stage, a.microbatch
            if a.kind is ActionKind.F:
                self._forward(a, state, losses, inputs, targets, take, emit)
            else:
                if a.kind in (ActionKind.I, ActionKind.B):
                    self._backward_input(a, state, take, emit)
                if a.kind in (ActionKind.W, ActionKind.B):
                    self._backward_weight(state.pop((s, m)))
        for work, what in sends:
            self._wait(work, what)
        self._publish(f"done {len(self.order)}/{len(self.order)}")
        if pending or local:
            raise ScheduleError(
                f"rank {rank}: unconsumed inputs after the step: {sorted(pending) + sorted(local)}"
            )
        self.losses = [losses[m] for m in range(mbs)] if self.last in self.stages else []
        return self.losses

    def _forward(
        self,
        a: Action,
        state: dict[tuple[int, int], dict[str, Any]],
        losses: list[float],
        inputs: Sequence[torch.Tensor] | None,
        targets: Sequence[Any] | None,
        take: Callable[[tuple[str, int, int]], torch.Tensor],
        emit: Callable[[torch.Tensor, tuple[str, int, int], int, int], None],
    ) -> None:
        s, m = a.stage, a.microbatch
        place = self.schedule.placement
        if s == 0:
            assert inputs is not None
            x = inputs[m].detach()
        else:
            x = take(("f", s, m)).detach()
        if x.is_floating_point():
            # Also on stage 0, so its first layer's input-gradient work runs in I as the cost model
            # charges it (token ids, the usual stage-0 input, are not floating point).
            x.requires_grad_(True)
        stage = self.stages[s]
        y, outs = stage.forward_collect(x)
        if not isinstance(y, torch.Tensor):
            raise TypeError(_NOT_A_TENSOR.format(what=f"stage {s} returns", got=y))
        st: dict[str, Any] = {"x": x, "outs": outs, "layer_params": stage.layer_params()}
        if s == self.last:
            assert targets is not None
            loss = self.loss_fn(y, targets[m]) / self.schedule.num_microbatches
            losses[m] = float(loss.detach()) * self.schedule.num_microbatches
            st["root"], st["root_grad"] = loss, None
        else:
            st["root"] = y
            emit(y.detach(), ("f", s + 1, m), place[s + 1], self._tag("f", s, m))
        state[(s, m)] = st

    def _backward_input(
        self,
        a: Action,
        state: dict[tuple[int, int], dict[str, Any]],
        take: Callable[[tuple[str, int, int]], torch.Tensor],
        emit: Callable[[torch.Tensor, tuple[str, int, int], int, int], None],
    ) -> None:
        s, m = a.stage, a.microbatch
        st = state[(s, m)]
        outs: list[torch.Tensor] = st["outs"]
        if s == self.last:
            root, grad_root = st["root"], None
            wanted = list(outs)  # every layer output, the logits included
        else:
            root, grad_root = st["root"], take(("b", s, m))
            wanted = list(outs[:-1])
        x = st["x"]
        needs_x = isinstance(x, torch.Tensor) and x.requires_grad
        targets = ([x] if needs_x else []) + [t for t in wanted if t.requires_grad]
        grads: list[torch.Tensor | None] = []
        if targets:
            grads = list(
                torch.autograd.grad(
                    root, targets, grad_outputs=grad_root, retain_graph=True, allow_unused=True
                )
            )
        grad_x = grads.pop(0) if needs_x else None
        layer_grads: list[torch.Tensor | None] = []
        it = iter(grads)
        for t in wanted:
            layer_grads.append(next(it) if t.requires_grad else None)
        if s != self.last:
            layer_grads.append(grad_root)
        st["layer_grads"] = layer_grads
        if s > 0:
            if grad_x is None:
                grad_x = torch.zeros_like(x)
            emit(grad_x.detach(), ("b", s - 1, m), self.schedule.placement[s - 1], self._tag("b", s - 1, m))

    def _backward_weight(self, st: dict[str, Any]) -> None:
        outs: list[torch.Tensor] = st["outs"]
        grads: list[torch.Tensor | None] = st["layer_grads"]
        for out, grad, params in zip(outs, grads, st["layer_params"], strict=True):
            if grad is None or not params or not out.requires_grad:
                continue
            torch.autograd.backward(out, grad_tensors=grad, inputs=params, retain_graph=True)
        st.clear()  # drop activations and the graph
