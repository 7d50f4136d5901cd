"""Tape reuse: record each block's first call per signature, then run later forwards without the dispatch
mode; blocks whose first calls recorded the same tape share one template.

Contract: a recorded tape becomes a :class:`Template` only when nothing in it can vary with tensor
*values* between calls of the same signature: no random op (its generator state is per call), no
force-saved node (host syncs and data-dependent shapes make the op sequence value-dependent), no
captured external (only block arguments and the block's own parameters and buffers, found again
by position and name), and no saved value the pack hooks would not deliver. A reused forward runs
under saved-tensor hooks alone and matches autograd's packs to the template by order, checking
each one's shape and dtype; any mismatch raises :class:`TapeSACError` rather than replaying a
stale tape. The template holds no tensor.
"""

from __future__ import annotations

import re
import weakref
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

import torch
from torch import nn
from torch.utils._pytree import keystr, tree_flatten, tree_flatten_with_path

from steptune.memory.frame import Frame, pack_hook, unpack_hook
from steptune.memory.replay import ReplayPlan
from steptune.memory.tape import Tape, TapeSACError

__all__ = [
    "Template",
    "TemplateCache",
    "run_reused",
    "same_tape",
    "seed_casts",
    "signature",
    "signature_difference",
    "template_from",
    "unkeyable_argument",
]

_PRIMITIVES = (type(None), bool, int, float, str, torch.dtype, torch.device)


@dataclass(frozen=True, slots=True)
class Template:
    tape: Tape
    plan: ReplayPlan
    externals: tuple[tuple[int, str, int, str], ...]
    """(slot id, kind, arg index, name) for each external the replay reads."""
    keep: frozenset[int] = frozenset()
    """Pack indices whose values are held (the save plan), not replayed."""
    param_casts: tuple[tuple[int, str], ...] = ()
    """(pack index, parameter name) of packed values the tape made by casting a parameter (autocast)."""


class TemplateCache:
    """Templates by block signature; at most ``capacity`` kept. Identical blocks share one, but a block
    reuses a template only after its own first call under that signature recorded the same tape
    (``admit``): a signature covers shapes, not the constants a block keeps in its attributes (GPT-2's
    ``scale_attn_by_inverse_layer_idx`` scales each layer's attention by its own constant). A block whose
    tape differs gets a template of its own (``split``)."""

    def __init__(self, capacity: int = 64) -> None:
        self.capacity = capacity
        self._items: OrderedDict[Any, Template | None] = OrderedDict()
        self._users: dict[Any, set[str]] = {}
        self.split: set[str] = set()
        """Blocks whose tape differed from their signature's shared template."""

    def key(self, name: str, key: Any) -> Any:
        """Where block ``name``'s template for ``key`` lives."""
        return (key, name) if name in self.split else key

    def get(self, key: Any) -> Template | None:
        hit = self._items.get(key)
        if hit is not None:
            self._items.move_to_end(key)
        return hit

    def usable(self, name: str, key: Any) -> Template | None:
        """The template under ``key`` if block ``name`` has been admitted to it."""
        template = self.get(key)
        return template if template is not None and name in self._users.get(key, ()) else None

    def seen_ineligible(self, key: Any) -> bool:
        return key in self._items and self._items[key] is None

    def put(self, key: Any, template: Template | None, name: str = "") -> None:
        """Store ``template`` under ``key``, recorded from block ``name`` (its only user so far)."""
        self._items[key] = template
        self._users[key] = {name}
        self._items.move_to_end(key)
        while len(self._items) > self.capacity:
            old, _ = self._items.popitem(last=False)
            self._users.pop(old, None)

    def admit(self, name: str, key: Any, tape: Tape) -> bool:
        """Block ``name`` recorded ``tape`` under ``key``, where a template already is: share the template
        if the tapes are the same, else mark the block ``split`` and return False."""
        template = self._items.get(key)
        if template is not None and same_tape(template.tape, tape):
            self._users[key].add(name)
            return True
        self.split.add(name)
        return False

    def __len__(self) -> int:
        return sum(1 for t in self._items.values() if t is not None)


