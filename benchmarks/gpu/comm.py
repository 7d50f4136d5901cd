"""TIDE part 2 on one GPU: the kernel rates and the interference the cost model needs (< 8 min on one H200).

What it measures (CUDA events, median of ``--reps`` after warm-up):
- FSDP2's copy-out (``split_with_sizes_copy`` of a W=8 rank-major all-gather output into per-parameter
  storage, Llama-like parameter shapes) and the reduce-scatter copy-in (``_chunk_cat``, bf16 -> fp32 and
  bf16 -> bf16), vs size;
- the fp32 -> bf16 shard cast and TIDE's fp32 accumulation of bf16 rows;
- batched (``_foreach_copy_``) vs per-tensor copies of 64 small segments;
- a single-wave bf16 GEMM (tiles = SMs) alone, with a concurrent Triton kernel holding k SMs (k = 8, 16, 24,
  32; 1024-thread CTAs so no GEMM CTA fits beside them), and with a concurrent copy-engine transfer (pinned
  host -> device) of the GEMM's operand bytes.
The ``"fit"`` section is what ``steptune comm calibrate`` feeds into the model. ``--dry-run`` runs the rate
measurements on CPU at tiny sizes (no interference section) for the tests.

    PYTHONPATH=src python3 benchmarks/gpu/comm.py --json $OUT/comm.json
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

# Run as `python benchmarks/gpu/<area>.py`, this folder is sys.path[0], and its kernels.py would shadow the
# `kernels` package that transformers probes for (hub kernels): `import transformers` then fails. Drop it.
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != Path(__file__).resolve().parent]

import torch

from steptune.comm.constants import gamma_resolved

W = 8


def _timer(device: torch.device, reps: int) -> Callable[[Callable[[], Any]], float]:
    def run(fn: Callable[[], Any]) -> float:
        for _ in range(2):
            fn()
        times = []
        for _ in range(reps):
            if device.type == "cuda":
                a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                a.record()
                fn()
                b.record()
                b.synchronize()
                times.append(a.elapsed_time(b) / 1e3)
            else:
                t0 = time.perf_counter()
                fn()
                times.append(time.perf_counter() - t0)
        return float(statistics.median(times))

    return run


def _beside(
    side: torch.cuda.Stream, backgrounds: dict[str, Callable[[], Any]], fn: Callable[[], Any], reps: int
) -> dict[str, float]:
    """Median time of ``fn`` alone on the current stream while each background (enqueued first on ``side``,
    and outlasting ``fn``) runs, rounds interleaved across the backgrounds. Every sample is taken the same
    way (synchronize, enqueue the background, time ``fn``), so a ``None`` background gives the baseline
    with the same method. Only ``fn`` lies between the events: the background's host-side enqueue latency is
    not timed (the first H200 run timed it and read a PCIe copy as a 33% GEMM slowdown)."""
    times: dict[str, list[float]] = {k: [] for k in backgrounds}
    for i in range(reps + 2):
        for key, background in backgrounds.items():
            torch.cuda.synchronize()
            with torch.cuda.stream(side):
                background()
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            if i >= 2:  # warm-up
                times[key].append(start.elapsed_time(end) / 1e3)
    torch.cuda.synchronize()
    return {k: float(statistics.median(v)) for k, v in times.items()}


def _layer_shapes(scale: int) -> list[tuple[int, int]]:
    """A Llama-like decoder layer's weights, hidden ``128 * scale`` (q, k, v, o, gate, up, down)."""
    h, kv, f = 128 * scale, 32 * scale, 448 * scale
    return [(h, h), (kv, h), (kv, h), (h, h), (f, h), (f, h), (h, f)]


