"""Load steptune schedules into torch.distributed.pipelining's schedule runtime.

Contract:

* This module is the only place in steptune that touches torch's *private* pipelining API
  (``_PipelineScheduleRuntime``, ``_Action``, ``pipeline_order_with_comms``; checked against torch
  2.13). Those names are imported inside the functions, so ``import steptune.pipeline.torch_compat``
  works on any torch; a torch that lacks one fails only when called, with a ``RuntimeError`` that
  names the missing API.
* Loading goes through torch's own reader: ``Schedule.to_csv()`` is written to a temp file and
  ``_PipelineScheduleRuntime._load_csv(path, format="compute_only")`` reads it. That call
  (1) parses each row into ``_Action``s as ``pipeline_order[rank]``; (2) runs ``_validate_schedule``,
  which counts F/I/W/B per stage, checks F before I/B before W per microbatch and *infers* the
  stage-to-rank map (``stage_index_to_group_rank``) from which row holds each stage; (3) lowers the
  order for execution with ``_prepare_schedule_with_comms``: ``_add_unshard_reshard`` (FSDP
  UNSHARD/RESHARD, no-ops without FSDP), ``_add_reduce_grad`` (after a stage's last B/W) and
  ``_add_send_recv`` (a SEND after each cross-rank F/I/B and the peer's RECV placed at the sender's
  time; it fails on an order that cannot make progress, e.g. a cyclic one), then ``_defer_recv_ops``
  when ``defer_pp_recv=True``.
* Whatever torch rejects while loading or lowering is re-raised as ``ScheduleError`` carrying
  torch's message. We do not pre-validate: the point is to see torch's verdict.
* Without ``stages`` the runtime holds light stand-in stages (as torch's own
  ``_schedule_visualizer.get_schedule_ops`` does with mocks) and needs no process group: it can be
  inspected, not stepped. Pass the rank's real ``PipelineStage`` objects to get one that can
  ``step()``.
"""

from __future__ import annotations

import importlib
import os
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from steptune.pipeline.schedule import Schedule, ScheduleError

__all__ = [
    "load_into_torch_runtime",
    "torch_lowered_order",
    "torch_pipeline_order",
    "torch_stage_to_rank",
]

_SCHEDULES_MODULE = "torch.distributed.pipelining.schedules"


@dataclass(kw_only=True, slots=True)
class _StandInStage:
    """The attributes ``PipelineScheduleMulti.__init__`` reads from its stages, nothing more."""

    stage_index: int | None
    num_stages: int
    group_size: int
    group_rank: int
    submod: Any = None
    stage_index_to_group_rank: dict[int, int] | None = None
    """Set by torch: the default map in the constructor, then the inferred one after loading."""


def _runtime_class() -> type:
    """torch's ``_PipelineScheduleRuntime``, after checking it has what this module calls."""
    import torch

    try:
        schedules = importlib.import_module(_SCHEDULES_MODULE)
    except ImportError as exc:
        raise RuntimeError(
            f"torch {torch.__version__} has no usable {_SCHEDULES_MODULE} ({exc}); "
            "steptune's torch runtime adapter needs torch.distributed (torch>=2.11 built with distributed)"
        ) from exc
    runtime = getattr(schedules, "_PipelineScheduleRuntime", None)
    if runtime is None:
        raise RuntimeError(
            f"torch {torch.__version__} lacks {_SCHEDULES_MODULE}._PipelineScheduleRuntime; "
            "steptune's torch runtime adapter was written against torch 2.13"
        )
    for name in ("_load_csv", "_prepare_schedule_with_comms"):
        if not callable(getattr(runtime, name, None)):
            raise RuntimeError(
                f"torch {torch.__version__} lacks {_SCHEDULES_MODULE}._PipelineScheduleRuntime.{name}; "
                "steptune's torch runtime adapter was written against torch 2.13"
            )
    return runtime


def load_into_torch_runtime(
    schedule: Schedule,
    *,
    stages: Sequence[Any] | None = None,
    rank: int = 0,
    defer_pp_recv: bool = False,
    **runtime_kwargs: Any,
) -> Any:
    """A torch ``_PipelineScheduleRuntime`` whose order was loaded from ``schedule``'s CSV and lowered.

    ``stages`` are the rank's ``PipelineStage`` objects (default: stand-ins for the stages that
    ``schedule.placement`` puts on ``rank``); ``runtime_kwargs`` (``loss_fn``, ``scale_grads``, ...)
    go to the runtime's constructor. Raises ``ScheduleError`` with torch's message if torch
    rejects the schedule.
    """
    runtime_cls = _runtime_class()
    num_ranks = schedule.num_devices
    if not 0 <= rank < num_ranks:
        raise ValueError(f"rank {rank} is outside the schedule's {num_ranks} devices")
    if stages is None:
        # torch's constructor reads stages[0], so an idle rank still gets one stand-in; torch's
        # lowering then rejects the idle row itself.
        stage_ids: list[int | None] = list(schedule.stages_of(rank)) or [None]
        stages = [
            _StandInStage(
                stage_index=s, num_stages=schedule.num_stages, group_size=num_ranks, group_rank=rank
            )
            for s in stage_ids
        ]
    else:
        expected = schedule.stages_of(rank)
        got = sorted(s.stage_index for s in stages)
        if got != expected or any(s.group_rank != rank or s.group_size != num_ranks for s in stages):
            raise ValueError(
                f"rank {rank} of {num_ranks} must hold stages {expected} under placement "
                f"{schedule.placement}; got stages {got} (pass the rank's own PipelineStage objects)"
            )
    if defer_pp_recv:  # only passed when asked: older torch has no such keyword
        runtime_kwargs["defer_pp_recv"] = True
    runtime = runtime_cls(list(stages), schedule.num_microbatches, **runtime_kwargs)

    # Not named after the schedule: names like "list(+1,IW)/v/searched" hold path separators.
    fd, path = tempfile.mkstemp(prefix="steptune-schedule-", suffix=".csv")
    try:
        with os.fdopen(fd, "w", newline="") as f:
            f.write(schedule.to_csv())
        try:
            runtime._load_csv(path, format="compute_only")
        except (AssertionError, ValueError, RuntimeError) as exc:
            # torch validates and lowers with asserts (AssertionError), plus ValueError/RuntimeError
            # for malformed actions; all of them mean "this schedule cannot run".
            raise ScheduleError(
                f"torch's pipeline runtime rejected schedule {schedule.name!r}: {exc}"
            ) from exc
    finally:
        os.unlink(path)
    return runtime


def _strings(order: dict[int, list[Any]]) -> dict[int, list[str]]:
    return {rank: [str(a) for a in actions if a is not None] for rank, actions in sorted(order.items())}


def torch_pipeline_order(schedule: Schedule) -> dict[int, list[str]]:
    """The compute-only order torch holds after loading ``schedule``: rank -> action strings."""
    return _strings(load_into_torch_runtime(schedule).pipeline_order)


def torch_lowered_order(schedule: Schedule, *, defer_pp_recv: bool = False) -> dict[int, list[str]]:
    """The order torch executes, with SEND/RECV (and UNSHARD/RESHARD, REDUCE_GRAD) actions added."""
    runtime = load_into_torch_runtime(schedule, defer_pp_recv=defer_pp_recv)
    return _strings(runtime.pipeline_order_with_comms)


def torch_stage_to_rank(schedule: Schedule) -> dict[int, int]:
    """The stage -> rank map torch infers from ``schedule``'s CSV."""
    return dict(sorted(load_into_torch_runtime(schedule).stage_index_to_group_rank.items()))
