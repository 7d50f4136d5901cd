"""Tables of the TIDE cost model (``steptune comm simulate``, the bench's ``"sim"`` rows). SIMULATED."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from steptune.comm.constants import _CALIBRATABLE, CommConstants
from steptune.comm.costmodel import SYSTEMS, layer_comm, wave_slowdown
from steptune.comm.stepmodel import StepConfig, StepResult, simulate_step
from steptune.core.report import Table
from steptune.core.specs import LayerKind, cluster_preset, model_preset

__all__ = [
    "DEFAULT_CLUSTERS",
    "DEFAULT_MODELS",
    "buffer_sweep",
    "headline",
    "sim_rows",
    "simulate_all",
    "simulate_table",
]

DEFAULT_MODELS = ("llama3.1-70b", "wan2.2-14b", "qwen3-30b-a3b")
DEFAULT_CLUSTERS = ("dgx-h100", "dgx-h200", "gb200-nvl72")
_SIM = "SIMULATED: per-layer event model (docs/comm.md), not a measurement"


def simulate_all(
    model: str, cluster: str, gpus: int, consts: CommConstants, tokens: int = 8192
) -> dict[str, StepResult]:
    spec, c = model_preset(model), cluster_preset(cluster)
    if gpus > c.num_gpus:
        c = c.with_nodes(-(-gpus // c.gpus_per_node))
    cfg = StepConfig(num_gpus=gpus, tokens_per_gpu=tokens)
    return {s.value: simulate_step(spec, c, cfg, s, consts) for s in SYSTEMS}


def _constants_note(consts: CommConstants) -> str:
    if not consts.calibrated_from:
        return "constants: as cited (none calibrated on hardware)"
    cited = [k for k in _CALIBRATABLE if k not in consts.fitted]
    return f"constants: {', '.join(consts.fitted)} measured ({consts.calibrated_from})" + (
        f"; {', '.join(cited)} as cited" if cited else ""
    )


def simulate_table(model: str, cluster: str, gpus: int, consts: CommConstants, tokens: int = 8192) -> Table:
    res = simulate_all(model, cluster, gpus, consts, tokens)
    stock = res["stock"].step_time_s
    t = Table(
        title=f"{model} on {gpus} x {cluster}, {tokens} tokens/GPU: one FSDP2 step",
        columns=[
            "system",
            "step s",
            "vs stock",
            "layout",
            "interf. s",
            "exposed s",
            "RS SM-s",
            "RS buf GiB",
            "peak GiB",
        ],
        notes=[_SIM, _constants_note(consts)],
    )
    preset = cluster_preset(cluster)
    device_note = consts.device_note(preset.device)
    if device_note:
        t.notes.append(device_note)
    if gpus > preset.num_gpus:  # the preset is a node type: the cluster grows to fit the world
        nodes = -(-gpus // preset.gpus_per_node)
        t.notes.append(
            f"{cluster} has {preset.num_gpus} GPUs as a preset; simulated with {nodes} nodes of "
            f"{preset.gpus_per_node} (same node and links)"
        )
    for name, r in res.items():
        t.add(
            name,
            round(r.step_time_s, 3),
            f"{r.step_time_s / stock - 1:+.1%}",
            f"{r.layout_share:.1%}",
            round(r.interference_s, 3),
            round(r.exposed_comm_s, 3),
            round(r.rs_sm_time_s, 3),
            round(r.rs_buffer_bytes / 2**30, 3),
            round(r.peak_buffer_bytes / 2**30, 3),
        )
    return t


def sim_rows(
    models: Sequence[str] = DEFAULT_MODELS,
    gpus: Sequence[int] = (16, 32, 64),
    cluster: str = "dgx-h100",
    consts: CommConstants | None = None,
) -> list[dict[str, Any]]:
    consts = consts or CommConstants()
    rows = []
    for m in models:
        for w in gpus:
            for name, r in simulate_all(m, cluster, w, consts).items():
                rows.append(
                    {
                        "model": m,
                        "gpus": w,
                        "cluster": cluster,
                        "system": name,
                        "step_time_s": r.step_time_s,
                        "layout_share": r.layout_share,
                        "rs_sm_time_s": r.rs_sm_time_s,
                        "peak_buffer_bytes": r.peak_buffer_bytes,
                        "rs_buffer_bytes": r.rs_buffer_bytes,
                        "interference_s": r.interference_s,
                        "simulated": True,
                    }
                )
    return rows


def buffer_sweep(
    out_params: int, gpus: Sequence[int], cluster: str, consts: CommConstants, *, slot_reuse: bool = False
) -> dict[str, dict[int, int]]:
    """Reduce-scatter buffer bytes at a fixed per-GPU output of ``out_params`` (the layer grows with W)."""
    c = cluster_preset(cluster)
    out: dict[str, dict[int, int]] = {s.value: {} for s in SYSTEMS}
    for w in gpus:
        cw = c if w <= c.num_gpus else c.with_nodes(-(-w // c.gpus_per_node))
        for s in SYSTEMS:
            out[s.value][w] = layer_comm(
                out_params * w, cw, w, s, consts, slot_reuse=slot_reuse
            ).rs_buffer_bytes
    return out


def headline(consts: CommConstants | None = None, cluster: str = "dgx-h100") -> dict[str, Any]:
    """The figures the paper's abstract states, as this model computes them (Llama-3.1 70B, 8K tokens/GPU)."""
    consts = consts or CommConstants()
    res64 = simulate_all("llama3.1-70b", cluster, 64, consts)
    spec = model_preset("llama3.1-70b")
    decoder = max(
        layer.params for layer in spec.layers if layer.kind in (LayerKind.DECODER, LayerKind.MOE_DECODER)
    )
    out_params = decoder // 16  # a 70B decoder layer's shard at W = 16, kept per GPU as W grows
    sweep = buffer_sweep(out_params, (16, 32, 64), cluster, consts)
    dev = cluster_preset(cluster).device
    return {
        "cluster": cluster,
        "llama70b_64gpu": {k: {"step_time_s": r.step_time_s, "layout_share": r.layout_share,
                                "rs_sm_time_s": r.rs_sm_time_s} for k, r in res64.items()},
        "tide_vs_stock": 1 - res64["tide"].step_time_s / res64["stock"].step_time_s,
        "tide_vs_symmmem": 1 - res64["tide"].step_time_s / res64["symmmem"].step_time_s,
        "stock_layout_share": res64["stock"].layout_share,
        "rs_sm_time_ratio": res64["stock"].rs_sm_time_s / max(res64["tide"].rs_sm_time_s, 1e-30),
        "rs_buffer_at_fixed_output": sweep,
        "single_wave_gemm_slowdown": wave_slowdown(dev.num_sms, dev.num_sms, consts.nccl_ctas) - 1,
    }  # fmt: skip
