"""GPU check of the memory area (TapeSAC part 1): replay-only TapeSAC against torch's full
checkpointing (early stop on, and off as torchtitan sets it) and no checkpointing, on a stack of a
few Qwen3-8B-like and Qwen3-30B-A3B-like decoder layers (HF transformers, random weights, bf16).

Per model and policy: median step time (forward+backward, CUDA events, interleaved rounds), peak
allocated bytes of a step (``torch.cuda.max_memory_allocated`` after ``reset_peak_memory_stats``,
and the same minus what was allocated before the step), max |grad - no_ac grad|, and TapeSAC's
replayed ops and recorded forwards. The vocabulary is cut to 32K so the LM head does not dominate
memory; layers and widths are the models' own.

Under 4 minutes on one H200. ``--dry-run`` runs the same code on CPU with tiny configs (the tests
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
from typing import Any

import torch

from steptune.memory.measure import POLICIES, apply_policy, max_abs_diff

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


def grads_of(model: torch.nn.Module, batch: dict[str, torch.Tensor], policy: str) -> dict[str, torch.Tensor]:
    model.zero_grad(set_to_none=True)
    with apply_policy(model, policy):
        step(model, batch)
    out = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    return out


def measure_model(name: str, args: argparse.Namespace, device: torch.device) -> dict[str, Any]:
    model = build(name, args.layers, args.vocab, device, args.dry_run)
    g = torch.Generator(device="cpu").manual_seed(1)
    ids = torch.randint(0, args.vocab, (args.batch, args.seq), generator=g).to(device)
    batch = {"input_ids": ids, "labels": ids}
    cuda = device.type == "cuda"
    out: dict[str, Any] = {"policies": {}}
    # Gradients under deterministic algorithms where torch has them (warn-only elsewhere); the
    # no_ac row compares two plain runs, so it is the floor any policy can reach.
    torch.use_deterministic_algorithms(True, warn_only=True)
    try:
        reference = grads_of(model, batch, "no_ac")
        diffs = {p: max_abs_diff(reference, grads_of(model, batch, p)) for p in POLICIES}
    finally:
        torch.use_deterministic_algorithms(False)
    for policy in POLICIES:
        row: dict[str, Any] = {"grad_max_abs_diff": diffs[policy]}
        for p in model.parameters():  # gradients allocated, as after a training loop's first step
            p.grad = torch.zeros_like(p)
        with apply_policy(model, policy) as handle:
            if cuda:
                torch.cuda.synchronize()
                torch.cuda.reset_peak_memory_stats()
            before = torch.cuda.memory_allocated() if cuda else 0
            step(model, batch)
            if cuda:
                torch.cuda.synchronize()
            row["peak_bytes"] = torch.cuda.max_memory_allocated() if cuda else 0
            row["step_peak_above_start_bytes"] = row["peak_bytes"] - before
            if handle is not None:
                row["replayed_ops_per_step"] = handle.stats.replayed_ops
                row["recorded_forwards"] = handle.stats.recorded
                row["forwards"] = handle.stats.forwards
        model.zero_grad(set_to_none=True)
        out["policies"][policy] = row
        print(
            f"  {name} {policy}: peak {row['peak_bytes'] / 2**30:.2f} GiB, diff {row['grad_max_abs_diff']}",
            flush=True,
        )
    times: dict[str, list[float]] = {p: [] for p in POLICIES}
    for r in range(args.warmup + args.repeats):
        for policy in POLICIES:
            with apply_policy(model, policy):
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
        out["policies"][policy]["step_time_s"] = statistics.median(ts)
        out["policies"][policy]["step_times_s"] = ts
    tape = out["policies"]["tapesac_replay"]["step_time_s"]
    out["tapesac_time_over"] = {p: tape / out["policies"][p]["step_time_s"] for p in POLICIES}
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
