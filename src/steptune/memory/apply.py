"""`apply_tapesac_(model, config)`: wrap a model's blocks with the dispatcher tape, no forward edits.

Contract: each selected block's instance ``forward`` is replaced by a wrapper (the class is left
alone, so hooks registered on the module, FSDP2's included, still run around it); ``remove()``
restores it. Under grad mode a block call runs its original forward under a recording
TorchDispatchMode and saved-tensor hooks; internal values autograd packs are dropped and replayed
on the first unpack in backward. Without grad mode the block runs untouched.
"""

from __future__ import annotations

import copy
import dataclasses
import difflib
import fnmatch
import functools
import warnings
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.utils._pytree import tree_flatten

from steptune.memory.frame import Frame, ReplayStats, pack_hook, unpack_hook
from steptune.memory.inner import flattened_checkpoints
from steptune.memory.record import PureOps, Recorder, _external_key
from steptune.memory.reuse import (
    TemplateCache,
    run_reused,
    seed_casts,
    signature,
    signature_difference,
    template_from,
    unkeyable_argument,
)
from steptune.memory.tape import READS_WRITTEN, ExternalRef, OpNode, Tape, TapeSACError

__all__ = ["SavePlan", "TapeSAC", "TapeSACConfig", "apply_tapesac_", "find_blocks"]


@dataclass(frozen=True, slots=True)
class SavePlan:
    """Per block signature, the indices (in autograd's pack order) of the packed values to keep;
    a block's FQN as key overrides its signature's entry for that block."""

    saves: dict[Any, frozenset[int]]
    limit: int | None = None
    """The step-peak limit (bytes) the plan was made for; None when unknown (a hand-made plan)."""
    num_blocks: int | None = None
    """How many blocks the profiled model had; applying to another count warns (the limit no longer
    holds). None when unknown."""


@dataclass(kw_only=True, slots=True)
class TapeSACConfig:
    blocks: str | tuple[type[nn.Module], ...] | None = None
    """Which modules are blocks: an FQN pattern (``"model.layers.*"``), a class name
    (``"Qwen3DecoderLayer"``), a tuple of classes, or None for HF ``GradientCheckpointingLayer``s."""
    save_ops: frozenset[str] = frozenset()
    """Aten ops whose outputs are saved instead of replayed: ``{"aten.mm.default"}``, ``"aten.mm"`` for
    every overload, or ``torch.ops`` objects; unknown names are refused. Empty means replay-only. The
    memory planner (issue #4) chooses per-value save sets instead."""
    save_fn: Callable[[OpNode], bool] | None = None
    """Advanced: decide per recorded node whether its outputs are saved."""
    pure_ops: frozenset[str] = frozenset()
    """Custom (``torch.library``) ops to replay and reuse tapes through, as aten ops are: name only ops
    that are deterministic, write nothing their schema hides and whose output shapes follow their input
    shapes (``{"mylib.fused_rmsnorm"}``). TapeSAC cannot see inside a custom op's kernel, so by default
    it holds their outputs from forward and records every call of a block that runs one (one block
    with a custom op trained 35% slower)."""
    reuse_tapes: bool = True
    """Record each block's first call per signature (shapes, dtypes, training flag, autocast) and reuse
    the tape while it provably cannot change (no random op, host sync or data-dependent shape); blocks
    whose first calls recorded the same tape share one. Later forwards then run without the dispatch
    mode. False records every call."""
    plan: SavePlan | None = None
    """Which packed values each block signature keeps instead of replaying (from
    :func:`steptune.memory.plan.plan_saves`); blocks it does not name are replay-only."""
    count_flops: bool = False
    """Price each recorded op with torch's FLOP formulas (for reports; costs a little per op)."""
    inner_checkpoint: str = "flatten"
    """torch's ``checkpoint`` called inside a block: ``"flatten"`` runs its region as plain code (TapeSAC
    recomputes the block anyway; keeping it recomputes the region twice), ``"keep"`` leaves it to torch
    (exact too, with a warning)."""


