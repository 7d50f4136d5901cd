"""One FSDP2 parameter group on TIDE's paths: its layout, slot, transport and the two collectives.

Contract. ``GroupState`` is attached to every ``FSDPParam`` of its group (``fsdp_param._tide_state``) and
replaces, on those instances only, ``free_unsharded_param`` (so a reshard releases the slot, or vacates it for
Slot-Reuse). Everything it builds lazily (layout, slot, transport) depends only on the group's parameter
shapes and process group, so it is identical on every rank. ``detach`` undoes all of it; FSDP2 then rebuilds
its own all-gather outputs and unsharded parameters at the next all-gather.
"""

from __future__ import annotations

import warnings
from typing import Any

import torch
from torch import nn

from steptune.comm.accounting import CommMeter, MeterFanout
from steptune.comm.ag import all_gather_into
from steptune.comm.config import TideConfig, TideFallbackWarning
from steptune.comm.layout import GroupLayout, ParamSpec
from steptune.comm.rs import reduce_scatter_into, staging_numel
from steptune.comm.selftest import self_test
from steptune.comm.slots import Slot
from steptune.comm.transport import ProcessGroupP2P, select_transport

__all__ = ["SENTINEL", "GroupState"]

SENTINEL = torch.empty(0)
"""``all_gather_output`` of TIDE's ``AllGatherResult``: the patched copy-out has nothing to copy."""
_AG_TAG, _RS_TAG = 0x7100, 0x7200  # P2P tags of TIDE's messages (+ round / step)


def _fsdp_internals() -> tuple[Any, Any, Any]:
    from torch.distributed.device_mesh import _get_device_handle
    from torch.distributed.fsdp._fully_shard._fsdp_collectives import AllGatherResult
    from torch.distributed.fsdp._fully_shard._fsdp_param import ShardedState

    return AllGatherResult, ShardedState, _get_device_handle


def rs_fallback_message(verdict: str, users: str) -> str:
    return (
        f"TIDE: FSDP2's separate reduce-scatter group ({users}) failed its self-test ({verdict}): "
        "reduce-scatters on it stay on stock FSDP2; the all-gathers still use TIDE"
    )


