"""Side-by-side measurement of TapeSAC against torch's own checkpointing on the same model and batch.

Policies (all applied to the same blocks, removed afterwards):
- ``no_ac``: plain training.
- ``full_ac``: ``torch.utils.checkpoint.checkpoint(use_reentrant=False)``, early stop on (torch's
  default; HF's ``gradient_checkpointing_enable`` uses it).
- ``full_ac_no_early_stop``: the same with ``early_stop=False`` (torchtitan's setting).
- ``tapesac_replay``: :func:`apply_tapesac_` with an empty save set (replay only).

Work is counted in backward by a dispatch mode (ops and torch's FLOP formulas): the recomputation
a policy adds is its backward count minus ``no_ac``'s, so every policy is measured the same way.
Peak memory is torch's storage-level ``MemTracker`` (total bytes, all categories).
"""

from __future__ import annotations

import contextlib
import functools
import statistics
import time
import weakref
from collections import Counter
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from steptune.memory.anchors import ANCHORS, apply_anchor_, remove_anchor_
from steptune.memory.apply import TapeSACConfig, apply_tapesac_, find_blocks
from steptune.memory.profile import grads_kept
from steptune.memory.record import op_flops
from steptune.memory.reuse import TemplateCache

__all__ = [
    "POLICIES",
    "OpCounter",
    "Work",
    "apply_policy",
    "grads",
    "head_peak_probe",
    "max_abs_diff",
    "measure_last_free",
    "measure_peak",
    "measure_work",
    "phase_probe",
    "single_thread",
    "time_policies",
]

_TEMPLATES: weakref.WeakKeyDictionary[nn.Module, TemplateCache] = weakref.WeakKeyDictionary()
POLICIES = ("no_ac", "full_ac", "full_ac_no_early_stop", "tapesac_replay")


class OpCounter(TorchDispatchMode):
    """Counts aten ops, their FLOPs (torch's FlopCounterMode formulas) and the bytes of fresh
    outputs (views and in-place results excluded), the measure of pointwise work."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: Counter[str] = Counter()
        self.flops = 0
        self.bytes_written = 0

    def __torch_dispatch__(
        self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: Any = None
    ) -> Any:
        from torch.utils._pytree import tree_flatten

        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        self.ops[str(func)] += 1
        self.flops += op_flops(func, args, kwargs, out)
        inputs = {
            a.untyped_storage()._cdata for a in tree_flatten((args, kwargs))[0] if isinstance(a, torch.Tensor)
        }
        for o in tree_flatten(out)[0]:
            if isinstance(o, torch.Tensor) and o.untyped_storage()._cdata not in inputs:
                self.bytes_written += o.numel() * o.element_size()
        return out


@contextlib.contextmanager
def apply_policy(model: nn.Module, policy: str, blocks: Any = None, plan: Any = None) -> Iterator[Any]:
    """Apply one of :data:`POLICIES`, an anchor of :mod:`steptune.memory.anchors` (``plan``: the
    context of a ``torch_auto_sac@...`` anchor), or
    ``tapesac_plan@...`` (with ``plan``) to ``model``'s blocks for the duration of the context."""
    if policy == "no_ac":
        yield None
        return
    if policy == "tapesac_replay" or policy.startswith("tapesac_plan"):
        if policy.startswith("tapesac_plan") and plan is None:
            raise ValueError(f"policy {policy!r} needs a plan (steptune.memory.plan.plan_saves)")
        # Tapes persist across applications on the same model, as they do across steps in training.
        templates = _TEMPLATES.setdefault(model, TemplateCache())
        config = TapeSACConfig(blocks=blocks, plan=plan if policy != "tapesac_replay" else None)
        handle = apply_tapesac_(model, config, templates=templates)
        try:
            yield handle
        finally:
            handle.remove()
        return
    if policy in ANCHORS or policy.startswith("torch_auto_sac"):
        wrapped_blocks = apply_anchor_(policy, find_blocks(model, blocks), plan)
        try:
            yield None
        finally:
            remove_anchor_(wrapped_blocks)
        return
    if policy not in ("full_ac", "full_ac_no_early_stop"):
        raise ValueError(f"unknown policy {policy!r}; choose one of {POLICIES + ANCHORS}")
    early_stop = policy == "full_ac"
    wrapped = find_blocks(model, blocks)
    for _, block in wrapped:
        block.forward = functools.partial(_checkpointed, block.forward, early_stop)  # type: ignore[method-assign]
    try:
        yield None
    finally:
        for _, block in wrapped:
            del block.forward


def _checkpointed(forward: Callable[..., Any], early_stop: bool, *args: Any, **kwargs: Any) -> Any:
    from torch.utils.checkpoint import checkpoint

    if not torch.is_grad_enabled():
        return forward(*args, **kwargs)
    return checkpoint(forward, *args, use_reentrant=False, early_stop=early_stop, **kwargs)


