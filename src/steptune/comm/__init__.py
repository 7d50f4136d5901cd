"""steptune.comm: TIDE, zero-copy, layout-aware FSDP2 all-gather and bf16->fp32 reduce-scatter.

Built (issue #9): the layout plan, P2P transports, all-gather into per-parameter storage (direct, recursive
doubling), the bf16 -> fp32 reduce-scatter with K-slot staging and Slot-Reuse, ``enable_tide`` for models
wrapped with ``fully_shard`` (fallbacks, self-test), measured accounting and the gloo benchmark.
Issue #10: a per-layer cost model of 16-64 GPU steps (``costmodel``, ``stepmodel``, ``simreport``; SIMULATED,
constants cited in ``constants``), exact byte counts checked against the gloo meters (``counts``), and
``benchmarks/gpu/comm.py`` + ``calibrate`` to fit the model on one GPU.
"""

from steptune.comm.accounting import CommMeter
from steptune.comm.ag import all_gather_into
from steptune.comm.config import TideConfig, TideFallbackWarning
from steptune.comm.fsdp import TideHandle, enable_tide, measure
from steptune.comm.layout import GroupLayout, ParamSpec
from steptune.comm.rs import reduce_scatter_into

__all__ = [
    "CommMeter",
    "GroupLayout",
    "ParamSpec",
    "TideConfig",
    "TideFallbackWarning",
    "TideHandle",
    "all_gather_into",
    "enable_tide",
    "measure",
    "reduce_scatter_into",
]
