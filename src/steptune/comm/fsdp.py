"""``enable_tide``: TIDE's zero-copy collectives inside FSDP2's parameter groups.

FSDP2's public comm hooks (``set_custom_all_gather`` / ``set_custom_reduce_scatter``) only see flat rank-major
buffers; the copy-in, copy-out and fp32 ``chunk_cat`` around them always run. So TIDE replaces the three
module-level functions ``FSDPParamGroup`` calls (``foreach_all_gather``, ``foreach_all_gather_copy_out``,
``foreach_reduce`` in ``torch.distributed.fsdp._fully_shard._fsdp_param_group``) with dispatchers that send
TIDE-enabled groups to TIDE and every other group to the originals, unchanged. The patch is installed once,
reference-counted, and removed when the last handle is disabled.

Contract with FSDP2 (torch 2.11-2.13; checked by signature at install, then by a self-test on each process
group): for a TIDE group, every parameter's ``all_gather_outputs[0]`` is a view of the group's ``Slot`` and
its unsharded ``nn.Parameter`` is built here (FSDP2's ``init_unsharded_param`` then keeps it); the all-gather
writes peers' rows straight into those views and returns a sentinel result that the patched copy-out skips;
the reduce-scatter returns stock's 7-tuple with an empty input buffer (nothing to recycle). Gradient
averaging, ``to_sharded_dtensor``, gradient accumulation and post-accumulate-grad hooks follow stock's code.

Groups that TIDE does not handle stay on stock FSDP2 with a ``TideFallbackWarning`` naming the reason: HSDP
and replicate meshes, ``reshard_after_forward=int``, CPU offload, ``Shard(dim != 0)``, DTensor (TP)
parameters, all-gather extensions, custom or symmetric-memory comms, a custom ``gradient_divide_factor``,
a reduce dtype other than fp32, an all-reduce hook, world size 1, and compiled autograd (checked per call).
"""

from __future__ import annotations

import contextlib
import inspect
import warnings
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, ClassVar

import torch
from torch import nn

from steptune.comm.accounting import CommMeter, MeterFanout, phase
from steptune.comm.config import TideConfig, TideFallbackWarning
from steptune.comm.fsdp_group import SENTINEL, GroupState
from steptune.comm.layout import GroupLayout, ParamSpec

__all__ = ["TideConfig", "TideFallbackWarning", "TideHandle", "enable_tide", "measure"]

_SIGNATURES = {
    "foreach_all_gather": (
        "fsdp_params group async_op all_gather_copy_in_stream all_gather_stream device all_gather_comm"
    ),
    "foreach_all_gather_copy_out": "all_gather_result fsdp_params group",
    "foreach_reduce": (
        "fsdp_params unsharded_grads reduce_scatter_group reduce_scatter_stream reduce_scatter_comm "
        "orig_dtype reduce_dtype device gradient_divide_factor all_reduce_group all_reduce_stream "
        "all_reduce_grads partial_reduce_output all_reduce_hook force_sum_reduction_for_comms"
    ),
}


def _fsdp() -> Any:
    import torch.distributed.fsdp._fully_shard._fsdp_param_group as pg

    return pg


# -- the patch -------------------------------------------------------------------------------------------
class _Patch:
    refs = 0
    originals: ClassVar[dict[str, Any]] = {}
    meters: ClassVar[list[CommMeter]] = []
    warned_compiled = False
    default_comms: ClassVar[tuple[type, type] | None] = None  # FSDP2's DefaultAllGather, DefaultReduceScatter


def _check_signatures() -> str | None:
    pg = _fsdp()
    for name, expected in _SIGNATURES.items():
        fn = _Patch.originals.get(name, getattr(pg, name, None))
        if fn is None:
            return f"torch {torch.__version__} has no {name} in _fsdp_param_group"
        got = " ".join(inspect.signature(fn).parameters)
        if got != expected:
            return f"torch {torch.__version__}: {name}({got}) differs from the supported ({expected})"
    return None


def _in_collective_phase(call: Any) -> Any:
    """Copies a backend makes inside the collective itself (gloo's reduce-scatter copies its result out)
    are not layout conversion: count them under ``collective``."""

    def wrapped(self: Any, *args: Any, **kwargs: Any) -> Any:
        with phase("collective"):
            return call(self, *args, **kwargs)

    wrapped.__wrapped__ = call  # type: ignore[attr-defined]
    return wrapped