class GroupState:
    def __init__(
        self, param_group: Any, config: TideConfig, rs_verdicts: list[tuple[Any, str | None]] | None = None
    ) -> None:
        self.param_group = param_group
        self.config = config
        self.active = True
        self.fsdp_params: list[Any] = list(param_group.fsdp_params)
        self.index = {id(fp): i for i, fp in enumerate(self.fsdp_params)}
        self.layout: GroupLayout | None = None
        self.slot: Slot | None = None
        self.transport: ProcessGroupP2P | None = None
        self._rs_transport: ProcessGroupP2P | None = None
        # Separate reduce-scatter groups and their self-test verdicts (None: passed), shared by every group
        # of one enable_tide (FSDP2 gives them one reduce-scatter group): one set before enable_tide was
        # tested there, one set after it is tested once, at its first use.
        self._rs_checked: list[tuple[Any, str | None]] = [] if rs_verdicts is None else rs_verdicts
        self._rs_layouts: dict[tuple[int, ...], GroupLayout] = {}
        for fp in self.fsdp_params:
            fp._tide_state = self
            fp.free_unsharded_param = self._free_unsharded_param  # instance override, undone by detach

    @property
    def fqn(self) -> str:
        return str(self.param_group._module_fqn or "<root>")

    def detach(self) -> None:
        self.active = False
        for fp in self.fsdp_params:
            fp.__dict__.pop("_tide_state", None)
            fp.__dict__.pop("free_unsharded_param", None)
            if self.slot is not None:
                fp.all_gather_outputs = []
                fp.__dict__.pop("_unsharded_param", None)
        self.slot = None
        self._rs_transport = None

    def rs_group_passes(self, group: Any, device: torch.device) -> bool:
        """Whether TIDE may reduce-scatter on ``group``: the shard group, or a separate reduce-scatter group
        whose self-test passed. A new one is tested here, at its first reduce-scatter (every rank reaches
        it at the same point of backward); one that fails stays on stock FSDP2, with a warning."""
        if group is None or group is self.param_group.mesh_info.shard_process_group:
            return True
        for known, verdict in self._rs_checked:
            if known is group:
                return verdict is None
        verdict = self_test(group, device, self.config) if self.config.self_test else None
        self._rs_checked.append((group, verdict))
        if verdict is not None:
            message = rs_fallback_message(verdict, f"first used by group {self.fqn}")
            warnings.warn(message, TideFallbackWarning, stacklevel=2)
        return verdict is None

    # -- lazy set-up (first all-gather: FSDP2's lazy init has set dtypes and devices by then) ------------
    def _ensure(self, group: Any, device: torch.device) -> tuple[GroupLayout, Slot, ProcessGroupP2P]:
        if self.layout is None or self.slot is None or self.transport is None:
            fp0 = self.fsdp_params[0]
            dtype = fp0.param_dtype or fp0.orig_dtype
            itemsize = torch.empty(0, dtype=dtype).element_size()
            specs = tuple(ParamSpec(tuple(fp._orig_size), fp._param_fqn or "") for fp in self.fsdp_params)
            layout = GroupLayout(specs, group.size(), itemsize, self.config.align_bytes)
            for p, fp in enumerate(self.fsdp_params):
                # enable_tide checked this (_padding_mismatch): a group that pads otherwise stays on stock
                if fp.padded_sharded_param_size.numel() != layout.shard_numel(p):  # pragma: no cover
                    raise AssertionError(
                        f"{fp}: FSDP2 pads to {fp.padded_sharded_param_size}, plan says "
                        f"{layout.shard_numel(p)} elements"
                    )
            self.layout, self.transport = layout, select_transport(group, device)
            self.slot = Slot(layout.slot_numel, dtype, device, persistent=self.config.persistent_slots)
            self._bind(layout, self.slot)
        return self.layout, self.slot, self.transport

    def _bind(self, layout: GroupLayout, slot: Slot) -> None:
        for p, fp in enumerate(self.fsdp_params):
            view = slot.buffer.narrow(0, layout.slot_offset(p), layout.world_size * layout.shard_numel(p))
            fp.all_gather_outputs = [view]
            unsharded = torch.as_strided(
                view, fp._orig_size, fp._contiguous_orig_stride, view.storage_offset()
            )
            fp._unsharded_param = nn.Parameter(unsharded, requires_grad=fp.sharded_param.requires_grad)

    def _free_unsharded_param(self) -> None:
        if self.slot is None:
            return
        from torch.distributed.fsdp._fully_shard._fsdp_common import TrainingState

        pg = self.param_group
        vacate = (
            self.config.slot_reuse
            and pg._training_state == TrainingState.POST_BACKWARD
            and pg.reduce_grads
            # no reduce-scatter follows in a group with nothing to train: its vacated slot stayed allocated
            # until the next forward (a frozen layer held its full unsharded size between steps, a sweep)
            and (
                getattr(pg, "reduce_scatter_unused_params", False)  # an older FSDP2 may lack it
                or any(fp.sharded_param.requires_grad for fp in self.fsdp_params)
            )
        )
        self.slot.release(vacate=vacate)

    # -- the two collectives -------------------------------------------------------------------------------
    def all_gather(
        self, fsdp_params: list[Any], group: Any, device: torch.device, meter: CommMeter | MeterFanout | None
    ) -> Any:
        # Under torch.inference_mode (an eval-only job) the slot would be an inference tensor, which has no
        # version counter to preserve: the first forward raised (a sweep). Parameters are never inference
        # tensors, in any mode.
        with torch.inference_mode(False):
            return self._all_gather(fsdp_params, group, device, meter)

    def _all_gather(
        self, fsdp_params: list[Any], group: Any, device: torch.device, meter: CommMeter | MeterFanout | None
    ) -> Any:
        all_gather_result, sharded_state, _ = _fsdp_internals()
        layout, slot, transport = self._ensure(group, device)
        buffer = slot.acquire()
        shards = []
        for fp in fsdp_params:
            if fp.sharded_state != sharded_state.SHARDED:  # pragma: no cover - excluded at enable time
                raise AssertionError(f"{fp} is {fp.sharded_state}; TIDE gathers from SHARDED only")
            shards.append(fp._sharded_param_data)
        outputs = tuple(fp.all_gather_outputs[0] for fp in fsdp_params)
        sent = transport.stats.total_bytes
        # Writes into parameter storage must not bump the version counter autograd saved (as FSDP2 does).
        with torch.autograd._unsafe_preserve_version_counter(outputs):
            all_gather_into(
                layout,
                buffer,
                shards,
                transport,
                algorithm=self.config.ag_algorithm,
                max_inflight_bytes=self.config.max_inflight_bytes,
                tag=_AG_TAG,
            )
        if meter is not None:
            meter.add_wire("all_gather", buffer.dtype, transport.stats.total_bytes - sent)
            meter.count("tide_all_gather")
        return all_gather_result(SENTINEL, None, None, [], [], [])

    def _rs_layout(self, fsdp_params: list[Any], world_size: int) -> GroupLayout:
        key = tuple(self.index[id(fp)] for fp in fsdp_params)
        if key not in self._rs_layouts:
            specs = tuple(ParamSpec(tuple(fp._orig_size)) for fp in fsdp_params)
            # Padded for a 2-byte gradient: offsets stay aligned for wider ones (fp32: twice the bytes).
            self._rs_layouts[key] = GroupLayout(specs, world_size, 2, self.config.align_bytes)
        return self._rs_layouts[key]

    def reduce(
        self,
        fsdp_params: list[Any],
        unsharded_grads: list[torch.Tensor],
        group: Any,
        rs_stream: Any,
        orig_dtype: torch.dtype | None,
        device: torch.device,
        meter: CommMeter | MeterFanout | None,
    ) -> tuple[Any, ...]:
        _, _, device_handle_of = _fsdp_internals()
        _, slot, transport = self._ensure(group, device)
        if (
            group is not transport.group
        ):  # FSDP2's own reduce-scatter group (set_separate_reduce_scatter_group)
            if self._rs_transport is None or self._rs_transport.group is not group:
                self._rs_transport = select_transport(group, device)
            transport = self._rs_transport
        w = group.size()
        layout = self._rs_layout(fsdp_params, w)
        dtypes = {g.dtype for g in unsharded_grads}
        if len(dtypes) != 1:
            raise AssertionError(f"FSDP reduce-scatter expects uniform gradient dtype but got {dtypes}")
        cfg = self.config
        device_handle = device_handle_of(device.type)
        rs_stream.wait_stream(device_handle.current_stream())
        with device_handle.stream(rs_stream):
            grads = [g.contiguous() for g in unsharded_grads]
            unsharded_grads.clear()
            need = staging_numel(
                layout, chunk_numel=cfg.rs_chunk_numel, num_slots=cfg.rs_num_slots, two_phase=cfg.rs_two_phase
            )
            staging = slot.lend(need, grads[0].dtype) if cfg.slot_reuse else None
            out = torch.empty(layout.out_numel, dtype=torch.float32, device=device)
            sent = transport.stats.total_bytes
            # Lent slot bytes are views of the (resharded) parameters' storage: keep their version counter.
            with torch.autograd._unsafe_preserve_version_counter(slot.buffer):
                stats = reduce_scatter_into(
                    layout,
                    [g.view(-1) for g in grads],
                    out,
                    transport,
                    chunk_numel=cfg.rs_chunk_numel,
                    num_slots=cfg.rs_num_slots,
                    two_phase=cfg.rs_two_phase,
                    staging=staging,
                    divide_by=w,
                    tag=_RS_TAG,
                )
            slot.reclaim()
            del grads
            rs_event = rs_stream.record_event()
            if meter is not None:
                meter.add_wire("reduce_scatter", dtypes.pop(), transport.stats.total_bytes - sent)
                meter.add_staging(stats.staging_bytes, stats.staging_allocated_bytes)
                meter.count("tide_reduce_scatter")
            reduce_output = out if orig_dtype in (None, torch.float32) else out.to(orig_dtype)
            for p, fp in enumerate(fsdp_params):
                # As stock foreach_reduce: a view of the flat shard, assigned or accumulated, then the hooks.
                new_grad = torch.as_strided(
                    reduce_output, fp.sharded_size, fp.contiguous_sharded_stride, layout.out_offset(p)
                )
                if fp.sharded_param.grad is not None:
                    fp.sharded_param.grad._local_tensor += new_grad
                else:
                    fp.sharded_param.grad = fp.to_sharded_dtensor(new_grad)
                for hook in (getattr(fp.sharded_param, "_post_accumulate_grad_hooks", {}) or {}).values():
                    hook(fp.sharded_param)
            post_event = rs_stream.record_event()
        return torch.empty(0, device=device), rs_event, rs_stream, post_event, None, None, None