def _loss(model: nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    out = model(**batch)
    return out.loss if hasattr(out, "loss") else out


def grads(
    model: nn.Module,
    batch: dict[str, torch.Tensor],
    policy: str,
    blocks: Any = None,
    plans: Mapping[str, Any] | None = None,
) -> dict[str, torch.Tensor]:
    model.zero_grad(set_to_none=True)
    with apply_policy(model, policy, blocks, (plans or {}).get(policy)):
        _loss(model, batch).backward()
    out = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    return out


def max_abs_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    if a.keys() != b.keys():
        raise ValueError(f"gradient sets differ: {sorted(a.keys() ^ b.keys())[:5]}")
    return max(float((a[k].float() - b[k].float()).abs().max()) for k in a)


@dataclass(frozen=True, slots=True)
class Work:
    backward_ops: int
    backward_flops: int
    backward_bytes: int
    ops: dict[str, int]


def measure_work(
    model: nn.Module,
    batch: dict[str, torch.Tensor],
    policy: str,
    blocks: Any = None,
    plans: Mapping[str, Any] | None = None,
) -> Work:
    """Ops and FLOPs dispatched during backward under ``policy`` (recomputation included)."""
    model.zero_grad(set_to_none=True)
    with apply_policy(model, policy, blocks, (plans or {}).get(policy)):
        loss = _loss(model, batch)
        counter = OpCounter()
        with counter:
            loss.backward()
    model.zero_grad(set_to_none=True)
    return Work(sum(counter.ops.values()), counter.flops, counter.bytes_written, dict(counter.ops))


def measure_peak(
    model: nn.Module,
    batch: dict[str, torch.Tensor],
    policy: str,
    blocks: Any = None,
    plans: Mapping[str, Any] | None = None,
    head: list[int] | None = None,
    phases: list[int] | None = None,
) -> tuple[int, int]:
    """``(peak, static)`` bytes of one forward+backward by torch's ``MemTracker`` (all live
    storages). Gradients are allocated before the step, as a training loop's are after its first
    step, so ``peak - static`` is the step's activation and temporary peak. ``head``, if given,
    receives the peak before the last block's backward (see :func:`head_peak_probe`). ``phases``, if
    given, receives each phase's own peak: before the last block's backward (the head), during it, and
    after it (the other blocks); fewer when a boundary was not seen (a last block whose input needs no
    gradient) or this torch's ``MemTracker`` cannot restart its peak."""
    from torch.distributed._tools.mem_tracker import MemTracker

    if getattr(model, "_tapesac", None) is not None:  # a sweep: no_ac gave the replay-only peak, and
        # calibrating from it put every fraction at the floor
        raise ValueError(
            f"TapeSAC is already applied to this model, so measure_peak's policy {policy!r} would measure "
            "TapeSAC: call .remove() on its handle first (measure_peak applies each policy itself)"
        )
    with grads_kept(model):
        return _measure_peak(model, batch, policy, blocks, plans, head, phases, MemTracker)


def _measure_peak(
    model: nn.Module, batch: Mapping[str, Any], policy: str, blocks: Any, plans: Mapping[str, Any] | None,
    head: list[int] | None, phases: list[int] | None, MemTracker: Any,
) -> tuple[int, int]:  # fmt: skip
    for p in model.parameters():
        if p.requires_grad:
            p.grad = torch.zeros_like(p)
    storages = {
        t.untyped_storage()._cdata: t.untyped_storage().nbytes() for t in _static_tensors(model, batch)
    }
    with apply_policy(model, policy, blocks, (plans or {}).get(policy)):
        tracker = MemTracker()
        tracker.track_external(model, *batch.values())

        def so_far() -> int:
            return max(int(d["Total"]) for d in tracker.get_tracker_snapshot("peak").values())

        marks: list[int] = []
        restart = _peak_restarter(tracker) if phases is not None else None

        def mark() -> int:
            marks.append(so_far())
            if restart is not None:
                restart()
            return marks[-1]

        probe = (
            phase_probe(model, blocks, mark, head, with_input=restart is not None)
            if head is not None or phases is not None
            else contextlib.nullcontext()
        )
        with _quiet_mod_tracker(), tracker, probe:
            _loss(model, batch).backward()
        marks.append(so_far())
    model.zero_grad(set_to_none=True)
    if phases is not None and restart is not None:
        phases.extend(marks)
    return max(marks), sum(storages.values())


def measure_last_free(
    model: nn.Module, batch: dict[str, torch.Tensor], profiles: Mapping[Any, Any], blocks: Any = None
) -> tuple[int, list[int], list[int]]:
    """The calibration step whose last block keeps every packed value (``plan.last_free_plan``): its peak,
    its head peak (``head``) and its phase peaks (``phases``), as ``plan.calibrate`` takes them."""
    from steptune.memory.plan import last_free_plan

    head: list[int] = []
    phases: list[int] = []
    plans = {"tapesac_plan": last_free_plan(dict(profiles))}
    peak, _ = measure_peak(model, batch, "tapesac_plan", blocks, plans, head=head, phases=phases)
    return peak, head, phases


def _peak_restarter(tracker: Any) -> Callable[[], None] | None:
    """A function that starts ``tracker``'s peak again from the current usage (what ``MemTracker``'s own
    ``__enter__`` does), so each phase's peak is read apart; None where this torch's tracker lacks the
    attributes (the phases are then not measured)."""
    if not (hasattr(tracker, "_peak_mem") and hasattr(tracker, "_peak_mem_snap")):
        return None

    def restart() -> None:
        snap = tracker.get_tracker_snapshot("current")
        tracker._peak_mem_snap = snap
        tracker._peak_mem = {dev: dev_snap["Total"] for dev, dev_snap in snap.items()}

    return restart


@contextlib.contextmanager
def _quiet_mod_tracker() -> Iterator[None]:
    """MemTracker's ModTracker warns "The module hierarchy tracking maybe be messed up. Please file a bug
    to PyTorch" when checkpointing reruns a block's forward inside backward (a module entered again while
    it is still a parent). Only its per-module attribution is affected, not the storage-level total used
    here, so the warning (5 of them per `steptune demo`) is dropped; torch also replaces
    ``warnings.formatwarning`` process-wide there, which is put back."""
    import warnings

    fmt = warnings.formatwarning
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="The module hierarchy tracking maybe be messed up")
        try:
            yield
        finally:
            warnings.formatwarning = fmt


