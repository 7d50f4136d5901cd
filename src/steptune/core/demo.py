"""Core demo: a simulated FSDP training step of preset models on preset clusters."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from steptune.core.plot import bars, gantt
from steptune.core.report import Table
from steptune.core.specs import cluster_preset, list_model_presets, model_preset
from steptune.core.stepsim import FSDPStepConfig, simulate_fsdp_step

__all__ = ["DemoResult", "run_core_demo"]


@dataclass(kw_only=True, slots=True)
class DemoResult:
    title: str
    tables: list[Table]
    artifacts: list[Path] = field(default_factory=list)


def run_core_demo(out_dir: Path, *, quick: bool = False) -> DemoResult:
    out_dir.mkdir(parents=True, exist_ok=True)
    presets = Table(
        title="Model presets (analytic, from config numbers)",
        columns=["model", "layers", "params (B)", "active (B)", "seq_len", "train GFLOP/token"],
    )
    for name in list_model_presets():
        m = model_preset(name)
        presets.add(
            name, m.num_layers, m.params / 1e9, m.active_params / 1e9, m.seq_len, m.flops() / m.seq_len / 1e9
        )
    presets.notes.append(
        "train FLOPs = forward + input-gradient + weight-gradient, causal attention at seq_len"
    )

    steps = Table(
        title="Simulated FSDP step on dgx-h100 (8 GPUs per node)",
        columns=["model", "GPUs", "step (ms)", "compute (ms)", "comm (ms)", "exposed comm (ms)", "MFU"],
    )
    cluster = cluster_preset("dgx-h100")
    runs = {}
    for name in ("llama3.1-8b", "llama3.1-70b", "qwen3-30b-a3b"):
        model = model_preset(name)
        for num_gpus in (8, 16, 64):
            r = simulate_fsdp_step(model, cluster, FSDPStepConfig(num_gpus=num_gpus, tokens_per_gpu=8192))
            runs[(name, num_gpus)] = r
            steps.add(
                name,
                num_gpus,
                r.step_time * 1e3,
                r.compute_time * 1e3,
                r.comm_time * 1e3,
                r.exposed_comm * 1e3,
                r.mfu,
            )
    steps.notes += [
        "SIMULATED: matmuls at 50% of 989 TFLOP/s, alpha-beta ring collectives (hierarchical across nodes),",
        "bf16 all-gather and reduce-scatter, prefetch 1, 8192 tokens per GPU; assumptions in docs/core.md.",
        "MoE experts are all-gathered whole (no expert parallelism): why qwen3-30b-a3b is comm-bound.",
    ]
    example = runs[("llama3.1-70b", 64)]
    artifacts = [
        gantt(
            example.spans,
            out_dir / "fsdp_step_llama3.1-70b_64gpu.png",
            title="Simulated FSDP step: llama3.1-70b, 64 x H100",
        ),
        example.trace().write(out_dir / "fsdp_step_llama3.1-70b_64gpu.trace.json"),
        bars(
            [f"{m} @{g}" for (m, g) in runs],
            [r.mfu for r in runs.values()],
            out_dir / "fsdp_mfu.png",
            ylabel="MFU (simulated)",
            title="Simulated FSDP MFU on dgx-h100",
        ),
    ]
    for t, stem in ((presets, "presets"), (steps, "fsdp_step")):
        artifacts += list(t.write(out_dir / stem))
    return DemoResult(
        title="core: model presets and a simulated FSDP step", tables=[presets, steps], artifacts=artifacts
    )
