"""Per-layer costs of one FSDP2 unit under stock FSDP2, FSDP2+SymmMem and TIDE (SIMULATED inputs).

Contract: pure functions of a layer's parameter count, the cluster, the world size ``W`` and the constants.
One layer is one FSDP unit of ``P`` parameters: bf16 unsharded bytes ``B = 2P``, fp32 master shard ``P/W``.

- Collectives use ``steptune.core.cost.group_collective_time`` (alpha-beta, hierarchical across NVSwitch
  domains, ring inside). All-gather moves ``B``. Stock and SymmMem reduce-scatter ``2B`` (fp32 input,
  ``reduce_dtype=fp32``); TIDE reduce-scatters ``B`` (bf16 rows, fp32 accumulation at the owner).
- Layout copies (stock and SymmMem alike; SymmMem changes buffers, not layouts): the copy-in casts and
  packs the local shard (all-gather stream), the copy-out writes ``B`` per all-gather and the ``chunk_cat``
  writes ``2B`` fp32 per reduce-scatter (both on the compute stream, as FSDP2 issues them). TIDE keeps only
  the cast.
- SMs held while running: NCCL ring all-gather and reduce-scatter ``nccl_ctas``; SymmMem's copy-engine
  all-gather 0 and its symmetric reduce-scatter ``symm_rs_ctas``; TIDE's all-gather 0 and its reduce-scatter
  ``tide_acc_ctas`` only while it accumulates (spread over the collective as an average in the step model).
- Buffers: the largest communication buffer a unit needs beyond its unsharded parameter storage.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from enum import StrEnum

from steptune.comm.constants import CommConstants
from steptune.comm.layout import GroupLayout, ParamSpec
from steptune.comm.rs import staging_numel
from steptune.core.cost import Algorithm, Collective, group_collective_time
from steptune.core.specs import ClusterSpec

__all__ = ["SYSTEMS", "LayerComm", "System", "layer_comm", "wave_slowdown"]


class System(StrEnum):
    STOCK = "stock"
    SYMMMEM = "symmmem"
    TIDE = "tide"


SYSTEMS = tuple(System)


@dataclass(frozen=True, kw_only=True, slots=True)
class LayerComm:
    """Seconds, SMs and bytes of one unit's communication under one system."""

    ag_s: float
    rs_s: float
    ag_sms: float
    """SMs the all-gather holds for its whole duration."""
    rs_sms: float
    """Average SMs the reduce-scatter holds over its duration."""
    copy_in_s: float
    """Before each all-gather, on the all-gather stream."""
    copy_out_s: float
    """After each all-gather, on the compute stream."""
    chunk_cat_s: float
    """Before each reduce-scatter, on the compute stream."""
    rs_sm_time: float
    """SM-seconds of one reduce-scatter (CTAs x duration)."""
    ag_hbm_bytes: float
    """HBM bytes one all-gather moves on this GPU (receive writes; copy engines included)."""
    rs_hbm_bytes: float
    rs_buffer_bytes: int
    """Reduce-scatter staging (stock: the full-group fp32 input; TIDE: K slots, 0 with Slot-Reuse)."""
    peak_buffer_bytes: int
    """Largest communication buffer beyond the unsharded parameters (all-gather or reduce-scatter phase)."""
    layout_bytes: float
    """Bytes written by layout copies per step (two all-gathers and one reduce-scatter)."""


def _layout(params: int, w: int) -> GroupLayout:
    return GroupLayout((ParamSpec((params,)),), w)


def layer_comm(
    params: int,
    cluster: ClusterSpec,
    w: int,
    system: System | str,
    consts: CommConstants,
    *,
    slot_reuse: bool = True,
) -> LayerComm:
    system = System(system)
    c = consts.for_device(cluster.device)
    b = 2.0 * params  # bf16 unsharded bytes
    shard = params / w
    lay = _layout(params, w)
    ag_algo = Algorithm.RECURSIVE if system is System.TIDE and w & (w - 1) == 0 else Algorithm.RING
    ag = group_collective_time(Collective.ALL_GATHER, b, w, cluster, ag_algo)
    rs_bytes = b if system is System.TIDE else 2 * b
    rs = group_collective_time(Collective.REDUCE_SCATTER, rs_bytes, w, cluster)
    cast = shard / c.cast_elems_per_s
    if system is System.TIDE:
        copy_in, copy_out, chunk_cat = cast, 0.0, 0.0
        domain = cluster.gpus_per_node if c.nvls_reduction else 1
        partials = max(1, math.ceil(w / domain)) if c.nvls_reduction else w - 1
        acc = partials * shard / c.accumulate_elems_per_s
        rs_sms = c.tide_acc_ctas * min(1.0, acc / rs) if rs > 0 else 0.0
        rs_sm_time = c.tide_acc_ctas * acc
        ag_sms = 0.0
        k = staging_numel(lay, chunk_numel=c.rs_chunk_bytes // 2, num_slots=c.rs_num_slots, two_phase=False)
        rs_buffer = 0 if slot_reuse else 2 * k
        peak = rs_buffer + 4 * lay.out_numel
        layout_bytes = 2 * 2 * shard
    else:
        copy_in = cast + shard / c.pack_elems_per_s
        copy_out = b / c.copy_out_bytes_per_s
        chunk_cat = params / c.chunk_cat_elems_per_s
        ag_sms = 0.0 if system is System.SYMMMEM else float(c.nccl_ctas)
        rs_sms = float(c.symm_rs_ctas if system is System.SYMMMEM else c.nccl_ctas)
        rs_sm_time = rs_sms * rs
        rs_buffer = 4 * lay.stock_rs_input_numel()
        # all-gather: the flat output (+ the previous one, kept through the next copy-out in forward)
        peak = max(2 * 2 * lay.stock_rs_input_numel(), rs_buffer + 4 * lay.out_numel)
        layout_bytes = 2 * (2 * 2 * shard + b) + 4 * params
    return LayerComm(
        ag_s=ag,
        rs_s=rs,
        ag_sms=ag_sms,
        rs_sms=rs_sms,
        copy_in_s=copy_in,
        copy_out_s=copy_out,
        chunk_cat_s=chunk_cat,
        rs_sm_time=rs_sm_time,
        ag_hbm_bytes=b,
        rs_hbm_bytes=rs_bytes,
        rs_buffer_bytes=int(rs_buffer),
        peak_buffer_bytes=int(peak),
        layout_bytes=layout_bytes,
    )


def wave_slowdown(tiles: int, sms: int, held: float) -> float:
    """GEMM time with ``held`` SMs taken by communication, relative to all ``sms``: wave quantization."""
    if tiles <= 0:
        return 1.0
    free = max(1.0, sms - held)
    return math.ceil(tiles / math.floor(free)) / math.ceil(tiles / sms)