def find_blocks(
    model: nn.Module, blocks: str | tuple[type[nn.Module], ...] | None
) -> list[tuple[str, nn.Module]]:
    """The (FQN, module) pairs ``blocks`` selects, outermost only."""
    if isinstance(blocks, type):  # one class: the same as a tuple of it
        blocks = (blocks,)
    elif isinstance(blocks, list):
        blocks = tuple(blocks)
    ok = blocks is None or (isinstance(blocks, str) and blocks.strip() != "")  # "" named the root model
    ok = ok or (isinstance(blocks, tuple) and all(isinstance(c, type) for c in blocks))
    if not ok:
        raise TypeError(
            f"TapeSACConfig(blocks={blocks!r}): give an FQN pattern ('model.layers.*'), a class name "
            "('Qwen3DecoderLayer'), block classes ((Qwen3DecoderLayer,)), or None for HF decoder layers"
        )
    picked: list[tuple[str, nn.Module]] = []
    for name, module in model.named_modules():
        if any(p == "" or name.startswith(p + ".") for p, _ in picked):  # outermost only ("" is the root)
            continue
        if _is_block(name, module, blocks):
            picked.append((name, module))
    if not picked:
        raise ValueError(
            f"TapeSACConfig(blocks={blocks!r}) selected no module of {type(model).__name__}; pass an FQN "
            "pattern such as 'model.layers.*' or the decoder-layer class name"
        )
    lists = [(name, m) for name, m in picked if isinstance(m, nn.ModuleList | nn.ModuleDict)]
    if lists:  # containers are never called: wrapping one would checkpoint nothing, silently
        name, container = lists[0]
        raise ValueError(
            f"TapeSACConfig(blocks={blocks!r}) selected {name!r}, a {type(container).__name__}, which is "
            f"never called; select its children: '{name}.*'"
        )
    return picked


def _is_block(name: str, module: nn.Module, blocks: str | tuple[type[nn.Module], ...] | None) -> bool:
    if blocks is None:
        return any(c.__name__ == "GradientCheckpointingLayer" for c in type(module).__mro__[1:])
    if isinstance(blocks, tuple):
        return isinstance(module, blocks)
    if any(ch in blocks for ch in "*.?["):
        return fnmatch.fnmatchcase(name, blocks)
    return type(module).__name__ == blocks or name == blocks  # a class name, or one module's FQN


@dataclass(slots=True, weakref_slot=True)
class TapeSAC:
    """What :func:`apply_tapesac_` returns: the wrapped blocks, counters and ``remove()``.

    The model holds it (``model._tapesac``) and it holds the model weakly, and each block's wrapper holds
    the block and this handle weakly: applying adds no reference cycle, so a deleted model is freed at
    once. ``copy.deepcopy(model)`` gives a copy with its own handle (fresh counters and tapes) whose
    blocks run the copy's own weights."""

    model_ref: weakref.ReferenceType[nn.Module]
    config: TapeSACConfig
    blocks: list[tuple[str, nn.Module]]
    stats: ReplayStats = field(default_factory=ReplayStats)
    templates: TemplateCache = field(default_factory=TemplateCache)
    on_record: Callable[[str, Any, Tape, Recorder], None] | None = None
    """Called after each recorded forward (the profiler uses it)."""
    keep_outputs: bool = False
    """Recorders keep every tensor they see (the profiler; memory-hungry)."""
    warned_unkeyable: bool = False
    warned_inner: bool = False
    warned_unplanned: bool = False
    pure: PureOps = (frozenset(), frozenset())
    """``config.pure_ops`` checked: (overload names, packet names)."""

    @property
    def model(self) -> nn.Module | None:
        """The model (None once it was freed)."""
        return self.model_ref()

    def remove(self) -> None:
        for _, block in self.blocks:
            if isinstance(block.__dict__.get("forward"), _BlockForward) and block.forward.state is self:
                del block.forward
        self.blocks = []
        model = self.model
        if model is not None and getattr(model, "_tapesac", None) is self:
            del model._tapesac

    def __deepcopy__(self, memo: dict[int, Any]) -> TapeSAC:
        model = self.model
        if model is None:
            raise TypeError("this TapeSAC handle's model was freed; there is nothing to copy")
        # registered before the model is copied: each copied block's wrapper then finds this one copy
        new = TapeSAC(
            self.model_ref, self.config, [], on_record=self.on_record, keep_outputs=self.keep_outputs
        )
        memo[id(self)] = new
        new.model_ref = weakref.ref(copy.deepcopy(model, memo))
        new.blocks = [(name, copy.deepcopy(block, memo)) for name, block in self.blocks]
        return new