def _install() -> None:
    if _Patch.refs == 0:
        from torch.distributed.fsdp._fully_shard import _fsdp_collectives as fc

        pg = _fsdp()
        _Patch.originals = {name: getattr(pg, name) for name in _SIGNATURES}
        _Patch.default_comms = (fc.DefaultAllGather, fc.DefaultReduceScatter)
        pg.foreach_all_gather = _all_gather
        pg.foreach_all_gather_copy_out = _copy_out
        pg.foreach_reduce = _reduce
        for cls in (fc.DefaultAllGather, fc.DefaultReduceScatter):
            cls.__call__ = _in_collective_phase(cls.__call__)
    _Patch.refs += 1


def _uninstall() -> None:
    _Patch.refs -= 1
    if _Patch.refs == 0:
        from torch.distributed.fsdp._fully_shard import _fsdp_collectives as fc

        pg = _fsdp()
        for name, fn in _Patch.originals.items():
            setattr(pg, name, fn)
        _Patch.originals = {}
        for cls in (fc.DefaultAllGather, fc.DefaultReduceScatter):
            cls.__call__ = cls.__call__.__wrapped__


def _meter() -> CommMeter | MeterFanout | None:
    """The meters of every open ``measure`` block, as one (nested blocks each count everything inside them:
    the outer one counted only what ran outside the inner, a sweep)."""
    if not _Patch.meters:
        return None
    if len(_Patch.meters) == 1:
        return _Patch.meters[0]
    return MeterFanout(_Patch.meters)


@contextlib.contextmanager
def measure(meter: CommMeter | None = None) -> Iterator[CommMeter]:
    """Count copies, wire bytes and staging of every FSDP2 collective (stock or TIDE) inside the block."""
    meter = meter or CommMeter()
    _install()
    _Patch.meters.append(meter)
    try:
        yield meter
    finally:
        _Patch.meters.remove(meter)
        _uninstall()


def _counting(meter: CommMeter | MeterFanout | None) -> contextlib.AbstractContextManager[Any]:
    return meter.copies if meter is not None else contextlib.nullcontext()


def _state(fsdp_params: list[Any]) -> GroupState | None:
    st = fsdp_params[0].__dict__.get("_tide_state") if fsdp_params else None
    if st is None or not st.active:
        return None
    if _in_compiled_autograd():
        if not _Patch.warned_compiled:
            _Patch.warned_compiled = True
            warnings.warn(
                "TIDE: compiled autograd is tracing FSDP2's collectives; stock FSDP2 runs them instead",
                TideFallbackWarning,
                stacklevel=3,
            )
        return None
    return st


def _in_compiled_autograd() -> bool:
    try:
        from torch._dynamo import compiled_autograd
    except ImportError:  # pragma: no cover
        return False
    return bool(getattr(compiled_autograd, "in_compiled_autograd_region", False))


