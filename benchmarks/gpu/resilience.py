"""GPU check of the resilience area: does the workload model hold on real kernels, and does the
workload-aware detector tell a real slowdown from sequence-length variability?

1. Predictor: a block of a preset model's decoder layers (bf16, varlen causal flash attention where
   torch has it, else one SDPA call per sequence) runs microbatches packed from a length preset.
   Per microbatch, CUDA-event times of forward and of forward+backward. ``WorkloadPredictor``
   (c0 + c1 N + c2 sum(len^2), NNLS) is fitted on a warm-up window and scored on the rest (MAPE),
   beside a constant predictor, a linear-in-N one, and the analytic FLOPs model with one fitted
   efficiency.
2. Detector: ``--units`` emulated data-parallel ranks, each its own packed microbatch per step, run
   in turn on the one GPU. From step ``--slow-from`` on, one unit's work contends with GEMMs on a
   second stream (a real slowdown, whatever size it turns out to be; it is measured and reported).
   ResiHP's detector, the fixed 10% threshold and the change-point detector watch the same timeline.

Under 2 minutes on one H200. ``--dry-run`` runs the same code on CPU with a tiny model (the tests
do this). Writes one JSON object to ``--json``.

    PYTHONPATH=src python benchmarks/gpu/resilience.py --json $OUT/resilience.json
"""

from __future__ import annotations

import argparse
import json
import math
import platform
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

# Run as `python benchmarks/gpu/<area>.py`, this folder is sys.path[0], and its kernels.py would shadow the
# `kernels` package that transformers probes for (hub kernels): `import transformers` then fails. Drop it.
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != Path(__file__).resolve().parent]

import numpy as np
import torch
import torch.nn.functional as F
from scipy.optimize import nnls
from torch import nn

from steptune.core.specs import Phase, cluster_preset, model_preset
from steptune.resilience.detect import ChangePointDetector, FixedThresholdDetector, ResiHPDetector
from steptune.resilience.predict import PredictorConfig, WorkloadPredictor, mape
from steptune.resilience.workload import LENGTH_PRESETS, StageModel, features, pack


@dataclass(frozen=True)
class Shape:
    hidden: int
    ffn: int
    heads: int
    layers: int


