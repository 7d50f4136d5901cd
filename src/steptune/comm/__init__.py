"""steptune.comm: TIDE, zero-copy, layout-aware FSDP2 all-gather and bf16->fp32 reduce-scatter.

Built (issue #9): the layout plan, P2P transports, all-gather into per-parameter storage (direct, recursive
doubling), the bf16 -> fp32 reduce-scatter with K-slot staging and Slot-Reuse, ``enable_tide`` for models
wrapped with ``fully_shard`` (fallbacks, self-test), measured accounting and the gloo benchmark.
Issue #10: a per-layer cost model of 16-64 GPU steps (``costmodel``, ``stepmodel``, ``simreport``; SIMULATED,
constants cited in ``constants``), exact byte counts checked against the gloo meters (``counts``), and
``benchmarks/gpu/comm.py`` + ``calibrate`` to fit the model on one GPU.
"""

from steptune._lazy import lazy_exports

# Loaded on first use (steptune._lazy): `steptune --help` and other areas' verbs need none of it.
_EXPORTS = {
    "CommMeter": "steptune.comm.accounting",
    "all_gather_into": "steptune.comm.ag",
    "TideConfig": "steptune.comm.config",
    "TideFallbackWarning": "steptune.comm.config",
    "TideHandle": "steptune.comm.fsdp",
    "enable_tide": "steptune.comm.fsdp",
    "measure": "steptune.comm.fsdp",
    "GroupLayout": "steptune.comm.layout",
    "ParamSpec": "steptune.comm.layout",
    "reduce_scatter_into": "steptune.comm.rs",
}

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

__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