def same_tape(a: Tape, b: Tape) -> bool:
    """Whether two recordings ran the same ops with the same constants on the same values: the node
    sequence (ops, non-tensor arguments, outputs, writes), the slots (shapes, dtypes, producers, the
    externals by position and name) and what autograd packed."""

    def nodes(t: Tape) -> list[Any]:
        return [
            (n.func, n.flat_args, n.spec, n.outs, n.out_versions, n.writes, n.random, n.force_save)
            for n in t.nodes
        ]

    def slots(t: Tape) -> list[Any]:
        return [
            (
                s.group,
                s.producer,
                s.born,
                s.shape,
                s.dtype,
                None if s.external is None else (s.external.kind, s.external.index, s.external.name),
            )
            for s in t.slots
        ]

    return (
        a.packs == b.packs
        and a.pack_meta == b.pack_meta
        and a.group_writes == b.group_writes
        and slots(a) == slots(b)
        and nodes(a) == nodes(b)
    )


def signature(block: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any | None:
    """What a tape depends on besides tensor values; None when a call cannot be keyed safely."""
    flat, spec = tree_flatten((args, kwargs))
    leaves: list[Any] = []
    first_of_storage: dict[int, int] = {}
    for i, a in enumerate(flat):
        if isinstance(a, torch.Tensor):
            storage = a.untyped_storage()._cdata
            alias = first_of_storage.setdefault(storage, i)
            leaves.append(
                (
                    tuple(a.shape),
                    tuple(a.stride()),
                    a.storage_offset(),
                    a.dtype,
                    a.device,
                    a.requires_grad,
                    alias,
                )
            )
        elif isinstance(a, _PRIMITIVES):
            leaves.append(a)
        else:
            return None  # an object (a KV cache, say) may steer the forward: record every call
    params = tuple(
        # strides too: a view recorded on a contiguous weight cannot replay on a transposed one
        # (load_state_dict(assign=True) with column-major tensors, found in a sweep on 2026-12-05)
        (name, tuple(p.shape), tuple(p.stride()), p.dtype, p.device, p.requires_grad)
        for name, p in list(block.named_parameters()) + list(block.named_buffers())
    )
    autocast = tuple((d, torch.is_autocast_enabled(d), torch.get_autocast_dtype(d)) for d in ("cpu", "cuda"))
    return (type(block), str(spec), tuple(leaves), params, block.training, autocast)


def signature_difference(
    key: Any, planned: list[Any], args: tuple[Any, ...], kwargs: dict[str, Any]
) -> str | None:
    """What sets signature ``key`` (of a call with ``args`` and ``kwargs``) apart from the nearest of
    ``planned`` (signatures a save plan has entries for), in words; None when none is of the block's class.
    Found in a sweep: the one guess offered ("a new batch or sequence shape?") was wrong for a plan made in
    eval mode, an added attention mask and an input of other strides."""
    if key is None:
        return None
    same_class = [k for k in planned if isinstance(k, tuple) and len(k) == len(key) and k[0] is key[0]]
    if not same_class:
        return None
    near = min(same_class, key=lambda k: sum(a != b for a, b in zip(k, key, strict=True)))
    paths = [_argument_name(keystr(path)) for path, _ in tree_flatten_with_path((args, kwargs))[0]]
    said: list[str] = []
    _, spec, leaves, params, training, autocast = key
    _, p_spec, p_leaves, p_params, p_training, p_autocast = near
    if training != p_training:
        said.append(
            f"the block is in {'training' if training else 'eval'} mode and the plan was made in "
            f"{'training' if p_training else 'eval'} mode (profile after model.train())"
        )
    if autocast != p_autocast:
        on = [f"{d} {str(t).removeprefix('torch.')}" for d, e, t in autocast if e] or ["off"]
        p_on = [f"{d} {str(t).removeprefix('torch.')}" for d, e, t in p_autocast if e] or ["off"]
        said.append(f"autocast is {', '.join(on)} and was {', '.join(p_on)} when the plan was made")
    if spec != p_spec or len(leaves) != len(p_leaves):
        names, p_names = set(re.findall(r"'([^']*)'", spec)), set(re.findall(r"'([^']*)'", p_spec))
        new, gone = sorted(names - p_names), sorted(p_names - names)
        parts = ([f"new {', '.join(new)}"] if new else []) + ([f"no {', '.join(gone)}"] if gone else [])
        said.append(
            "its call passes other arguments than the plan's"
            + (f" ({'; '.join(parts)})" if parts else f" ({len(leaves)} values, the plan's {len(p_leaves)})")
        )
    else:
        for i, (a, b) in enumerate(zip(leaves, p_leaves, strict=True)):
            if a != b:
                said.append(f"argument {paths[i] if i < len(paths) else i} {_leaf_difference(a, b)}")
                break
    if params != p_params:
        said.append("its parameters' shapes, strides, dtypes or devices differ from the planned block's")
    return "; ".join(said) or None


def _argument_name(path: str) -> str:
    """``"[1]['attention_mask']"`` -> ``attention_mask``; ``"[0][2]"`` -> ``args[2]``."""
    if path.startswith("[1]['"):
        name, _, rest = path[5:].partition("']")
        return name + rest
    return "args" + path[3:] if path.startswith("[0]") else path


def _leaf_difference(a: Any, b: Any) -> str:
    tensor_a, tensor_b = isinstance(a, tuple) and len(a) == 7, isinstance(b, tuple) and len(b) == 7
    if tensor_a and tensor_b:
        for i, what in enumerate(("shape", "strides", "storage offset", "dtype", "device", "requires_grad")):
            if a[i] != b[i]:
                hint = " (a new batch or sequence shape?)" if what == "shape" else ""
                return f"has {what} {a[i]} where the plan's has {b[i]}{hint}"
        return "aliases another argument than in the plan's call"
    if tensor_a != tensor_b:
        shown = {True: "a tensor", False: "{!r}"}
        return (
            f"is {shown[tensor_a].format(a)} where the plan's call passed {shown[tensor_b].format(b)} "
            "(an attention mask given or left out?)"
        )
    return f"is {a!r} where the plan's call passed {b!r}"


def unkeyable_argument(args: tuple[Any, ...], kwargs: dict[str, Any]) -> str | None:
    """The type name of the first argument that keeps :func:`signature` from keying a call."""
    for a in tree_flatten((args, kwargs))[0]:
        if not isinstance(a, (torch.Tensor, *_PRIMITIVES)):
            return type(a).__qualname__
    return None


def template_from(tape: Tape, plan: ReplayPlan, keep: frozenset[int] = frozenset()) -> Template | None:
    """A reusable template, or None when the tape may differ between calls (see the contract).
    ``keep``: pack indices whose values the save plan holds (delivered by the pack hook)."""
    if any(n.random or n.force_save is not None for n in tape.nodes):
        return None
    kept = {tape.packs[i] for i in keep if i < len(tape.packs) and tape.packs[i] is not None}
    if not plan.reads_saved <= kept or any(key in tape.captured for key in tape.packed_internal()):
        return None
    externals = []
    for n in plan.order:
        for sid, _ in tape.nodes[n].reads:
            ext = tape.slots[sid].external
            if tape.slots[sid].producer != -1 or ext is None:
                continue
            if ext.kind == "captured" or ext.written:
                return None
            externals.append((sid, ext.kind, ext.index, ext.name))
    # The template must not keep the recording call's inputs alive: copy slots without tensors.
    slots = [
        replace(slot, external=replace(slot.external, tensor=None)) if slot.external is not None else slot
        for slot in tape.slots
    ]
    stripped = Tape(
        nodes=tape.nodes,
        slots=slots,
        group_writes=tape.group_writes,
        group_version=tape.group_version,
        packs=tape.packs,
        pack_meta=tape.pack_meta,
        captured={},
        stale=tape.stale,
    )
    return Template(stripped, plan, tuple(dict.fromkeys(externals)), keep, _param_casts(tape))


def _param_casts(tape: Tape) -> tuple[tuple[int, str], ...]:
    """Packed values that are a parameter's cast, or a view of one (``linear`` packs the cast's ``t()``)."""
    out = []
    for i, key in enumerate(tape.packs):
        producer = tape.slots[key[0]].producer if key is not None else -1
        while producer >= 0 and getattr(tape.nodes[producer].func, "is_view", False):
            reads = tape.nodes[producer].reads
            producer = tape.slots[reads[0][0]].producer if len(reads) == 1 else -1
        if producer < 0 or tape.nodes[producer].func is not torch.ops.aten._to_copy.default:
            continue
        for sid, _ in tape.nodes[producer].reads:
            ext = tape.slots[sid].external
            if tape.slots[sid].producer == -1 and ext is not None and ext.kind == "param":
                out.append((i, ext.name))
    return tuple(out)


# Per block, the parameter casts its last reused forward packed: (pack index) -> (the cast, the parameter's
# version then). Autocast caches each parameter's cast until its outermost region exits; a region that
# spans optimizer steps hands a later forward the cast of an older value, which replay (casting the
# parameter as it is now) would not reproduce.
_LAST_CASTS: weakref.WeakKeyDictionary[nn.Module, dict[int, tuple[Any, int]]] = weakref.WeakKeyDictionary()


def seed_casts(block: nn.Module, template: Template, packed: list[Any]) -> None:
    """Remember the parameter casts that the recorded call packed (``packed``: weak references to its
    packs' base tensors, in order), so the next reused forward is checked against them too."""
    seen = _LAST_CASTS.setdefault(block, {})
    for i, name in template.param_casts:
        if i < len(packed):
            seen[i] = (packed[i], _param_or_buffer(block, name)._version)


def _check_cast(frame: Frame, block: nn.Module, i: int, name: str, t: torch.Tensor) -> None:
    param = _param_or_buffer(block, name)
    cast = t._base if t._base is not None else t  # the cast itself, which autocast's cache keeps
    seen = _LAST_CASTS.setdefault(block, {})
    last = seen.get(i)
    if last is not None and last[0]() is cast and last[1] != param._version:
        raise TapeSACError(
            f"TapeSAC block {frame.name!r}: this forward used autocast's cached cast of {name!r} made before "
            "the parameter last changed (one torch.autocast region spans an optimizer step), so replay "
            "could not reproduce it. Enter autocast around the forward and loss only, as PyTorch "
            "recommends, or call torch.clear_autocast_cache() after each optimizer step"
        )
    seen[i] = (weakref.ref(cast), param._version)


def run_reused(
    template: Template,
    frame: Frame,
    block: nn.Module,
    forward: Callable[..., Any],
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
) -> Any:
    tape = template.tape
    count = 0

    def pack(t: torch.Tensor) -> Any:
        nonlocal count
        i = count
        count += 1
        if i >= len(tape.packs) or (tuple(t.shape), t.dtype) != tape.pack_meta[i]:
            got = f"{tuple(t.shape)} {t.dtype}"
            want = "nothing" if i >= len(tape.packs) else f"{tape.pack_meta[i][0]} {tape.pack_meta[i][1]}"
            raise TapeSACError(
                f"TapeSAC block {frame.name!r}: saved tensor {i} of this forward is {got}, its recorded "
                f"tape expected {want}; the block's ops depend on more than its input shapes. Set "
                "TapeSACConfig(reuse_tapes=False) to record every call"
            )
        if i in casts:
            _check_cast(frame, block, i, casts[i], t)
        return pack_hook(frame, tape.packs[i], t, keep=i in template.keep)

    casts = dict(template.param_casts)
    with torch.autograd.graph.saved_tensors_hooks(pack, unpack_hook):
        out = forward(*args, **kwargs)
    if count != len(tape.packs):
        raise TapeSACError(
            f"TapeSAC block {frame.name!r}: this forward saved {count} tensors for backward, its "
            f"recorded tape {len(tape.packs)}; set TapeSACConfig(reuse_tapes=False) to record every call"
        )
    flat = [a for a in tree_flatten((args, kwargs))[0] if isinstance(a, torch.Tensor)]
    externals: dict[int, torch.Tensor] = {}
    for sid, kind, index, name in template.externals:
        if kind == "arg":
            externals[sid] = flat[index]
        else:
            externals[sid] = _param_or_buffer(block, name)
    frame.close(tape, template.plan, externals)
    return out


def _param_or_buffer(block: nn.Module, name: str) -> torch.Tensor:
    try:
        return block.get_parameter(name)
    except AttributeError:
        return block.get_buffer(name)