class _BlockForward:
    """A block's instance ``forward`` under TapeSAC: runs the class's forward through the recorder."""

    __slots__ = ("_block", "_state", "name", "save_fn")

    def __init__(self, state: TapeSAC, name: str, block: nn.Module) -> None:
        self._state = weakref.ref(state)
        self._block = weakref.ref(block)
        self.name = name
        self.save_fn = _save_fn(state.config)

    @property
    def state(self) -> TapeSAC | None:
        return self._state()

    # Dynamo cannot trace the recorder (a dispatch mode, saved-tensor hooks, storage keys); without this it
    # would break its graph many times inside each block instead of once around it.
    @torch.compiler.disable
    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        block, state = self._block(), self._state()
        assert block is not None, "a block's forward outlived its block"
        forward = type(block).forward.__get__(block)
        if state is None:  # the model (which held the handle) is gone mid-call: run it plainly
            return forward(*args, **kwargs)
        return _run_block(state, self.name, block, forward, self.save_fn, *args, **kwargs)

    def __deepcopy__(self, memo: dict[int, Any]) -> _BlockForward:
        block, state = self._block(), self._state()
        if block is None or state is None:
            raise TypeError("cannot copy a TapeSAC block whose model was freed")
        return _BlockForward(copy.deepcopy(state, memo), self.name, copy.deepcopy(block, memo))

    def __reduce__(self) -> Any:
        raise TypeError(
            f"a model with TapeSAC applied cannot be pickled whole (block {self.name!r} runs TapeSAC's "
            "wrapper): save model.state_dict(), or call the handle's remove() first and apply_tapesac_ "
            "again after loading"
        )


