"""Recording one block's forward into a :class:`Tape` (TorchDispatchMode + saved_tensors_hooks).

Contract: the recorder sees post-autograd, post-autocast aten ops (so replay needs neither), keys
tensors by storage and view metadata (autograd's ``as_view`` changes TensorImpl identity), keeps a
``StorageWeakRef`` per storage group so a freed storage's address is never mistaken for a live one,
and holds no internal activation except the values it must save (``captured``).

Force-save reasons (a node with one is never replayed; its outputs are held from forward):
host syncs and data-dependent shapes, collectives, side effects (writes to externals, schema-hidden
writes such as batch-norm running statistics), kernels outside the dispatcher (anything run inside
a custom ``autograd.Function``), random ops with an explicit generator, nondeterministic kernels.
"""

from __future__ import annotations

import contextlib
import threading
import time
import weakref
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten
from torch.utils.checkpoint import CheckpointFunction

from steptune.core.patching import SharedPatch
from steptune.memory.tape import ExternalRef, OpNode, Slot, Tape, ValueKey, _Ref

__all__ = ["Recorder", "force_save_reason", "op_flops"]

PureOps = tuple[frozenset[str], frozenset[str]]
_LEAF_TYPES = (
    int,
    float,
    bool,
    str,
    complex,
    type(None),
    torch.dtype,
    torch.device,
    torch.layout,
    torch.memory_format,
)
_COLLECTIVE_NAMESPACES = frozenset({"_c10d_functional", "c10d", "_c10d_functional_autograd", "_dtensor"})
# Ops whose tags say whether they draw random numbers or sync with the host; others are custom ops.
_TORCH_NAMESPACES = frozenset({"aten", "prims"})
# Ops that write buffers their schema does not mark as written (running statistics).
_HIDDEN_WRITERS = frozenset({"native_batch_norm", "cudnn_batch_norm", "miopen_batch_norm"})
_SYNC_TAGS = (torch.Tag.dynamic_output_shape, torch.Tag.data_dependent_output)


def force_save_reason(
    func: Any,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    out: Any,
    pure: PureOps = (frozenset(), frozenset()),
) -> str | None:
    """Why the op cannot be replayed safely, from its schema, tags and devices (None if it can).
    ``pure``: (overload names, packet names) of custom ops the user declared replayable."""
    namespace = getattr(func, "namespace", "")
    if namespace in _COLLECTIVE_NAMESPACES:
        return "collective"
    if namespace not in _TORCH_NAMESPACES:
        if any(isinstance(o, (int, float, bool, torch.SymInt, torch.SymFloat)) for o in tree_flatten(out)[0]):
            # read from tensor data, perhaps (an amax scale): a reused tape would hold it constant
            return "host sync or data-dependent shape (a custom op returned a number)"
        if not _declared_pure(func, pure) and not _inert(func, out):
            # A torch.library op's kernel runs below the recorder and carries none of aten's tags: it may draw
            # random numbers (a fused dropout mask gave wrong gradients when replayed) or have side effects.
            return (
                "custom op (its kernel is hidden from the tape: random or side effects cannot be ruled out)"
            )
    tags = getattr(func, "tags", ())
    if any(tag in tags for tag in _SYNC_TAGS) and not _integer_indexing(func, args):
        return "host sync or data-dependent shape"
    if getattr(torch.Tag, "nondeterministic_bitwise", None) in tags:
        return "nondeterministic kernel"
    base = func._schema.name.split("::")[-1]
    if base in _HIDDEN_WRITERS and _training_flag(func, args, kwargs):
        return "side effect (running statistics)"
    if kwargs.get("generator") is not None:
        return "random op with an explicit generator"
    if _crosses_to_host(args, out):
        return "host sync or data-dependent shape"
    return None


def _declared_pure(func: Any, pure: PureOps) -> bool:
    name = str(func)
    return name in pure[0] or name.rpartition(".")[0] in pure[1]


def _inert(func: Any, out: Any) -> bool:
    """A custom op that returns only None or opaque objects and whose schema writes nothing
    (``record_function``'s profiler ops return a handle): backward can never need it, so it neither is
    replayed nor stops tape reuse. A returned number may come from tensor data (a host sync: an amax
    scale), which a reused tape would hold constant, so it is not inert."""
    schema = getattr(func, "_schema", None)
    if schema is None or any(a.alias_info is not None and a.alias_info.is_write for a in schema.arguments):
        return False
    return all(o is None or isinstance(o, torch.ScriptObject) for o in tree_flatten(out)[0])


