"""GPU check of the memory area (TapeSAC part 1): replay-only TapeSAC against torch's full
checkpointing (early stop on, and off as torchtitan sets it) and no checkpointing, on a stack of a
few Qwen3-8B-like and Qwen3-30B-A3B-like decoder layers (HF transformers, random weights, bf16).

Rows: no checkpointing, torch full checkpointing (early stop on and off), torchtitan's op-level
SAC, HF every_n_layers=2, Megatron core-attention recompute, PyTorch's auto-SAC decision model
(reproduced on the op costs measured here) at three budgets, replay-only TapeSAC, and TapeSAC
planned (profiled and solved on this GPU) at the limit halfway between full checkpointing's and no
checkpointing's peaks and at each anchor's measured peak.

Per model and policy: median step time (forward+backward, CUDA events, interleaved rounds), peak
allocated bytes of a step (``torch.cuda.max_memory_allocated`` after ``reset_peak_memory_stats``,
and the same minus what was allocated before the step), max |grad - no_ac grad|, and TapeSAC's
replayed ops and recorded forwards. The vocabulary is cut to 32K so the LM head does not dominate
memory; layers and widths are the models' own.

Under 6 minutes on one H200. ``--dry-run`` runs the same code on CPU with tiny configs (the tests
do this). Writes one JSON object to ``--json``.

    CUBLAS_WORKSPACE_CONFIG=:4096:8 PYTHONPATH=src python benchmarks/gpu/memory.py --json $OUT/memory.json
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from pathlib import Path
from typing import Any

# Run as `python benchmarks/gpu/<area>.py`, this folder is sys.path[0], and its kernels.py would shadow the
# `kernels` package that transformers probes for (hub kernels): `import transformers` then fails. Drop it.
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != Path(__file__).resolve().parent]

import torch

from steptune.memory.anchors import ANCHORS
from steptune.memory.measure import POLICIES, apply_policy, max_abs_diff

FIXED = (*POLICIES, *ANCHORS)

MODELS: dict[str, tuple[str, dict[str, Any]]] = {
    "qwen3-8b-like": (
        "qwen3",
        dict(
            hidden_size=4096,
            intermediate_size=12288,
            num_attention_heads=32,
            num_key_value_heads=8,
            head_dim=128,
        ),
    ),
    "qwen3-30b-a3b-like": (
        "qwen3_moe",
        dict(
            hidden_size=2048,
            intermediate_size=6144,
            moe_intermediate_size=768,
            num_experts=128,
            num_experts_per_tok=8,
            num_attention_heads=32,
            num_key_value_heads=4,
            head_dim=128,
            decoder_sparse_step=1,
        ),
    ),
}
TINY = dict(hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2, head_dim=16)
TINY_MOE = dict(TINY, moe_intermediate_size=32, num_experts=4, num_experts_per_tok=2, decoder_sparse_step=1)


def build(name: str, layers: int, vocab: int, device: torch.device, dry: bool) -> torch.nn.Module:
    from transformers import AutoConfig, AutoModelForCausalLM

    family, cfg = MODELS[name]
    if dry:
        cfg = TINY_MOE if family == "qwen3_moe" else TINY
    config = AutoConfig.for_model(family, num_hidden_layers=layers, vocab_size=vocab, **cfg)
    config._attn_implementation = "sdpa"
    config.use_cache = False
    torch.manual_seed(0)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, torch_dtype=torch.bfloat16)
    return model.train()


def step(model: torch.nn.Module, batch: dict[str, torch.Tensor]) -> None:
    model(**batch).loss.backward()


def grads_of(
    model: torch.nn.Module, batch: dict[str, torch.Tensor], policy: str, plans: dict[str, Any]
) -> dict[str, torch.Tensor]:
    model.zero_grad(set_to_none=True)
    with apply_policy(model, policy, None, plans.get(policy)):
        step(model, batch)
    out = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    return out


def peak_of(
    model: torch.nn.Module, batch: dict[str, torch.Tensor], policy: str, plans: dict[str, Any], cuda: bool
) -> dict[str, Any]:
    """Peak allocated bytes of one step, gradients allocated beforehand (CUDA allocator on GPU,
    torch's MemTracker on CPU)."""
    from steptune.memory.measure import measure_peak, phase_probe

    head: list[int] = []
    phases: list[int] = []
    if not cuda:
        peak, static = measure_peak(model, batch, policy, plans=plans, head=head, phases=phases)
        return {
            "peak_bytes": peak,
            "step_peak_above_start_bytes": peak - static,
            "head_peak_bytes": head[0],
            "phase_peaks_bytes": phases,
        }
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    row: dict[str, Any] = {}

    def mark() -> int:  # the peak of the phase that ends here; the next phase's starts from now
        torch.cuda.synchronize()
        phases.append(torch.cuda.max_memory_allocated())
        torch.cuda.reset_peak_memory_stats()
        return phases[-1]

    probe = phase_probe(model, None, mark, head, with_input=True)
    with apply_policy(model, policy, None, plans.get(policy)) as handle, probe:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated()
        loss = model(**batch).loss
        torch.cuda.synchronize()
        # what the forward leaves for backward (kept values, block inputs, logits): with the predicted
        # kept bytes of planned rows, this says which part of the peak model is off
        row["after_forward_bytes"] = torch.cuda.memory_allocated() - before
        row["forward_peak_above_start_bytes"] = torch.cuda.max_memory_allocated() - before
        loss.backward()
        del loss
        row["head_peak_bytes"] = head[0] if head else None
        mark()
        row["phase_peaks_bytes"] = phases
        row["peak_bytes"] = max(phases)
        row["step_peak_above_start_bytes"] = row["peak_bytes"] - before
        if handle is not None:
            row["replayed_ops_per_step"] = handle.stats.replayed_ops
            row["recorded_forwards"] = handle.stats.recorded
    model.zero_grad(set_to_none=True)
    return row


def _kept(plan: Any, profiles: dict[Any, Any]) -> int:
    """The plan's kept bytes over all blocks, as the peak model counts them (the last block apart when
    it keeps everything)."""
    free = plan.last_block is not None
    return sum(
        b.kept_bytes * (profiles[k].num_blocks - (free and profiles[k].has_last))
        for k, b in plan.blocks.items()
    )


def measure_model(name: str, args: argparse.Namespace, device: torch.device) -> dict[str, Any]:
    from steptune.memory.autosac import auto_sac_context, auto_sac_decisions
    from steptune.memory.plan import calibrate, last_free_plan, plan_saves
    from steptune.memory.profile import profile_model

    model = build(name, args.layers, args.vocab, device, args.dry_run)
    g = torch.Generator(device="cpu").manual_seed(1)
    ids = torch.randint(0, args.vocab, (args.batch, args.seq), generator=g).to(device)
    batch = {"input_ids": ids, "labels": ids}
    cuda = device.type == "cuda"
    out: dict[str, Any] = {"policies": {}}
    plans: dict[str, Any] = {}
    rows = out["policies"]
    for policy in FIXED:
        rows[policy] = peak_of(model, batch, policy, plans, cuda)
        print(f"  {name} {policy}: peak {rows[policy]['peak_bytes'] / 2**30:.2f} GiB", flush=True)
    t0 = time.perf_counter()
    profiles = profile_model(model, batch)
    plans["tapesac_plan"] = last_free_plan(profiles)
    last_free_row = peak_of(model, batch, "tapesac_plan", plans, cuda)
    last_free = last_free_row["peak_bytes"]
    replay = rows["tapesac_replay"]
    peak_model = calibrate(
        profiles,
        replay["peak_bytes"],
        last_free,
        replay["head_peak_bytes"],
        last_free_row["head_peak_bytes"],
        last_free_row["phase_peaks_bytes"] if len(last_free_row["phase_peaks_bytes"]) == 3 else None,
    )
    out["profile_s"] = time.perf_counter() - t0
    # PyTorch's auto-SAC decision model (reproduced, steptune.memory.autosac) on the op costs
    # just measured on this device, at three fractions of the block's op memory.
    block = next(iter(profiles.values()))
    for budget in (0.1, 0.25, 0.5):
        label = f"torch_auto_sac@{budget:.2f}"
        plans[label] = auto_sac_context(auto_sac_decisions(block, budget))
        rows[label] = peak_of(model, batch, label, plans, cuda)
        print(f"  {name} {label}: peak {rows[label]['peak_bytes'] / 2**30:.2f} GiB", flush=True)
    floor, top = rows["tapesac_replay"]["peak_bytes"], rows["no_ac"]["peak_bytes"]
    limits = {int((rows["full_ac"]["peak_bytes"] + top) / 2)}  # halfway between full_ac and no_ac
    limits |= {r["peak_bytes"] for a, r in rows.items() if a not in ("no_ac", "tapesac_replay")}
    out["halfway_limit_bytes"] = int((rows["full_ac"]["peak_bytes"] + top) / 2)
    for limit in sorted(x for x in limits if x >= floor):
        label = f"tapesac_plan@{limit / 2**20:.1f}MiB"
        if label in rows:  # two limits within 0.1 MiB: the smaller one stands for both
            continue
        plan = plan_saves(profiles, peak_model, limit)
        plans[label] = plan.save_plan(profiles)
        rows[label] = peak_of(model, batch, label, plans, cuda)
        rows[label].update(
            limit_bytes=limit,
            predicted_peak_bytes=plan.predicted_peak,
            predicted_kept_bytes=_kept(plan, profiles),
            solve_s=plan.solve_s,
            last_block=plan.last_block,
        )
        print(
            f"  {name} {label}: peak {rows[label]['peak_bytes'] / 2**30:.2f} GiB "
            f"(predicted {plan.predicted_peak / 2**30:.2f})",
            flush=True,
        )
    names = list(rows)
    # Gradients under deterministic algorithms where torch has them (warn-only elsewhere); the
    # no_ac row compares two plain runs, so it is the floor any policy can reach.
    torch.use_deterministic_algorithms(True, warn_only=True)
    try:
        reference = grads_of(model, batch, "no_ac", plans)
        for policy in names:
            rows[policy]["grad_max_abs_diff"] = max_abs_diff(reference, grads_of(model, batch, policy, plans))
    finally:
        torch.use_deterministic_algorithms(False)
    times: dict[str, list[float]] = {p: [] for p in names}
    for r in range(args.warmup + args.repeats):
        for policy in names:
            with apply_policy(model, policy, None, plans.get(policy)):
                model.zero_grad(set_to_none=False)
                if cuda:
                    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                    start.record()
                    step(model, batch)
                    end.record()
                    end.synchronize()
                    elapsed = start.elapsed_time(end) / 1e3
                else:
                    t0 = time.perf_counter()
                    step(model, batch)
                    elapsed = time.perf_counter() - t0
            if r >= args.warmup:
                times[policy].append(elapsed)
        print(f"  {name} timing round {r + 1}/{args.warmup + args.repeats}", flush=True)
    for policy, ts in times.items():
        rows[policy]["step_time_s"] = statistics.median(ts)
        rows[policy]["step_times_s"] = ts
    tape = rows["tapesac_replay"]["step_time_s"]
    out["tapesac_time_over"] = {p: tape / rows[p]["step_time_s"] for p in names}
    del model
    if cuda:
        torch.cuda.empty_cache()
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--dry-run", action="store_true", help="CPU, tiny configs (for the tests)")
    parser.add_argument("--json", required=True)
    parser.add_argument("--models", nargs="+", default=list(MODELS), choices=list(MODELS))
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--seq", type=int, default=8192)
    parser.add_argument("--vocab", type=int, default=32768)
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=2)
    args = parser.parse_args(argv)
    if args.dry_run:
        args.layers, args.seq, args.vocab, args.repeats, args.warmup = 2, 32, 256, 2, 1
        device = torch.device("cpu")
    elif not torch.cuda.is_available():
        print("no CUDA device: run with --dry-run on CPU", file=sys.stderr)
        return 2
    else:
        device = torch.device("cuda")
    t0 = time.perf_counter()
    result: dict[str, Any] = {
        "device": torch.cuda.get_device_name() if device.type == "cuda" else platform.processor() or "cpu",
        "torch": torch.__version__,
        "dry_run": args.dry_run,
        "layers": args.layers,
        "batch": args.batch,
        "seq": args.seq,
        "vocab": args.vocab,
        "repeats": args.repeats,
        "models": {},
    }
    for name in args.models:
        print(f"{name} ...", flush=True)
        result["models"][name] = measure_model(name, args, device)
    result["wall_s"] = time.perf_counter() - t0
    text = json.dumps(result, indent=1)
    with open(args.json, "w") as f:
        f.write(text)
    print(json.dumps({m: r["tapesac_time_over"] for m, r in result["models"].items()}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