def apply_tapesac_(
    model: nn.Module, config: TapeSACConfig | None = None, *, templates: TemplateCache | None = None
) -> TapeSAC:
    """Wrap ``model``'s blocks in place; returns a :class:`TapeSAC` whose ``remove()`` undoes it.
    Pass an earlier handle's ``templates`` to keep its recorded tapes across remove/apply."""
    config = config or TapeSACConfig()
    if config.inner_checkpoint not in ("flatten", "keep"):
        raise ValueError(
            f"TapeSACConfig(inner_checkpoint={config.inner_checkpoint!r}): use 'flatten' (default) or 'keep'"
        )
    if getattr(model, "_tapesac", None) is not None:
        raise ValueError("TapeSAC is already applied to this model; call .remove() on it first")
    if config.plan is not None and not isinstance(config.plan, SavePlan):
        hint = (
            "call plan.save_plan(profiles) on the planner's MemoryPlan"
            if hasattr(config.plan, "save_plan")
            else "build one with steptune.memory.plan.plan_saves(...).save_plan(profiles)"
        )
        raise TypeError(
            f"TapeSACConfig(plan=...) takes a SavePlan, got a {type(config.plan).__name__}: {hint}"
        )
    blocks = find_blocks(model, config.blocks)
    if config.plan is not None:
        checked = _checked_plan(config.plan, [name for name, _ in blocks])
        if checked is not config.plan:
            config = dataclasses.replace(config, plan=checked)
        if config.save_ops or config.save_fn is not None:  # a sweep: 9.5 MB measured under a 7.97 MB plan
            chosen = "save_ops" if config.save_ops else "save_fn"
            warnings.warn(
                f"TapeSACConfig({chosen}=..., plan=...): the values {chosen} chooses are held on top of the "
                "plan's, which was made without them, so the plan's step-peak limit no longer holds. Leave "
                f"{chosen} out to keep the limit, or the plan out to save by op alone",
                stacklevel=2,
            )
        planned = getattr(config.plan, "num_blocks", None)  # a plan pickled before it had the field
        if planned is not None and planned != len(blocks):  # a sweep: 3 layers' plan on 4, over its limit
            limit = getattr(config.plan, "limit", None)
            warnings.warn(
                f"TapeSACConfig(plan=...): the plan was made for a model with {planned} blocks and this one "
                f"has {len(blocks)}: each block of a signature keeps what the plan keeps, so its step-peak "
                f"limit{f' ({limit} bytes)' if limit is not None else ''} no longer holds. Profile and plan "
                "this model",
                stacklevel=2,
            )
    state = TapeSAC(weakref.ref(model), config, blocks)
    if templates is not None:
        state.templates = templates
    _save_fn(config)  # checks save_ops before anything is wrapped
    state.pure = pure_op_names(config.pure_ops)
    nested = _wrapping(model, state.blocks, _checkpoints)
    if nested is not None:
        raise ValueError(
            f"{nested} already checkpoints activations: torch's checkpoint would take over and "
            "TapeSAC would replay nothing. TapeSAC replaces it: turn it off (HF: "
            f"model.{_HF_DISABLE}) or build the model without torch's checkpoint_wrapper, then "
            "apply_tapesac_"
        )
    compiled = _wrapping(model, state.blocks, _compiles)
    if compiled is not None:
        warnings.warn(
            f"TapeSAC: {compiled}. TapeSAC records eager blocks at the "
            "dispatcher, so each block runs eagerly inside the compiled region (one graph break per "
            "block): gradients are exact, but the blocks lose the compile's speed-up. Apply TapeSAC to "
            "an uncompiled model, or for a compiled one use torch.compile's own activation memory "
            "budget (torch._functorch.config.activation_memory_budget)",
            stacklevel=2,
        )
    taken = [name for name, block in state.blocks if "forward" in block.__dict__]
    compiled_blocks = [name for name, block in state.blocks if type(block).__name__ == "OptimizedModule"]
    if compiled_blocks:  # torchtitan's per-block compile: m.layers[i] = torch.compile(m.layers[i])
        raise ValueError(
            f"block(s) {compiled_blocks} are torch.compile'd modules (OptimizedModule): TapeSAC records "
            "eager blocks, so match the modules inside them, e.g. TapeSACConfig(blocks="
            "'<pattern>._orig_mod') or the block class (each then runs eagerly inside the compiled "
            "region), or apply TapeSAC before compiling"
        )
    if taken:  # checked for every block before any is wrapped: a refusal leaves the model as it was
        raise ValueError(
            f"block(s) {taken} already have an instance-level forward (another wrapper, such as an "
            "accelerate hook or a checkpoint patch): remove it, or leave those blocks out with "
            "TapeSACConfig(blocks=...)"
        )
    for name, block in state.blocks:
        block.forward = _BlockForward(state, name, block)  # type: ignore[method-assign]
    model._tapesac = state  # type: ignore[assignment]
    return state


_HF_DISABLE = "activation_checkpointing_disable() (gradient_checkpointing_disable() before transformers 5)"