def _rates_at(
    scale: int, device: torch.device, timeit: Callable[[Callable[[], Any]], float]
) -> dict[str, Any]:
    shapes = _layer_shapes(scale)
    shard = [-(-(a * b) // W) for a, b in shapes]
    total = sum(shard) * W
    ag_out = torch.randn(total, device=device).to(torch.bfloat16)
    params = [torch.empty(W * s, dtype=torch.bfloat16, device=device) for s in shard]
    outs = [p.view(W, -1) for p in params]
    rows: dict[str, Any] = {}
    t = timeit(lambda: torch.split_with_sizes_copy(ag_out.view(W, -1), shard, dim=1, out=outs))
    rows["copy_out"] = {"bytes": 2 * total, "s": t, "bytes_per_s": 2 * total / t}
    grads = [torch.randn(W * s, device=device).to(torch.bfloat16) for s in shard]
    rs_in32 = torch.empty(total, dtype=torch.float32, device=device)
    rs_in16 = torch.empty(total, dtype=torch.bfloat16, device=device)
    t = timeit(lambda: torch._chunk_cat(grads, 0, W, out=rs_in32.view(W, -1)))
    rows["chunk_cat_bf16_fp32"] = {"elems": total, "s": t, "elems_per_s": total / t}
    t = timeit(lambda: torch._chunk_cat(grads, 0, W, out=rs_in16.view(W, -1)))
    rows["chunk_cat_bf16"] = {"elems": total, "s": t, "elems_per_s": total / t}
    master = torch.randn(total, device=device)
    t = timeit(lambda: rs_in16.copy_(master))
    rows["cast"] = {"elems": total, "s": t, "elems_per_s": total / t}
    acc = torch.zeros(total, device=device)
    t = timeit(lambda: acc.add_(rs_in16))
    rows["accumulate"] = {"elems": total, "s": t, "elems_per_s": total / t}
    return rows


def rates(device: torch.device, scales: list[int], reps: int) -> dict[str, Any]:
    timeit = _timer(device, reps)
    out: dict[str, Any] = {}
    for scale in scales:
        for key, row in _rates_at(scale, device, timeit).items():
            out.setdefault(key, []).append(row)
    segs = [torch.randn(4096, device=device) for _ in range(64)]
    dsts = [torch.empty_like(s) for s in segs]
    t_foreach = timeit(lambda: torch._foreach_copy_(dsts, segs))
    t_loop = timeit(lambda: [d.copy_(s) for d, s in zip(dsts, segs, strict=True)])
    out["batched_vs_per_tensor"] = {"segments": 64, "foreach_s": t_foreach, "per_tensor_s": t_loop}
    return out


def interference(reps: int) -> dict[str, Any]:
    import triton
    import triton.language as tl

    @triton.jit
    def spin(out_ptr, iters):  # type: ignore[no-untyped-def]
        acc = tl.zeros((1024,), dtype=tl.float32) + tl.program_id(0)
        for _ in range(iters):
            acc = acc * 0.999 + 1.0
        tl.store(out_ptr + tl.program_id(0) * 1024 + tl.arange(0, 1024), acc)

    dev = torch.device("cuda")
    sms = torch.cuda.get_device_properties(dev).multi_processor_count
    # Tiles of 128 x 256: a GEMM of exactly one wave.
    m, n, k = 128 * 12, 256 * -(-sms // 12), 8192
    a = torch.randn(m, k, device=dev, dtype=torch.bfloat16)
    b = torch.randn(k, n, device=dev, dtype=torch.bfloat16)
    timeit = _timer(dev, reps)
    alone = timeit(lambda: a @ b)
    side = torch.cuda.Stream()
    buf = torch.empty(64 * 1024, device=dev)
    iters = 1 << 14
    with torch.cuda.stream(side):  # size the spin to outlast the GEMM ~4x
        for _ in range(8):
            t0 = torch.cuda.Event(enable_timing=True)
            t1 = torch.cuda.Event(enable_timing=True)
            t0.record(side)
            spin[(8,)](buf, iters, num_warps=32)
            t1.record(side)
            t1.synchronize()
            if t0.elapsed_time(t1) / 1e3 > 4 * alone:
                break
            iters *= 2

    def spin_k(k_sms: int) -> Callable[[], None]:
        return lambda: spin[(k_sms,)](buf, iters, num_warps=32)

    def nothing() -> None:
        return None

    host = torch.empty((a.numel() + b.numel()) * 2, dtype=torch.uint8).pin_memory()
    dst = torch.empty_like(host, device=dev)
    backgrounds: dict[str, Callable[[], Any]] = {"none": nothing}
    backgrounds.update({f"sms_{k}": spin_k(k) for k in (8, 16, 24, 32)})
    backgrounds["ce_copy"] = lambda: dst.copy_(host, non_blocking=True)
    backgrounds["none_again"] = nothing  # the same baseline twice: the method's noise floor
    t = _beside(side, backgrounds, lambda: a @ b, reps)
    t_copy = _timer(dev, reps)(lambda: dst.copy_(host, non_blocking=True))
    held = {str(k): t[f"sms_{k}"] for k in (8, 16, 24, 32)}
    base = t["none"]
    return {
        "sms": sms,
        "gemm": {"m": m, "n": n, "k": k, "alone_s": base, "alone_back_to_back_s": alone},
        "alone_again_s": t["none_again"],
        "with_k_sms_s": held,
        "slowdown_with_k_sms": {kk: v / base - 1 for kk, v in held.items()},
        "with_ce_copy_s": t["ce_copy"],
        "ce_copy_alone_s": t_copy,
        "ce_copy_bytes": host.numel(),
        "device_memory_bytes": torch.cuda.get_device_properties(dev).total_memory,
    }


def fit(r: dict[str, Any], inter: dict[str, Any] | None, hbm_bw: float | None) -> dict[str, float]:
    """The largest size of each rate (steady state), and gamma from the copy-engine interference where it
    is resolved: the slowdown beside the copy must exceed twice what the same baseline measured twice
    differs by (``steptune.comm.constants.gamma_resolved``, the rule calibration applies too). Otherwise
    gamma stays out of the fit (calibration keeps the cited value) and ``inter`` says why."""
    f = {
        "copy_out_bytes_per_s": r["copy_out"][-1]["bytes_per_s"],
        "chunk_cat_elems_per_s": r["chunk_cat_bf16_fp32"][-1]["elems_per_s"],
        "pack_elems_per_s": r["chunk_cat_bf16"][-1]["elems_per_s"],
        "cast_elems_per_s": r["cast"][-1]["elems_per_s"],
        "accumulate_elems_per_s": r["accumulate"][-1]["elems_per_s"],
    }
    if inter is not None and hbm_bw:
        u = min(1.0, inter["ce_copy_bytes"] / max(inter["ce_copy_alone_s"], 1e-9) / hbm_bw)
        slow = inter["with_ce_copy_s"] / inter["gemm"]["alone_s"] - 1
        floor = abs(inter["alone_again_s"] / inter["gemm"]["alone_s"] - 1)
        inter["ce_copy_hbm_fraction"] = u
        inter["hbm_contention_estimate"] = max(0.0, slow / u) if u > 0 else 0.0
        inter["hbm_contention_noise_floor"] = floor / u if u > 0 else 0.0
        inter["hbm_contention_resolved"] = u > 0 and gamma_resolved(inter)  # over twice the noise floor
        if inter["hbm_contention_resolved"]:
            f["hbm_contention"] = inter["hbm_contention_estimate"]
    return f


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--json", required=True)
    p.add_argument("--dry-run", action="store_true", help="CPU, tiny sizes, no interference (for the tests)")
    p.add_argument("--reps", type=int, default=20)
    p.add_argument("--hbm-bandwidth", type=float, default=4.8e12, help="device HBM bytes/s (H200 datasheet)")
    args = p.parse_args(argv)
    dry = args.dry_run or not torch.cuda.is_available()
    device = torch.device("cpu" if dry else "cuda")
    t0 = time.time()
    r = rates(device, [1, 2] if dry else [8, 16, 32, 64], 3 if dry else args.reps)
    inter = None if dry else interference(args.reps)
    result = {
        "dry_run": dry,
        "device": "cpu" if dry else torch.cuda.get_device_name(0),
        "torch": torch.__version__,
        "python": platform.python_version(),
        "rates": r,
        "interference": inter,
        "fit": fit(r, inter, None if dry else args.hbm_bandwidth),
        "wall_s": time.time() - t0,
    }
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result["fit"], indent=2))
    print(f"wrote: {args.json} ({result['wall_s']:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