def _all_gather(fsdp_params: list[Any], group: Any, async_op: bool, *streams_device_comm: Any) -> Any:
    meter, st = _meter(), _state(fsdp_params)
    with _counting(meter):
        if st is None:
            result = _Patch.originals["foreach_all_gather"](
                fsdp_params, group, async_op, *streams_device_comm
            )
            if meter is not None and result is not None:
                out, w = result.all_gather_output, group.size()
                meter.add_wire("all_gather", out.dtype, out.numel() * out.element_size() * (w - 1) // w)
                meter.count("stock_all_gather")
            return result
        comm = streams_device_comm[-1]
        if _Patch.default_comms is not None and type(comm) is not _Patch.default_comms[0]:
            # set_custom_all_gather after enable_tide: TIDE's gather would skip it silently (a sweep); stock's
            # cannot take over here, since the parameters live in TIDE's slot
            raise RuntimeError(
                f"group {st.fqn or '<root>'}: a custom all-gather ({type(comm).__name__}) was set after "
                "enable_tide, and TIDE would not call it. Set custom comms before enable_tide (the group "
                "then stays on stock FSDP2), or call the TIDE handle's disable() first"
            )
        return st.all_gather(fsdp_params, group, streams_device_comm[-2], meter)


def _copy_out(all_gather_result: Any, fsdp_params: list[Any], group: Any) -> None:
    if all_gather_result.all_gather_output is SENTINEL:
        return  # TIDE wrote straight into parameter storage
    with _counting(_meter()):
        _Patch.originals["foreach_all_gather_copy_out"](all_gather_result, fsdp_params, group)


def _reduce(fsdp_params: list[Any], unsharded_grads: list[torch.Tensor], rs_group: Any, *rest: Any) -> Any:
    meter, st = _meter(), _state(fsdp_params)
    (
        rs_stream,
        _comm,
        orig_dtype,
        _rdtype,
        device,
        divide_factor,
        ar_group,
        _ars,
        _arg,
        partial,
        hook,
        _fs,
    ) = rest
    if (
        st is not None
        and ar_group is None
        and partial is None
        and hook is None
        and divide_factor is None
        # a custom reduce-scatter set after enable_tide: stock's reduce calls it (TIDE's skipped it, a sweep)
        and (_Patch.default_comms is None or type(_comm) is _Patch.default_comms[1])
        and st.rs_group_passes(rs_group, device)
    ):
        with _counting(meter):
            return st.reduce(fsdp_params, unsharded_grads, rs_group, rs_stream, orig_dtype, device, meter)
    with _counting(meter):
        result = _Patch.originals["foreach_reduce"](fsdp_params, unsharded_grads, rs_group, *rest)
    if meter is not None and rs_group is not None:
        inp, w = result[0], rs_group.size()
        nbytes = inp.numel() * inp.element_size()
        meter.add_wire("reduce_scatter", inp.dtype, nbytes * (w - 1) // w)
        meter.add_staging(nbytes, nbytes)
        meter.count("stock_reduce_scatter")
    return result


# -- enable / disable --------------------------------------------------------------------------------------
@dataclass
class TideHandle:
    """What ``enable_tide`` did: ``groups`` maps each group's FQN to ``"tide"`` or its fallback reason."""

    groups: dict[str, str]
    _states: list[GroupState]
    _installed: bool = True

    @property
    def num_tide(self) -> int:
        return sum(v == "tide" for v in self.groups.values())

    def disable(self) -> None:
        """Back to stock FSDP2 (call between steps, with the model resharded)."""
        for st in self._states:
            if any(fp.sharded_state != _sharded() for fp in st.fsdp_params):
                raise ValueError(
                    f"group {st.fqn} is unsharded (a forward with reshard_after_forward=False, or no "
                    "backward yet): call disable() between steps with parameters sharded, e.g. after "
                    "reshard() on every FSDP module (m.reshard() for m in model.modules() if isinstance(m, "
                    "FSDPModule))"
                )
        for st in self._states:
            if (pending := _pending_grad(st.fsdp_params)) is not None:
                raise ValueError(f"group {st.fqn}: {pending}; call disable() {_AFTER_SYNC}")
        for st in self._states:
            st.detach()
        self._states = []
        if self._installed:
            self._installed = False
            _uninstall()


def _param_groups(module: nn.Module) -> list[Any]:
    from torch.distributed.fsdp import FSDPModule

    groups, seen = [], set()
    for m in module.modules():
        if isinstance(m, FSDPModule):
            state = m._get_fsdp_state()
            # torch 2.13 has one or more groups per state; 2.11 exactly one (or None)
            many = getattr(state, "_fsdp_param_groups", None)
            for g in many if many is not None else [g for g in [state._fsdp_param_group] if g is not None]:
                if id(g) not in seen:
                    seen.add(id(g))
                    groups.append(g)
    return groups


def _ineligible(g: Any) -> str | None:
    """Why stock FSDP2 keeps this group, or None."""
    from torch.distributed.fsdp import CPUOffloadPolicy
    from torch.distributed.fsdp._fully_shard._fsdp_collectives import DefaultAllGather, DefaultReduceScatter
    from torch.distributed.fsdp._fully_shard._fsdp_common import FSDPMeshInfo, HSDPMeshInfo

    mi = g.mesh_info
    if isinstance(mi, HSDPMeshInfo) or not isinstance(mi, FSDPMeshInfo):
        return "HSDP or replicate mesh (TIDE handles 1-D FSDP meshes)"
    if getattr(mi, "is_spmd_mesh", False):
        return "SPMD mesh"
    if mi.shard_process_group.size() == 1:
        return "world size 1: nothing to communicate"
    if g._use_post_forward_mesh:
        return "reshard_after_forward=int (post-forward mesh)"
    if isinstance(g.offload_policy, CPUOffloadPolicy):
        return "CPU offload"
    if (
        type(g._all_gather_comm) is not DefaultAllGather
        or type(g._reduce_scatter_comm) is not DefaultReduceScatter
    ):
        return "custom or symmetric-memory comms are installed"
    if g.gradient_divide_factor is not None:
        return f"custom gradient_divide_factor={g.gradient_divide_factor}"
    if g._all_reduce_hook is not None:
        return "an all-reduce hook is registered"
    mp = g.mp_policy
    reduce_dtype = mp.reduce_dtype or mp.param_dtype or torch.float32
    if reduce_dtype != torch.float32:
        return (
            f"reduce dtype {reduce_dtype} (TIDE-RS accumulates fp32: MixedPrecisionPolicy(reduce_dtype=fp32))"
        )
    if g.device.type not in ("cpu", "cuda"):
        return f"device type {g.device.type}"
    for fp in g.fsdp_params:
        name = fp._param_fqn or fp._module_info.param_name
        if fp.fsdp_placement.dim != 0:
            return f"{name}: Shard({fp.fsdp_placement.dim}) (TIDE handles dim-0 sharding)"
        if fp.is_dtensor:
            return f"{name}: DTensor parameter (tensor parallel)"
        if hasattr(fp._sharded_local_tensor, "fsdp_pre_all_gather"):
            return f"{name}: all-gather extension (fsdp_pre_all_gather)"
        if (dtype := fp.sharded_param.dtype) not in (torch.float32, torch.bfloat16):
            return f"{name}: parameter dtype {dtype}"
    gathered = {mp.param_dtype or fp.sharded_param.dtype for fp in g.fsdp_params}
    if len(gathered) > 1:  # TIDE gathers a group into one buffer of one dtype
        return f"parameters all-gathered in {len(gathered)} dtypes ({', '.join(sorted(map(str, gathered)))})"
    if problem := _padding_mismatch(g.fsdp_params, mi.shard_process_group.size()):
        return problem
    if any(fp.sharded_state != _sharded() for fp in g.fsdp_params):
        raise ValueError(
            f"group {g._module_fqn or '<root>'}: call enable_tide between steps, with parameters sharded (a "
            "root left unsharded after a forward, such as a no_grad evaluation pass: call model.reshard() "
            "first)"
        )
    if (pending := _pending_grad(g.fsdp_params)) is not None:
        raise ValueError(f"group {g._module_fqn or '<root>'}: {pending}; call enable_tide {_AFTER_SYNC}")
    return None


_AFTER_SYNC = (
    "after the accumulation window's synced backward (set_requires_gradient_sync(True)), or the gradients "
    "accumulated so far would be lost"
)


def _pending_grad(fsdp_params: list[Any]) -> str | None:
    """A parameter whose unsharded gradient waits for a later synced backward (microbatches run with
    ``set_requires_gradient_sync(False)``): switching collectives replaces the unsharded parameter that holds
    it (FSDP2 keeps a mixed-precision run's in ``unsharded_accumulated_grad``, which survives)."""
    for fp in fsdp_params:
        unsharded = fp.__dict__.get("_unsharded_param")
        if unsharded is not None and unsharded.grad is not None:
            name = fp._param_fqn or fp._module_info.param_name
            return f"{name} holds a gradient accumulated without reduce-scatter (no-sync microbatches)"
    return None


def _padding_mismatch(fsdp_params: list[Any], world_size: int) -> str | None:
    """TIDE's layout places each parameter's rows as FSDP2 pads them (``torch.chunk`` of dim 0); a torch
    whose FSDP2 pads otherwise is caught here, before any step, rather than mid-forward."""
    specs = tuple(ParamSpec(tuple(fp._orig_size)) for fp in fsdp_params)
    layout = GroupLayout(specs, world_size)
    for p, fp in enumerate(fsdp_params):
        if fp.padded_sharded_param_size.numel() != layout.shard_numel(p):
            name = fp._param_fqn or fp._module_info.param_name
            return (
                f"{name}: FSDP2 pads its shard to {fp.padded_sharded_param_size.numel()} elements "
                f"{tuple(fp.padded_sharded_param_size)}, TIDE's layout to {layout.shard_numel(p)} (this "
                "torch's FSDP2 shards differently)"
            )
    return None


def _sharded() -> Any:
    from torch.distributed.fsdp._fully_shard._fsdp_param import ShardedState

    return ShardedState.SHARDED


def enable_tide(module: nn.Module, config: TideConfig | None = None) -> TideHandle:
    """Put every eligible FSDP2 parameter group under ``module`` on TIDE's collectives.

    Call it on every rank, after ``fully_shard`` and between steps. Returns a handle; ``handle.disable()``
    restores stock FSDP2. Ineligible groups stay on stock with a ``TideFallbackWarning``.
    """
    config = config or TideConfig()
    groups = _param_groups(module)
    if not groups:
        raise ValueError(
            "no FSDP2 parameter groups under this module: call fully_shard(...) before enable_tide"
        )
    names = {id(m): n or "<root>" for n, m in module.named_modules()}
    fqns = _group_names(groups, names, {id(p): n for n, p in module.named_parameters(remove_duplicate=False)})
    if enabled := [fqns[id(g)] for g in groups if any("_tide_state" in fp.__dict__ for fp in g.fsdp_params)]:
        where = (
            "this module" if len(enabled) == len(groups) else f"group(s) {', '.join(enabled)} of this module"
        )
        raise ValueError(
            f"TIDE is already enabled on {where} (an earlier enable_tide): call that handle's disable() "
            "before enabling it again"
        )
    reasons = {fqns[id(g)]: _ineligible(g) for g in groups}
    rs_verdicts: list[tuple[Any, str | None]] = []  # separate reduce-scatter groups, shared by every group
    if (broken := _check_signatures()) is not None:
        reasons = dict.fromkeys(reasons, f"unsupported FSDP2 internals ({broken})")
    elif config.self_test:
        failed = _self_tests([g for g in groups if reasons[fqns[id(g)]] is None], config, fqns, rs_verdicts)
        reasons.update(failed)
    _install()
    states = []
    for g in groups:
        fqn = fqns[id(g)]
        if reasons[fqn] is None:
            states.append(GroupState(g, config, rs_verdicts))
        else:
            warnings.warn(
                f"TIDE: group {fqn} stays on stock FSDP2: {reasons[fqn]}", TideFallbackWarning, stacklevel=2
            )
    return TideHandle({k: v or "tide" for k, v in reasons.items()}, states)


def _group_names(groups: list[Any], names: dict[int, str], params: dict[int, str]) -> dict[int, str]:
    """Each group's name: its modules' FQNs, with its parameters' names where several groups share modules
    (torch 2.13's per-parameter meshes: an expert weight on its own mesh beside a dense one), so that every
    group has its own verdict."""
    base = {id(g): ",".join(names.get(id(m), "?") for m in g.modules) for g in groups}
    shared = {n for n, k in Counter(base.values()).items() if k > 1}
    out = {}
    for g in groups:
        held = ", ".join(params.get(id(fp.sharded_param), fp._module_info.param_name) for fp in g.fsdp_params)
        out[id(g)] = base[id(g)] if base[id(g)] not in shared else f"{base[id(g)]} [{held}]"
    return out


def _self_tests(
    groups: list[Any], config: TideConfig, fqns: dict[int, str], rs_verdicts: list[tuple[Any, str | None]]
) -> dict[str, str]:
    """Run TIDE's all-gather and reduce-scatter once on each distinct process group; agree on the verdict.
    Returns the groups whose shard group failed (they stay on stock FSDP2); FSDP2's separate reduce-scatter
    groups (torch 2.13 ``set_separate_reduce_scatter_group``) are tested too, their verdicts put in
    ``rs_verdicts``: one that fails keeps stock FSDP2's reduce-scatter only (see
    ``GroupState.rs_group_passes``)."""
    from steptune.comm.fsdp_group import rs_fallback_message
    from steptune.comm.selftest import self_test

    verdicts: dict[int, str | None] = {}
    failed = {}
    users: dict[int, list[str]] = {}
    for g in groups:
        pg = g.mesh_info.shard_process_group
        if id(pg) not in verdicts:
            verdicts[id(pg)] = self_test(pg, g.device, config)
        if verdicts[id(pg)] is not None:
            failed[fqns[id(g)]] = f"self-test failed: {verdicts[id(pg)]}"
            continue
        rs = getattr(g.mesh_info, "reduce_scatter_process_group", None)
        if rs is None or rs is pg:
            continue
        if id(rs) not in verdicts:
            verdicts[id(rs)] = self_test(rs, g.device, config)
            rs_verdicts.append((rs, verdicts[id(rs)]))
        users.setdefault(id(rs), []).append(fqns[id(g)])
    for group, verdict in rs_verdicts:
        if verdict is not None:
            warnings.warn(rs_fallback_message(verdict, "groups " + ", ".join(users[id(group)])),
                          TideFallbackWarning, stacklevel=3)  # fmt: skip
    return failed