def _checked_plan(plan: SavePlan, names: list[str]) -> SavePlan:
    """``plan`` checked against the wrapped blocks' names: a dict of block FQN or signature to pack indices
    (non-negative ints; a list, tuple or set of them is taken as a frozenset). Unchecked, a misspelled name
    or a negative index was ignored silently and a list value failed deep in the first forward."""
    saves = plan.saves
    if not isinstance(saves, dict):
        raise TypeError(
            f"SavePlan.saves must be a dict of block FQN (or block signature) to pack indices, got a "
            f"{type(saves).__name__}: build it with plan_saves(...).save_plan(profiles), or write "
            "SavePlan({'model.layers.0': frozenset({0, 3})})"
        )
    out: dict[Any, frozenset[int]] = {}
    for key, indices in saves.items():
        where = f"SavePlan entry {key!r}" if isinstance(key, str) else "a SavePlan signature entry"
        if not isinstance(key, str | tuple):
            raise TypeError(
                f"SavePlan key {key!r} ({type(key).__name__}): keys are block FQNs such as "
                f"{names[0]!r} or the block signatures profile_model returns"
            )
        if isinstance(key, str) and key not in names:
            close = difflib.get_close_matches(key, names, n=1)
            hint = f"did you mean {close[0]!r}? " if close else ""
            shown = ", ".join(names[:4]) + (f", ... ({len(names)} in all)" if len(names) > 4 else "")
            raise ValueError(
                f"{where} names no block TapeSAC wraps ({shown}): {hint}a plan made for another model "
                "(or another blocks= pattern) does not fit this one; profile and plan this model"
            )
        if isinstance(indices, str | bytes) or not isinstance(
            indices, frozenset | set | list | tuple | range
        ):
            raise TypeError(
                f"{where} must be a collection of pack indices such as frozenset({{0, 3}}), got "
                f"{type(indices).__name__} {indices!r}"
            )
        bad = [i for i in indices if isinstance(i, bool) or not isinstance(i, int) or i < 0]
        if bad:
            raise ValueError(
                f"{where} holds {bad[0]!r}: pack indices are non-negative ints (positions in autograd's "
                "pack order, as MemoryPlan.save_plan writes them)"
            )
        out[key] = indices if isinstance(indices, frozenset) else frozenset(indices)
    if all(out[k] is saves[k] for k in out):
        return plan
    # getattr: a SavePlan pickled before it had limit and num_blocks lacks them
    return SavePlan(out, getattr(plan, "limit", None), getattr(plan, "num_blocks", None))


def _wrapping(
    model: nn.Module, blocks: list[tuple[str, nn.Module]], wraps: Callable[[nn.Module], str | None]
) -> str | None:
    """``wraps``'s description of the first module that is a block or contains one and for which
    ``wraps`` returns a description (a module around a block sees the block's calls too)."""
    for name, module in model.named_modules():
        what = wraps(module)
        if what is not None and any(not name or b == name or b.startswith(name + ".") for b, _ in blocks):
            return f"{what} {('module ' + repr(name)) if name else 'the model'}"
    return None


def _checkpoints(module: nn.Module) -> str | None:
    if getattr(module, "gradient_checkpointing", False) is True:
        return "HF gradient checkpointing on"
    return "torch's checkpoint_wrapper" if type(module).__name__ == "CheckpointWrapper" else None


def _compiles(module: nn.Module) -> str | None:
    compiled = getattr(module, "_compiled_call_impl", None) is not None
    return "torch.compile on" if compiled or type(module).__name__ == "OptimizedModule" else None


def _save_fn(config: TapeSACConfig) -> Callable[[OpNode], bool] | None:
    if config.save_fn is not None:
        return config.save_fn
    if not config.save_ops:
        return None
    exact, packets = save_op_names(config.save_ops)
    return lambda node: node.name in exact or node.name.rpartition(".")[0] in packets


def pure_op_names(pure_ops: Any) -> PureOps:
    """``TapeSACConfig.pure_ops`` checked as :func:`save_op_names` checks ``save_ops``; aten and prims ops
    are refused, since TapeSAC judges them by their tags."""
    exact, packets = save_op_names(pure_ops, "pure_ops")
    for name in sorted(exact | packets):
        if name.split(".")[0] in ("aten", "prims"):
            raise ValueError(
                f"TapeSACConfig.pure_ops: {name} is a torch op, which TapeSAC already judges by its tags "
                "(random, host sync, data-dependent shape); pure_ops is for custom torch.library ops"
            )
    return exact, packets