def _integer_indexing(func: Any, args: tuple[Any, ...]) -> bool:
    """``aten.index`` carries the dynamic-shape tag for boolean masks; with integer indices its
    output shape follows the index shapes and replay is as static as any gather."""
    if func is not torch.ops.aten.index.Tensor or len(args) < 2:
        return False
    return all(
        i is None
        or (
            isinstance(i, torch.Tensor)
            and not i.is_floating_point()
            and i.dtype not in (torch.bool, torch.uint8)
        )
        for i in args[1]
    )


def _consumes_rng(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> bool:
    """Seeded ops draw from the generator unless their dropout probability is 0 or train is False
    (SDPA carries the tag even at dropout 0, pytorch/pytorch#187985)."""
    for i, arg in enumerate(func._schema.arguments):
        if arg.name in ("dropout_p", "p", "train"):
            value = args[i] if i < len(args) else kwargs.get(arg.name, arg.default_value)
            if arg.name == "train" and value is False:
                return False
            if arg.name in ("dropout_p", "p") and isinstance(value, (int, float)) and value == 0:
                return False
    return True


def _training_flag(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> bool:
    for i, arg in enumerate(func._schema.arguments):
        if arg.name == "training":
            value = args[i] if i < len(args) else kwargs.get("training", False)
            return bool(value)
    return False


def _crosses_to_host(args: tuple[Any, ...], out: Any) -> bool:
    ins = [a for a in tree_flatten(args)[0] if isinstance(a, torch.Tensor)]
    outs = [o for o in tree_flatten(out)[0] if isinstance(o, torch.Tensor)]
    return any(i.device.type != "cpu" for i in ins) and any(o.device.type == "cpu" for o in outs)


def _view_key(t: torch.Tensor, group: int) -> tuple[Any, ...]:
    return (group, t.storage_offset(), tuple(t.shape), tuple(t.stride()), t.dtype)


class Recorder(TorchDispatchMode):
    """Records every op of one block call; ``pack`` maps saved tensors to tape values."""

    def __init__(
        self,
        externals: dict[tuple[Any, ...], ExternalRef],
        save_fn: Callable[[OpNode], bool] | None = None,
        count_flops: bool = False,
        pure_ops: PureOps = (frozenset(), frozenset()),
    ) -> None:
        super().__init__()
        self._external_refs = externals
        self._pure_ops = pure_ops
        self._save_fn = save_fn
        self._count_flops = count_flops
        self.nodes: list[OpNode] = []
        self.slots: list[Slot] = []
        self.group_writes: dict[int, list[tuple[int, int]]] = {}
        self.group_version: dict[int, int] = {}
        self.packs: list[ValueKey | None] = []
        # Autograd checks a saved tensor's version when backward unpacks it, except under saved-tensor hooks
        # (ours): a packed value written in place later (its autograd version moved, not only our storage
        # version: a write through ``.data`` does not count) is stale, and unpacking it must raise.
        self._pack_refs: dict[int, list[tuple[ValueKey, Any, int]]] = {}
        self._unchecked: set[int] = set()  # groups written since the last check (autograd bumps after us)
        self.stale: set[ValueKey] = set()
        self.pack_meta: list[tuple[tuple[int, ...], torch.dtype]] = []
        self.captured: dict[ValueKey, torch.Tensor] = {}
        self.keep_outputs = False
        self.kept_outputs: dict[int, torch.Tensor] = {}
        """With ``keep_outputs``: every slot's tensor (the profiler's; holds the whole block)."""
        self._groups: dict[int, tuple[int, StorageWeakRef]] = {}
        self._keys: dict[tuple[Any, ...], int] = {}
        self._external_groups: set[int] = set()
        self._opaque_depth = 0
        self._trust_next = False
        self._trusted: set[int] = set()
        """Nodes of torch.library ops run by their generated autograd Function (judged as the op itself)."""
        self.c10d_ops = 0
        """Eager c10d ops seen at the dispatcher (a ``torch.distributed`` call on a bare backend is not)."""
        self.seconds = 0.0
        self.pack_fn: Callable[[torch.Tensor], Any] | None = None
        """The pack hook this recording installed; another one on top means the block runs
        saved-tensor hooks of its own (torch's non-reentrant checkpoint, ``save_on_cpu``)."""
        self.inner_checkpoint: str | None = None
        """Which torch checkpoint the block calls inside its own forward, if any (for the warning)."""
        self.inner_hooks: str | None = None
        """Other saved-tensor hooks the block pushes itself (``save_on_cpu``): their qualname."""

    # ----- storage groups and slots -------------------------------------------------------
    def _group(self, t: torch.Tensor, create: bool) -> int | None:
        storage = t.untyped_storage()
        entry = self._groups.get(storage._cdata)
        if entry is not None and not entry[1].expired():
            return entry[0]
        if not create:
            return None
        gid = len(self.group_version)
        self._groups[storage._cdata] = (gid, StorageWeakRef(storage))
        self.group_version[gid] = 0
        return gid

    def _new_slot(self, t: torch.Tensor, group: int, producer: int, ext: ExternalRef | None) -> int:
        sid = len(self.slots)
        self.slots.append(
            Slot(
                sid=sid,
                group=group,
                producer=producer,
                born=self.group_version[group],
                shape=tuple(t.shape),
                dtype=t.dtype,
                nbytes=t.numel() * t.element_size(),
                external=ext,
            )
        )
        self._keys[_view_key(t, group)] = sid
        return sid

    def lookup(self, t: torch.Tensor) -> ValueKey:
        """The value ``t`` holds now; an unseen tensor becomes an external."""
        group = self._group(t, create=False)
        if group is not None:
            sid = self._keys.get(_view_key(t, group))
            if sid is not None:
                return (sid, self.group_version[group])
            if group not in self._external_groups:
                # A view made outside the dispatcher of a storage the block produced.
                sid = self._new_slot(t, group, producer=-2, ext=None)
                return (sid, self.group_version[group])
        group = self._group(t, create=True) if group is None else group
        assert group is not None
        self._external_groups.add(group)
        ext = self._external_refs.get(_external_key(t))
        if ext is None:
            ext = ExternalRef(kind="captured", tensor=t)
        else:
            ext = ExternalRef(kind=ext.kind, index=ext.index, name=ext.name, tensor=t)
        sid = self._new_slot(t, group, producer=-1, ext=ext)
        return (sid, self.group_version[group])

    # ----- the dispatch hook ----------------------------------------------------------------
    def __torch_dispatch__(
        self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: Any = None
    ) -> Any:
        kwargs = kwargs or {}
        start = time.perf_counter()
        trusted, self._trust_next = self._trust_next, False  # a torch.library op redispatched by its Function
        if self._unchecked:
            self._check_stale()
        if self.pack_fn is not None and self.inner_checkpoint is None and self.inner_hooks is None:
            top = torch._C._autograd._top_saved_tensors_default_hooks(True)
            if top is not None and top[0] is not self.pack_fn:
                qualname = getattr(top[0], "__qualname__", type(top[0]).__name__)
                if qualname.startswith("_checkpoint_hook."):
                    self.inner_checkpoint = "non-reentrant"
                else:
                    self.inner_hooks = qualname
        flat, spec = tree_flatten((args, kwargs))
        reads: list[ValueKey] = []
        template: list[Any] = []
        for a in flat:
            if isinstance(a, torch.Tensor):
                key = self.lookup(a)
                reads.append(key)
                template.append(_Ref(*key))
            else:
                template.append(a)
        if getattr(func, "namespace", "") == "c10d":
            c10d_written = _c10d_written(func, args, kwargs)
            self.c10d_ops += 1
            if c10d_written:
                self.seconds += time.perf_counter() - start
                out = func(*args, **kwargs)
                start = time.perf_counter()
                self._opaque_write(str(func), c10d_written)
                self.seconds += time.perf_counter() - start
                return out
        written = self._written_positions(func, args, kwargs)
        tags = getattr(func, "tags", ())
        random = torch.Tag.nondeterministic_seeded in tags and _consumes_rng(func, args, kwargs)
        rng_state = _rng_snapshot(flat) if random else None
        self.seconds += time.perf_counter() - start
        out = func(*args, **kwargs)
        start = time.perf_counter()
        index = len(self.nodes)
        reason = force_save_reason(func, args, kwargs, out, self._pure_ops)
        if self._opaque_depth and not trusted:
            reason = "kernel outside the dispatcher (inside a custom autograd.Function)"
        if any(self.slots[sid].producer == -2 for sid, _ in reads):
            reason = "reads a view made outside the dispatcher"
        if reason is None and getattr(func, "namespace", "") not in _TORCH_NAMESPACES and _inert(func, out):
            # never replayed: keep no handle alive (a profiler's ``_RecordFunction``), and compare by type
            template = [
                a if isinstance(a, (_Ref, *_LEAF_TYPES)) else f"<{type(a).__qualname__}>" for a in template
            ]
        node = OpNode(index, func, template, spec, reads, [], [], random=random, rng_state=rng_state)
        if trusted:
            self._trusted.add(index)
        for t in written:
            key = self.lookup(t)
            group = self.slots[key[0]].group
            if group in self._external_groups:
                reason = "side effect (writes a tensor the block did not produce)"
                self._external_written(group)
            self.group_version[group] += 1
            self.group_writes.setdefault(group, []).append((self.group_version[group], index))
            node.writes.append(group)
            if group in self._pack_refs:
                self._unchecked.add(group)
        flat_out = tree_flatten(out)[0]
        for pos, o in enumerate(flat_out):
            if not isinstance(o, torch.Tensor):
                continue
            if any(o is w for w in written):
                sid = self.lookup(o)[0]
            else:
                group = self._group(o, create=True)
                assert group is not None
                sid = self._keys.get(_view_key(o, group)) if group in self._external_groups else None
                if sid is None:
                    sid = self._new_slot(o, group, producer=index, ext=None)
            node.outs.append((pos, sid))
            if self.keep_outputs:
                self.kept_outputs[sid] = o
            node.out_versions.append(self.group_version[self.slots[sid].group])
        node.force_save = reason
        if reason is not None or (self._save_fn is not None and self._save_fn(node)):
            for (pos, sid), version in zip(node.outs, node.out_versions, strict=True):
                self.captured[(sid, version)] = flat_out[pos]
        if self._count_flops:
            node.flops = op_flops(func, args, kwargs, out)
        self.nodes.append(node)
        self.seconds += time.perf_counter() - start
        return out

    @staticmethod
    def _written_positions(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> list[torch.Tensor]:
        out: list[torch.Tensor] = []
        for i, arg in enumerate(func._schema.arguments):
            info = arg.alias_info
            if info is None or not info.is_write:
                continue
            value = args[i] if i < len(args) else kwargs.get(arg.name)
            for v in tree_flatten(value)[0]:
                if isinstance(v, torch.Tensor):
                    out.append(v)
        return out

    # ----- saved tensors ------------------------------------------------------------------
    def on_pack(self, t: torch.Tensor) -> ValueKey | None:
        """The internal value ``t`` is, or None when it must be kept as is."""
        self.pack_meta.append((tuple(t.shape), t.dtype))
        group = self._group(t, create=False)
        key: ValueKey | None = None
        if group is not None and group not in self._external_groups:
            sid = self._keys.get(_view_key(t, group))
            if sid is not None and self.slots[sid].producer >= 0:
                key = (sid, self.group_version[group])
                self._pack_refs.setdefault(group, []).append((key, weakref.ref(t), t._version))
        self.packs.append(key)
        return key

    def _check_stale(self) -> None:
        for group in self._unchecked:
            for key, ref, version in self._pack_refs[group]:
                t = ref()
                if t is not None and t._version != version:  # gone: nothing tells (assume not written)
                    self.stale.add(key)
        self._unchecked.clear()

    def tape(self) -> Tape:
        if self._unchecked:
            self._check_stale()
        final = {
            key: t
            for key, t in self.captured.items()
            if key[1] == self.group_version[self.slots[key[0]].group]
        }
        for slot in self.slots:
            if slot.external is not None and slot.external.tensor is not None:
                slot.external.version = slot.external.tensor._version
        return Tape(
            nodes=self.nodes,
            slots=self.slots,
            group_writes=self.group_writes,
            group_version=self.group_version,
            packs=self.packs,
            pack_meta=self.pack_meta,
            stale=frozenset(self.stale),
            captured=final,
        )

    @contextlib.contextmanager
    def opaque_functions(self) -> Iterator[None]:
        """Mark every op run inside a custom ``autograd.Function`` as not replayable."""
        stack = _recorders()
        with _patch.held():
            stack.append(self)
            try:
                yield
            finally:
                stack.pop()

    def _external_written(self, group: int) -> None:
        """The block wrote this input, parameter or buffer: its earlier readers must not be replayed
        (apply.py marks them)."""
        for slot in self.slots:
            if slot.group == group and slot.external is not None:
                slot.external.written = True

    def _opaque_write(self, name: str, flat: list[Any]) -> None:
        """A call that wrote each of these tensors without saying so in its schema (eager c10d)."""
        index = len(self.nodes)
        node = OpNode(index, name, [], None, [], [], [], force_save="collective")
        tensors = [t for t in flat if isinstance(t, torch.Tensor)]
        keys = [self.lookup(t) for t in tensors]  # read before any is written (views of one buffer)
        node.reads.extend(keys)
        for t, (sid, _) in zip(tensors, keys, strict=True):
            group = self.slots[sid].group
            if group not in node.writes:  # one new version per storage, however many views were written
                if group in self._external_groups:
                    node.force_save = "collective (writes a tensor the block did not produce)"
                    self._external_written(group)
                self.group_version[group] += 1
                self.group_writes.setdefault(group, []).append((self.group_version[group], index))
                node.writes.append(group)
            node.outs.append((len(node.outs), sid))
            node.out_versions.append(self.group_version[group])
            self.captured[(sid, self.group_version[group])] = t
        self.nodes.append(node)

    def _mark_opaque_output(self, t: torch.Tensor) -> None:
        # The Function's outputs may have been filled outside the dispatcher: whichever node
        # allocated them must not be replayed either, and the value is held from forward.
        group = self._group(t, create=False)
        if group is None:
            return
        sid = self._keys.get(_view_key(t, group))
        if sid is None or self.slots[sid].producer < 0 or self.slots[sid].producer in self._trusted:
            return
        node = self.nodes[self.slots[sid].producer]
        node.force_save = (
            node.force_save or "kernel outside the dispatcher (inside a custom autograd.Function)"
        )
        version = self.group_version[group]
        self.captured[(sid, version)] = t


_local = threading.local()

try:  # private (torch 2.x): the identity Function under Module.register_full_backward_hook
    from torch.nn.modules._functions import BackwardHookFunction as _BackwardHookFunction
except ImportError:  # moved: its outputs are then force-saved as any custom Function's (more memory)
    _BackwardHookFunction = None


def _recorders() -> list[Recorder]:
    if not hasattr(_local, "stack"):
        _local.stack = []
    stack: list[Recorder] = _local.stack
    return stack


def _original_apply(fn_cls: Any, *args: Any, **kwargs: Any) -> Any:
    return _patch.original(torch.autograd.function.Function, "apply").__func__(fn_cls, *args, **kwargs)


def _patched_apply(fn_cls: Any, *args: Any, **kwargs: Any) -> Any:
    stack = _recorders()
    recorder = stack[-1] if stack else None
    if recorder is None:
        return _original_apply(fn_cls, *args, **kwargs)
    if fn_cls is _BackwardHookFunction:
        # register_full_backward_hook's identity Function (it returns its inputs, which keep their storage):
        # nothing runs outside the dispatcher, so nothing needs saving (it force-saved every value it
        # touched: 6.55 -> 8.42 MiB of peak with hooks on each Linear; a 2026-12-05 sweep)
        return _original_apply(fn_cls, *args, **kwargs)
    if fn_cls is CheckpointFunction and not recorder._opaque_depth:
        # torch's reentrant checkpoint runs its function under no_grad through the dispatcher: the
        # ops inside are recorded like any others (a custom Function nested in it stays opaque).
        recorder.inner_checkpoint = "reentrant"
        return _original_apply(fn_cls, *args, **kwargs)
    # A torch.library op's Function (every custom_op's, register_autograd or not) first redispatches the op,
    # which the recorder then judges as any custom op (force-saved unless TapeSACConfig.pure_ops names it);
    # what runs after it (the user's setup_context) stays opaque, as in any custom Function.
    recorder._trust_next = fn_cls.__module__ == "torch._library.autograd" and not recorder._opaque_depth
    recorder._opaque_depth += 1
    try:
        out = _original_apply(fn_cls, *args, **kwargs)
    finally:
        recorder._opaque_depth -= 1
        recorder._trust_next = False
    for o in tree_flatten(out)[0]:
        if isinstance(o, torch.Tensor):
            recorder._mark_opaque_output(o)
    return out


def _c10d_written(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> list[torch.Tensor]:
    """The tensors an eager c10d op writes. ``torch.distributed``'s collectives and a ``ProcessGroup``'s
    methods all reach the dispatcher as ``c10d::`` ops (whatever name they were imported under), but their
    schemas mark no argument as written (``Tensor[] tensors``) and the writes bump no version counter:
    the in-place ones (a trailing ``_``) write their ``tensors`` or ``output*`` arguments."""
    name = func._schema.name.split("::")[-1]
    if not name.endswith("_") or name == "monitored_barrier_":
        return []
    out: list[torch.Tensor] = []
    for i, arg in enumerate(func._schema.arguments):
        if arg.name == "tensors" or arg.name.startswith("output"):
            value = args[i] if i < len(args) else kwargs.get(arg.name)
            out += [v for v in tree_flatten(value)[0] if isinstance(v, torch.Tensor)]
    return out


# A ``ProcessGroup`` (what init_process_group, new_group and DeviceMesh give) sends its collectives through
# the dispatcher, where ``_c10d_written`` sees them under any name. A bare backend object (a
# ``ProcessGroupGloo`` built directly, as steptune's thread-rank groups are) runs them below it, and every
# way of calling one (torch.distributed's functions under any name, or the object's own methods) reaches
# these Python-bound methods of ``Backend``, which are patched. Each writes its first argument: the outputs,
# or the tensors reduced, broadcast or received in place. A call is recorded only when the dispatcher saw
# no c10d op during it. Gloo finishes many collectives inside ``wait`` with ops on the calling thread (an
# all-gather copies its flat result into the outputs there), so a collective inside a recording block
# completes before the call returns and its write is recorded after those copies. A receive is recorded at
# once, without waiting (gloo writes it from its own thread): waiting there would deadlock a block that
# posts its receive before its send.
_BACKEND_WRITES = (
    "_allgather_base",
    "_reduce_scatter_base",
    "allgather",
    "allgather_coalesced",
    "allreduce",
    "allreduce_coalesced",
    "alltoall",
    "alltoall_base",
    "broadcast",
    "gather",
    "recv",
    "recv_anysource",
    "reduce",
    "reduce_scatter",
    "scatter",
)
_NO_WAIT = ("recv", "recv_anysource")
# the first parameter's name in each method's overloads, for a call that passes it by keyword
_FIRST_NAMES = (
    "output",
    "output_tensor",
    "output_tensors",
    "outputTensor",
    "output_lists",
    "tensors",
    "tensor",
    "arg0",
)


def _backend_written(args: tuple[Any, ...], kwargs: dict[str, Any]) -> list[Any]:
    if args:
        return tree_flatten(args[0])[0]
    first = next((kwargs[k] for k in _FIRST_NAMES if k in kwargs), None)
    return tree_flatten(first)[0]


def _backend_class() -> Any:
    return torch._C._distributed_c10d.Backend if torch.distributed.is_available() else None


def _patched_backend_method(name: str) -> Callable[..., Any]:
    def call(self: Any, *args: Any, **kwargs: Any) -> Any:
        stack = _recorders()
        seen = stack[-1].c10d_ops if stack else 0
        out = _patch.original(_backend_class(), name)(self, *args, **kwargs)
        if stack and stack[-1].c10d_ops == seen:
            if name not in _NO_WAIT:  # see _BACKEND_WRITES
                out.wait()
            stack[-1]._opaque_write(name, _backend_written(args, kwargs))
        return out

    return call


def _patch_targets() -> list[tuple[Any, str, Any]]:
    # Function.apply and Backend's methods are process-wide: patched once (refcounted across threads); each
    # patched call finds the calling thread's recorder, or none.
    function = torch.autograd.function.Function
    targets: list[tuple[Any, str, Any]] = [(function, "apply", classmethod(_patched_apply))]
    backend = _backend_class()
    if backend is not None:
        own = vars(backend)
        targets += [(backend, n, _patched_backend_method(n)) for n in _BACKEND_WRITES if n in own]
    return targets


_patch = SharedPatch(_patch_targets)


def _external_key(t: torch.Tensor) -> tuple[Any, ...]:
    return (t.untyped_storage()._cdata, t.storage_offset(), tuple(t.shape), tuple(t.stride()), t.dtype)


def _rng_snapshot(flat: list[Any]) -> Any:
    device = next((a.device for a in flat if isinstance(a, torch.Tensor)), torch.device("cpu"))
    if device.type == "cuda":
        return (device, torch.cuda.get_rng_state(device))
    return (device, torch.get_rng_state())


def op_flops(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any], out: Any) -> int:
    """FLOPs by torch's own FlopCounterMode formulas (matmuls and attention; 0 for the rest)."""
    from torch.utils.flop_counter import flop_registry

    fn = flop_registry.get(getattr(func, "overloadpacket", None))
    if fn is None:
        return 0
    return int(fn(*args, **kwargs, out_val=out))