class Block(nn.Module):
    """A LLaMA-style decoder layer over packed sequences (RMSNorm, attention, SwiGLU; no RoPE)."""

    def __init__(self, s: Shape) -> None:
        super().__init__()
        self.heads = s.heads
        self.n1, self.n2 = nn.RMSNorm(s.hidden), nn.RMSNorm(s.hidden)
        self.qkv = nn.Linear(s.hidden, 3 * s.hidden, bias=False)
        self.o = nn.Linear(s.hidden, s.hidden, bias=False)
        self.up = nn.Linear(s.hidden, 2 * s.ffn, bias=False)
        self.down = nn.Linear(s.ffn, s.hidden, bias=False)

    def forward(self, x: torch.Tensor, lengths: list[int], attn: Any) -> torch.Tensor:
        t, h = x.shape
        q, k, v = self.qkv(self.n1(x)).view(t, 3, self.heads, h // self.heads).unbind(1)
        x = x + self.o(attn(q, k, v, lengths).reshape(t, h))
        g, u = self.up(self.n2(x)).chunk(2, dim=-1)
        return x + self.down(F.silu(g) * u)


def sdpa_loop(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, lengths: list[int]) -> torch.Tensor:
    outs, start = [], 0
    for n in lengths:
        sl = slice(start, start + n)
        qs, ks, vs = (z[sl].transpose(0, 1).unsqueeze(0) for z in (q, k, v))
        outs.append(F.scaled_dot_product_attention(qs, ks, vs, is_causal=True)[0].transpose(0, 1))
        start += n
    return torch.cat(outs)


def make_varlen() -> Any | None:
    """Causal varlen flash attention from torch.nn.attention.varlen, across its 2.11-2.13 signatures."""
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:
        return None

    def attn(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, lengths: list[int]) -> torch.Tensor:
        cu = torch.tensor([0, *np.cumsum(lengths)], device=q.device, dtype=torch.int32)
        m = max(lengths)
        try:
            return varlen_attn(q, k, v, cu, cu, m, m, window_size=(-1, 0))
        except TypeError:
            return varlen_attn(q, k, v, cu, cu, m, m, is_causal=True)

    return attn


class Timer:
    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"

    def __call__(self, fn: Any) -> float:
        if self.cuda:
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            fn()
            b.record()
            b.synchronize()
            return a.elapsed_time(b) / 1e3
        t0 = time.perf_counter()
        fn()
        return time.perf_counter() - t0


def run_mb(model: nn.ModuleList, x: torch.Tensor, lengths: list[int], attn: Any, backward: bool) -> None:
    y = x
    for blk in model:
        y = blk(y, lengths, attn)
    if backward:
        y.float().square().mean().backward()


@dataclass(frozen=True)
class Rig:
    """What both studies run on: the block, its attention, the device, the timer and the RNG."""

    model: nn.ModuleList
    attn: Any
    shape: Shape
    dev: torch.device
    dtype: torch.dtype
    rng: np.random.Generator
    timer: Timer

    def time(self, lengths: list[int], *, backward: bool, before: Any = None) -> float:
        """Seconds of one microbatch of packed ``lengths`` (fresh input, cleared grads); ``before``
        runs inside the timed region first (the contention of the detector study)."""
        x = torch.randn(
            sum(lengths), self.shape.hidden, device=self.dev, dtype=self.dtype, requires_grad=True
        )
        self.model.zero_grad(set_to_none=True)

        def work() -> None:
            if before is not None:
                before()
            run_mb(self.model, x, lengths, self.attn, backward=backward)

        return self.timer(work)


def nnls_mape(xs: np.ndarray, ys: np.ndarray, cols: list[int], warm: int) -> float:
    coef, _ = nnls(xs[:warm][:, cols], ys[:warm])
    return mape(xs[warm:][:, cols] @ coef, ys[warm:])


def predictor_study(args: argparse.Namespace, rig: Rig) -> dict[str, Any]:
    dist = LENGTH_PRESETS[args.lengths]
    spec = model_preset(args.model)
    stage = StageModel(
        layers=tuple(spec.layers[1 : 1 + rig.shape.layers]),
        device=cluster_preset("dgx-h200").device,
        efficiency=1.0,
    )
    fl, fq = stage.coefficients(Phase.F)
    out: dict[str, Any] = {}
    for budget in args.budgets:
        mbs = pack(rig.rng, dist, budget, args.samples)
        rows = []
        for i, lengths in enumerate(mbs):
            tf = rig.time(lengths, backward=False)
            tfb = rig.time(lengths, backward=True)
            n, q = features(lengths)
            rows.append((n, q, len(lengths), tf, tfb))
            if (i + 1) % 20 == 0:
                print(f"  budget {budget}: {i + 1}/{len(mbs)} microbatches", flush=True)
        arr = np.array(rows)
        warm = args.warmup
        res: dict[str, Any] = {
            "microbatches": len(rows),
            "warmup": warm,
            "mean_seqs": float(arr[:, 2].mean()),
        }
        for name, col, phases in (
            ("forward", 3, (Phase.F,)),
            ("forward_backward", 4, (Phase.F, Phase.B, Phase.W)),
        ):
            ys = arr[:, col]
            pred = WorkloadPredictor(PredictorConfig(warmup=warm))
            for n, q, y in zip(arr[:warm, 0], arr[:warm, 1], ys[:warm], strict=True):
                pred.observe("stage", n, q, y)
            ours = [pred.predict("stage", n, q) for n, q in zip(arr[warm:, 0], arr[warm:, 1], strict=True)]
            feats = np.column_stack([np.ones(len(arr)), arr[:, 0] / 1e4, arr[:, 1] / 1e8, arr[:, 2]])
            flops = np.array(
                [
                    sum((lambda c: c[0] * n + c[1] * q)(stage.coefficients(p)) for p in phases)
                    for n, q in arr[:, :2]
                ]
            )
            eff = float(np.median(flops[:warm] / ys[:warm]))  # achieved FLOP/s in the warm-up window
            res[name] = {
                "mean_s": float(ys.mean()),
                "cv": float(ys.std() / ys.mean()),
                "mape": {
                    "resihp_nnls": mape(ours, ys[warm:]),
                    "with_nseq": nnls_mape(feats, ys, [0, 1, 2, 3], warm),
                    "linear_tokens": nnls_mape(feats, ys, [0, 1], warm),
                    "constant": mape(np.full(len(ys) - warm, ys[:warm].mean()), ys[warm:]),
                    "analytic_flops": mape(flops[warm:] / eff, ys[warm:]),
                },
                # The dry run's tiny block is not the preset's: its FLOP rate means nothing.
                "achieved_tflops": None if args.dry_run else eff / 1e12,
                # Median share of the attention (sum len^2) term in the forward FLOPs.
                "quad_share": float(np.median(fq * arr[:, 1] / (fl * arr[:, 0] + fq * arr[:, 1]))),
            }
        out[str(budget)] = res
    return out


def detector_study(args: argparse.Namespace, rig: Rig) -> dict[str, Any]:
    dev, dtype = rig.dev, rig.dtype
    dist = LENGTH_PRESETS[args.lengths]
    budget = args.detect_budget
    side = torch.cuda.Stream() if dev.type == "cuda" else None
    big = torch.randn(args.contention, args.contention, device=dev, dtype=dtype)

    def contend() -> None:
        if side is None:
            for _ in range(args.contention_gemms):
                big @ big  # CPU: serial work in the timed region stands in for contention
            return
        with torch.cuda.stream(side):
            for _ in range(args.contention_gemms):
                big @ big

    pred = WorkloadPredictor(PredictorConfig(warmup=args.warmup))
    dets = {
        "resihp": ResiHPDetector(),
        "fixed-threshold": FixedThresholdDetector(0.10),
        "change-point": ChangePointDetector(),
    }
    alarms: dict[str, list[dict[str, Any]]] = {k: [] for k in dets}
    slow_ratio: list[float] = []
    steps = []
    for step in range(args.steps):
        obs: dict[int, float] = {}
        pr: dict[int, float] = {}
        for u, lengths in enumerate(pack(rig.rng, dist, budget, args.units)):
            slow = step >= args.slow_from and u == args.slow_unit
            t = rig.time(lengths, backward=True, before=contend if slow else None)
            if side is not None:
                torch.cuda.synchronize()
            n, q = features(lengths)
            if not pred.ready("all"):
                pred.observe("all", n, q, t)  # warm-up: the first steps are healthy
            else:
                pr[u] = pred.predict("all", n, q)
                if slow:
                    slow_ratio.append(t / pr[u])
                else:
                    pred.observe("all", n, q, t)  # gated by the healthy band inside
            obs[u] = t
        steps.append(max(obs.values()))
        if len(pr) < len(obs):
            continue  # predictor still warming up
        for name, det in dets.items():
            seen = {0: max(obs.values())} if name == "change-point" else obs
            p = {0: max(pr.values())} if name == "change-point" else pr
            for a in det.observe(step, seen, p):
                alarms[name].append({"step": a.step, "unit": a.unit})
    out: dict[str, Any] = {
        "units": args.units,
        "steps": args.steps,
        "slow_from": args.slow_from,
        "slow_unit": args.slow_unit,
        "budget": budget,
        "measured_slowdown_median": float(np.median(slow_ratio)) if slow_ratio else None,
        "step_cv_healthy": float(np.std(steps[: args.slow_from]) / np.mean(steps[: args.slow_from])),
    }
    for name, al in alarms.items():
        # The change-point detector watches step time (unit 0 = the job): it cannot localize.
        false = [
            a
            for a in al
            if a["step"] < args.slow_from or (name != "change-point" and a["unit"] != args.slow_unit)
        ]
        hits = [a for a in al if a["step"] >= args.slow_from and a not in false]
        out[name] = {
            "alarms": len(al),
            "false_alarms": len(false),
            "detected": bool(hits),
            "latency_steps": hits[0]["step"] - args.slow_from if hits else None,
        }
    return out


def runtime_study(args: argparse.Namespace, rig: Rig, steps: int = 6) -> dict[str, Any]:
    """``Runtime(emulate=False)`` timing real microbatches on a one-rank gloo group: what ``timed`` records
    (CUDA events once CUDA is in use, read at ``end_step``) against a wall clock synchronized around the
    same microbatch. Before the events, the host clock read the kernels' launch: a ratio far below 1."""
    from datetime import timedelta

    import torch.distributed as dist

    from steptune.resilience.live import stage_model
    from steptune.resilience.runtime import Runtime, RuntimeConfig

    group = dist.ProcessGroupGloo(dist.HashStore(), 0, 1, timedelta(seconds=60))
    rt = Runtime(group, stage_model(), RuntimeConfig(emulate=False))
    lengths = [args.detect_budget // 2] * 2
    recorded, synced = [], []
    for _ in range(steps):
        x = torch.randn(sum(lengths), rig.shape.hidden, device=rig.dev, dtype=rig.dtype, requires_grad=True)
        rig.model.zero_grad(set_to_none=True)
        if rig.dev.type == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        with rt.timed(lengths):
            run_mb(rig.model, x, lengths, rig.attn, backward=True)
        if rig.dev.type == "cuda":
            torch.cuda.synchronize()
        synced.append(time.perf_counter() - t0)
        recorded.append(rt.end_step(tokens=sum(lengths)).rank_compute_s[0])
    ratios = [r / w for r, w in zip(recorded[1:], synced[1:], strict=True)]  # the first warms up
    return {
        "timing": "cuda events" if rt._cuda_timing() else "host clock",
        "recorded_s": recorded,
        "synced_wall_s": synced,
        "recorded_over_synced_median": statistics.median(ratios),
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--json", required=True)
    ap.add_argument("--dry-run", action="store_true", help="tiny model on CPU (what the tests run)")
    ap.add_argument("--model", default="llama2-7b")
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--lengths", default="code", choices=sorted(LENGTH_PRESETS))
    ap.add_argument("--budgets", type=int, nargs="+", default=[8192, 32768])
    ap.add_argument("--samples", type=int, default=80)
    ap.add_argument("--warmup", type=int, default=30)
    ap.add_argument("--units", type=int, default=8)
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--slow-from", type=int, default=40)
    ap.add_argument("--slow-unit", type=int, default=3)
    ap.add_argument("--detect-budget", type=int, default=16384)
    ap.add_argument("--contention", type=int, default=8192, help="side GEMM size")
    ap.add_argument("--contention-gemms", type=int, default=40, help="side GEMMs per slowed microbatch")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    cfg = model_preset(args.model).config
    if args.dry_run:
        dev, dtype = torch.device("cpu"), torch.float32
        shape = Shape(hidden=64, ffn=128, heads=4, layers=args.layers)
        args.budgets, args.samples, args.warmup, args.detect_budget = [512], 24, 10, 512
        args.units, args.steps, args.slow_from, args.contention, args.contention_gemms = 4, 24, 16, 512, 8
        args.lengths = "chat"
    else:
        if not torch.cuda.is_available():
            print("no CUDA device: run with --dry-run on CPU", file=sys.stderr)
            return 2
        dev, dtype = torch.device("cuda"), torch.bfloat16
        shape = Shape(
            hidden=cfg["hidden_size"],
            ffn=cfg["intermediate_size"],
            heads=cfg["num_attention_heads"],
            layers=args.layers,
        )
    torch.manual_seed(args.seed)
    rng = np.random.default_rng(args.seed)
    model = nn.ModuleList(Block(shape) for _ in range(shape.layers)).to(dev, dtype)
    attn = make_varlen() if dev.type == "cuda" else None
    attn_name = "varlen_attn"
    if attn is not None:
        try:
            run_mb(
                model, torch.randn(96, shape.hidden, device=dev, dtype=dtype), [32, 64], attn, backward=True
            )
        except Exception as exc:  # any failure means: use the portable path
            print(f"varlen_attn unusable here ({type(exc).__name__}: {exc}); one SDPA call per sequence")
            attn = None
    if attn is None:
        attn, attn_name = sdpa_loop, "sdpa_per_sequence"
    timer = Timer(dev)
    for _ in range(3):  # warm the kernels and the allocator
        run_mb(
            model,
            torch.randn(args.budgets[0], shape.hidden, device=dev, dtype=dtype, requires_grad=True),
            [args.budgets[0] // 2] * 2,
            attn,
            backward=True,
        )
    t0 = time.perf_counter()
    result: dict[str, Any] = {
        "device": torch.cuda.get_device_name() if dev.type == "cuda" else platform.processor() or "cpu",
        "torch": torch.__version__,
        "dry_run": args.dry_run,
        "model": args.model,
        "shape": shape.__dict__,
        "attention": attn_name,
        "lengths": args.lengths,
    }
    print("predictor study ...", flush=True)
    rig = Rig(model=model, attn=attn, shape=shape, dev=dev, dtype=dtype, rng=rng, timer=timer)
    result["predictor"] = predictor_study(args, rig)
    print("detector study ...", flush=True)
    result["detector"] = detector_study(args, rig)
    print("runtime timing ...", flush=True)
    result["runtime_timing"] = runtime_study(args, rig)
    result["wall_s"] = time.perf_counter() - t0
    with open(args.json, "w") as fh:
        json.dump(
            result, fh, indent=2, default=lambda o: None if isinstance(o, float) and math.isnan(o) else o
        )
    print(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