def save_op_names(save_ops: Any, what: str = "save_ops") -> tuple[frozenset[str], frozenset[str]]:
    """``TapeSACConfig.save_ops`` (or another op-name field, ``what``) checked against the op registry:
    (overload names such as ``"aten.mm.default"``, packet names such as ``"aten.mm"``, which stand for
    every overload). Accepts names, ``torch.ops.aten.mm.default`` and ``torch.ops.aten.mm``; anything
    else is an error that says what to write, since an unknown name would otherwise do nothing, silently."""
    field_name = f"TapeSACConfig.{what}"
    if isinstance(save_ops, str):
        raise TypeError(
            f"TapeSACConfig({what}={save_ops!r}) takes a collection of op names, not one string: "
            f"write {what}={{{save_ops!r}}}"
        )
    exact: set[str] = set()
    packets: set[str] = set()
    for op in save_ops:
        if isinstance(op, torch._ops.OpOverload):
            exact.add(str(op))
            continue
        if isinstance(op, torch._ops.OpOverloadPacket):
            packets.add(str(op))
            continue
        if not isinstance(op, str):
            raise TypeError(
                f"{field_name} holds {op!r} ({type(op).__name__}); use op names such as "
                "'aten.mm.default' or torch.ops.aten.mm.default"
            )
        parts = op.split(".")
        if len(parts) == 1:
            known = hasattr(torch.ops.aten, op)
            hint = (
                f"'aten.{op}.default' (one overload) or 'aten.{op}' (every overload)"
                if known
                else "a namespaced name such as 'aten.mm.default'"
            )
            raise ValueError(f"{field_name}: {op!r} names no op; write {hint}")
        if len(parts) > 3:
            raise ValueError(f"{field_name}: {op!r} is not 'namespace.op' or 'namespace.op.overload'")
        try:
            packet = getattr(getattr(torch.ops, parts[0]), parts[1])
        except (AttributeError, RuntimeError):
            raise ValueError(
                f"{field_name}: no op {parts[0]}.{parts[1]} is registered (names look like "
                "'aten.mm.default'; custom ops must be registered before apply_tapesac_)"
            ) from None
        if len(parts) == 2:
            packets.add(op)
        elif parts[2] in packet.overloads():
            exact.add(op)
        else:
            raise ValueError(
                f"{field_name}: {parts[0]}.{parts[1]} has no overload {parts[2]!r}; it has "
                f"{', '.join(packet.overloads())} ('{parts[0]}.{parts[1]}' for all of them)"
            )
    for name in sorted(exact | packets):
        _refuse_decomposed(name, what)
    return frozenset(exact), frozenset(packets)


_BECOMES = {
    "linear": "aten.mm / aten.addmm",
    "matmul": "aten.mm / aten.bmm",
    "softmax": "aten._softmax",
    "log_softmax": "aten._log_softmax",
    "layer_norm": "aten.native_layer_norm",
    "dropout": "aten.native_dropout",
    "scaled_dot_product_attention": "aten._scaled_dot_product_flash_attention_for_cpu on CPU, "
    "aten._scaled_dot_product_efficient_attention / _flash_attention on CUDA",
}


def _refuse_decomposed(name: str, what: str = "save_ops") -> None:
    """An op whose every named overload is CompositeImplicitAutograd decomposes before the recorder sees
    it, so saving it would save nothing (found in a sweep: ``aten.linear`` was taken, silently)."""
    ns, op, *overload = name.split(".")
    packet = getattr(getattr(torch.ops, ns), op)
    # ``out=`` variants are not what modules call in training (and are not composite): left out
    overloads = overload or [o for o in packet.overloads() if not (o == "out" or o.endswith("_out"))]
    cia = torch._C.DispatchKey.CompositeImplicitAutograd
    if overloads and all(getattr(packet, o).has_kernel_for_dispatch_key(cia) for o in overloads):
        becomes = _BECOMES.get(op)
        hint = f"name what it becomes ({becomes})" if becomes else "name the ops it decomposes into"
        effect = "saving it would save nothing" if what == "save_ops" else "the recorder judges those instead"
        raise ValueError(
            f"TapeSACConfig.{what}: {name} decomposes into other ops before TapeSAC's recorder sees it "
            f"(CompositeImplicitAutograd), so {effect}; {hint}"
        )