@contextlib.contextmanager
def head_peak_probe(
    model: nn.Module, blocks: Any, read_peak: Callable[[], int], out: list[int]
) -> Iterator[None]:
    """Append to ``out`` the peak so far (``read_peak()``) when the gradient reaches the last block's
    output: the forward, the loss and the head's backward are done, and no block has replayed yet.
    The step peak can sit there (a large vocabulary's logits) rather than in a block's backward, and
    then keeping a value does not shrink it by the replay it saves (the peak model's ``head``)."""
    with phase_probe(model, blocks, read_peak, out, with_input=False):
        yield


@contextlib.contextmanager
def phase_probe(
    model: nn.Module, blocks: Any, mark: Callable[[], int], head: list[int] | None, with_input: bool
) -> Iterator[None]:
    """Call ``mark()`` (which reads the peak so far and starts the next phase's) when the gradient reaches
    the last block's output (its value goes to ``head``) and,
    ``with_input``, when it reaches the last block's input (the last block's backward is done: in
    a plan that keeps all of its values, the other blocks' kept values are alive there but nothing
    replays, so its peak is not a replaying block's, found in a sweep)."""
    last = find_blocks(model, blocks)[-1][1]

    def at_output(_grad: torch.Tensor) -> None:
        value = mark()
        if head is not None:
            head.append(value)

    def at_input(_grad: torch.Tensor) -> None:
        mark()

    def on_output(_module: nn.Module, _args: Any, output: Any) -> None:
        t = output[0] if isinstance(output, (tuple, list)) else output
        if isinstance(t, torch.Tensor) and t.requires_grad:
            t.register_hook(at_output)

    def on_input(_module: nn.Module, args: Any, kwargs: Any) -> None:
        for t in (*args, *kwargs.values()):
            if isinstance(t, torch.Tensor) and t.requires_grad:
                t.register_hook(at_input)
                return

    handles = [last.register_forward_hook(on_output)]
    if with_input:
        handles.append(last.register_forward_pre_hook(on_input, with_kwargs=True))
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()


def _static_tensors(model: nn.Module, batch: dict[str, torch.Tensor]) -> list[torch.Tensor]:
    out = [*model.parameters(), *model.buffers(), *batch.values()]
    out += [p.grad for p in model.parameters() if p.grad is not None]
    return out


def time_policies(
    model: nn.Module,
    batch: dict[str, torch.Tensor],
    policies: tuple[str, ...],
    repeats: int = 7,
    progress: Callable[[int, int], None] | None = None,
    *,
    warmup: int = 1,
    blocks: Any = None,
    plans: Mapping[str, Any] | None = None,
) -> dict[str, list[float]]:
    """Step times (forward+backward) per policy, interleaved round by round on the same batch."""
    times: dict[str, list[float]] = {p: [] for p in policies}
    total = (repeats + warmup) * len(policies)
    done = 0
    for r in range(repeats + warmup):
        for policy in policies:
            with apply_policy(model, policy, blocks, (plans or {}).get(policy)):
                model.zero_grad(set_to_none=True)
                start = time.perf_counter()
                _loss(model, batch).backward()
                elapsed = time.perf_counter() - start
            if r >= warmup:
                times[policy].append(elapsed)
            done += 1
            if progress is not None:
                progress(done, total)
    model.zero_grad(set_to_none=True)
    return times


def median(xs: list[float]) -> float:
    return statistics.median(xs)


def single_thread(fn: Callable[..., Any], *args: Any) -> Any:
    """Run ``fn`` on one intra-op thread: multi-threaded CPU reductions in MoE backward (index
    accumulation) sum in a run-dependent order, so even two plain runs differ in the last bit."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return fn(*args)
    finally:
        torch.set_num_threads(threads)