def _run_block(
    state: TapeSAC,
    name: str,
    block: nn.Module,
    forward: Callable[..., Any],
    save_fn: Callable[[OpNode], bool] | None,
    *args: Any,
    **kwargs: Any,
) -> Any:
    if not torch.is_grad_enabled():
        return forward(*args, **kwargs)
    if torch._C._functorch.peek_interpreter_stack() is not None:
        # under torch.func (grad, vmap, jvp): its wrapped tensors have no storage to key or record, and
        # its transforms take the gradients themselves; the block runs as it is (found in a 2026-12-05 sweep:
        # "Cannot access storage of TensorWrapper")
        return forward(*args, **kwargs)
    if state.config.inner_checkpoint == "flatten":
        forward = functools.partial(_flattened, state, name, forward)
    if getattr(block, "gradient_checkpointing", False) is True and block.training:
        raise TapeSACError(
            f"HF gradient checkpointing was enabled on TapeSAC block {name!r} after apply_tapesac_; "
            f"torch's checkpoint would take over from TapeSAC. Call model.{_HF_DISABLE}"
        )
    stats = state.stats
    stats.forwards += 1
    plan = state.config.plan
    wants_key = state.config.reuse_tapes or plan is not None or state.on_record is not None
    key = signature(block, args, kwargs) if wants_key else None
    if key is None and state.config.reuse_tapes and not state.warned_unkeyable:
        state.warned_unkeyable = True
        warnings.warn(_unkeyable_message(name, unkeyable_argument(args, kwargs)), stacklevel=3)
    if plan is None:
        keep: frozenset[int] = frozenset()
    else:  # by name first (the last block, a block whose tape differs from its signature's), even if empty
        keep = plan.saves[name] if name in plan.saves else plan.saves.get(key, frozenset())
    if (
        plan is not None
        and not state.warned_unplanned
        and name not in plan.saves
        and key not in plan.saves
        and any(not isinstance(k, str) for k in plan.saves)  # planned per signature, and not this one
    ):
        state.warned_unplanned = True
        why = signature_difference(key, list(plan.saves), args, kwargs) or "a call the plan never saw"
        warnings.warn(
            f"TapeSAC block {name!r} runs with inputs its SavePlan has no entry for ({why}): it replays "
            "everything (replay-only, slower than planned). Profile and plan the way you train (mode, "
            "autocast, arguments, shapes), or key the plan by block name",
            stacklevel=3,
        )
    # the save policy is part of a template's identity: a tape recorded under another policy (an earlier
    # handle's templates=) must not stand in for this one
    policy = (frozenset(state.config.save_ops), state.config.save_fn, state.pure)
    tkey = state.templates.key(name, (key, keep, *policy))
    if key is not None and state.config.reuse_tapes:
        template = state.templates.usable(name, tkey)
        if template is not None:
            return run_reused(template, Frame(name, stats), block, forward, args, kwargs)
    externals = _external_map(block, args, kwargs)
    recorder = Recorder(externals, save_fn=save_fn, count_flops=state.config.count_flops, pure_ops=state.pure)
    recorder.keep_outputs = state.keep_outputs
    frame = Frame(name, stats)

    # Every tensor autograd saves holds this hook until backward: it must not hold the recorder (and its
    # captured values and block inputs) past the forward, so it reaches the recorder through a box that
    # is emptied once the forward ends.
    box: list[Recorder | None] = [recorder]
    packed: list[Any] = []  # weak references to this call's packs, for seed_casts (none kept alive)

    def pack(t: torch.Tensor) -> Any:
        rec = box[0]
        assert rec is not None, "a TapeSAC pack hook ran after its block's forward ended"
        value = rec.on_pack(t)
        packed.append(weakref.ref(t._base if t._base is not None else t))
        return pack_hook(frame, value, t, keep=len(rec.packs) - 1 in keep)

    recorder.pack_fn = pack
    try:
        hooks = torch.autograd.graph.saved_tensors_hooks(pack, unpack_hook)
        with hooks, recorder.opaque_functions(), recorder:
            out = forward(*args, **kwargs)
    finally:
        # pack -> recorder -> pack is a reference cycle: left in place it keeps the recorder's block inputs
        # (activations, on the GPU) alive after backward until the cyclic collector runs
        recorder.pack_fn = None
        box[0] = None
    if (recorder.inner_checkpoint or recorder.inner_hooks) and not state.warned_inner:
        state.warned_inner = True
        warnings.warn(_inner_hooks_message(name, recorder), stacklevel=3)
    tape = recorder.tape()
    if keep and max(keep) >= len(tape.packs):
        raise ValueError(
            f"TapeSAC block {name!r}: its SavePlan entry keeps pack index {max(keep)}, but the block packs "
            f"{len(tape.packs)} values (indices 0 to {len(tape.packs) - 1}): the plan was made for another "
            "model or block; profile and plan this one"
        )
    _mark_readers_of_written_externals(tape)
    stats.recorded += 1
    stats.record_s += recorder.seconds
    for node in tape.nodes:
        if node.force_save is not None:
            stats.force_saved[node.force_save] += 1
    frame.close(
        tape,
        None,
        {s.sid: s.external.tensor for s in tape.slots if s.external and s.external.tensor is not None},
    )
    if state.on_record is not None:
        state.on_record(name, key, tape, recorder)
    if key is not None and state.config.reuse_tapes and not state.templates.seen_ineligible(tkey):
        assert frame.plan is not None
        # each block's first call under a signature is recorded: it shares the signature's template only
        # if it recorded the same tape (TemplateCache)
        template = state.templates.get(tkey)
        if template is None:
            template = template_from(tape, frame.plan, keep)
            state.templates.put(tkey, template, name)
        elif not state.templates.admit(name, tkey, tape):
            template = template_from(tape, frame.plan, keep)
            state.templates.put(state.templates.key(name, tkey), template, name)
        if template is not None:
            seed_casts(block, template, packed)
    return out


def _flattened(state: TapeSAC, name: str, forward: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    with flattened_checkpoints() as seen:
        out = forward(*args, **kwargs)
    if seen.count and not state.warned_inner:
        state.warned_inner = True
        warnings.warn(
            f"TapeSAC block {name!r} calls torch's checkpoint inside its forward: TapeSAC runs that region "
            "as plain code, since it recomputes the block in backward anyway (keeping torch's checkpoint "
            "would recompute the region twice). TapeSACConfig(inner_checkpoint='keep') keeps it",
            stacklevel=4,
        )
    return out


def _inner_hooks_message(name: str, recorder: Recorder) -> str:
    if recorder.inner_checkpoint is None:
        return (
            f"TapeSAC block {name!r} runs saved-tensor hooks of its own ({recorder.inner_hooks}) inside "
            "its forward: the values autograd saves under them go to those hooks, not to TapeSAC "
            "(results are exact; TapeSAC still replays their producers where later values need them)"
        )
    return (
        f"TapeSAC block {name!r} runs torch's {recorder.inner_checkpoint} checkpoint inside its forward. "
        "The checkpointed region is recomputed twice in backward: once by TapeSAC's replay, for the "
        "values computed from the region's outputs, and once by torch's checkpoint. TapeSAC already "
        "recomputes the whole block: remove the checkpoint call inside it"
    )


def _unkeyable_message(name: str, arg_type: str | None) -> str:
    hint = (
        " An HF model passes its KV cache to every layer while config.use_cache is True; set "
        "model.config.use_cache = False for training (HF's own gradient checkpointing does the same)."
        if arg_type is not None and "Cache" in arg_type
        else ""
    )
    return (
        f"TapeSAC block {name!r} is called with a {arg_type} argument, which may steer its forward, so "
        "its tape cannot be reused: every forward is recorded under the dispatch mode (slower, results "
        f"unchanged).{hint}"
    )


def _external_map(
    block: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]
) -> dict[tuple[Any, ...], ExternalRef]:
    refs: dict[tuple[Any, ...], ExternalRef] = {}
    flat = [a for a in tree_flatten((args, kwargs))[0] if isinstance(a, torch.Tensor)]
    for i, t in enumerate(flat):
        refs.setdefault(_external_key(t), ExternalRef(kind="arg", index=i))
    for pname, p in block.named_parameters():
        refs.setdefault(_external_key(p), ExternalRef(kind="param", name=pname))
    for bname, b in block.named_buffers():
        refs.setdefault(_external_key(b), ExternalRef(kind="param", name=bname))
    return refs


def _mark_readers_of_written_externals(tape: Any) -> None:
    written = {s.group for s in tape.slots if s.external is not None and s.external.written}
    if not written:
        return
    for node in tape.nodes:
        if node.force_save is None and any(tape.slots[sid].group in written for sid, _ in node.reads):
            node.force_save = READS_WRITTEN
