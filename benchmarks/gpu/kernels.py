"""SpecGen part 1 on one GPU: the evaluation pool validating and profiling CUDA and Triton candidates.

Under 8 minutes on one H200 (nvcc building the load_inline candidate, two search runs). What it measures:
- verdicts of device-agnostic adversarial candidates on CUDA tensors (wrong values, wrong shape, cached and
  stale outputs, the reference op, Sakana's memory-reuse exploit against the CUDA caching allocator, early
  exit), plus a Triton kernel that stores to an illegal address (it must kill only its own child process);
- correct Triton (row softmax) and CUDA load_inline (ReLU) candidates: speedup over the torch reference,
  `--repeats` profiles each, timed with CUDA events and a 256 MB L2 flush per call, one profiling worker.
- the search loop, SpecGen vs Sequential, against a local vLLM/SGLang server (`--llm-url`) when one is
  running, else against the replay server (traces embedding real candidates) with the real pool.
``--dry-run`` runs the same code on CPU with C candidates instead of CUDA/Triton ones (for the tests).

    PYTHONPATH=src python benchmarks/gpu/kernels.py --json $OUT/kernels.json
"""

from __future__ import annotations

import argparse
import json
import platform
import re
import statistics
import sys
import time
from pathlib import Path
from typing import Any

# Run as `python benchmarks/gpu/<area>.py`, this folder is sys.path[0], and its kernels.py would shadow the
# `kernels` package that transformers probes for (hub kernels): `import transformers` then fails. Drop it.
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != Path(__file__).resolve().parent]

import torch

from steptune.kernels.pool import EvalPool, PoolConfig

EXAMPLES = Path(__file__).resolve().parents[2] / "src" / "steptune" / "kernels" / "examples"
ADVERSARIAL = [
    "wrong_values",
    "wrong_shape",
    "cached_output",
    "memory_reuse",
    "calls_reference_op",
    "stale_reference",
    "try_except_fallback",
    "syntax_error",
    "exits_early",
    "honest_torch",
]


def _expect(source: str) -> str | None:
    m = re.search(r"^# expect: (\w+)$", source, re.M)
    return m.group(1) if m else None


def _illegal_triton() -> str:
    src = (EXAMPLES / "softmax" / "triton_kernel.py").read_text()
    bad = src.replace(
        "tl.store(y_ptr + row * cols + offs,", "tl.store(y_ptr + row * cols + offs + (1 << 40),"
    )
    assert bad != src
    return bad


def _search_part(args: argparse.Namespace) -> dict[str, Any]:
    """SpecGen vs Sequential with the real pool: against a local vLLM/SGLang server when given, else the
    replay server with traces that embed real candidates (the cpu lane; on a GPU box its pool is still the
    CPU C lane, since the embedded candidates are C kernels)."""
    from steptune.kernels.lanes import run_cpu_lane

    if args.llm_url:
        from steptune.kernels.optimize import optimize
        from steptune.kernels.problems import load_problem
        from steptune.kernels.search import SearchConfig
        from steptune.kernels.termination import Budget

        rows = {}
        for policy in ("sequential", "specgen"):
            res = optimize(
                load_problem("softmax"),
                base_url=args.llm_url,
                model=args.model or "default",
                config=SearchConfig(policy=policy, budget=Budget(wall_s=args.search_wall)),
                pool_config=PoolConfig(
                    num_workers=2, roles=("validate", "profile"), device="cuda", timeout_s=300
                ),
            )
            rows[policy] = res.report.to_json()
        return {"server": args.llm_url, "policies": rows}
    wall = 2.0 if args.dry_run else args.search_wall  # the dry run checks the path, not the ratio
    rep = run_cpu_lane(wall_s=wall)
    return {"server": "replay", "feedback_per_min_ratio": rep.get("feedback_per_min_ratio"),
            "policies": {k: {m: v[m] for m in ("feedback_count", "feedback_per_min", "early_stops", "server")}
                         for k, v in rep["policies"].items()}}  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--dry-run", action="store_true", help="CPU with C candidates (for the tests)")
    parser.add_argument("--repeats", type=int, default=5, help="profiles per correct candidate")
    parser.add_argument("--json", default=None, help="write the results here")
    parser.add_argument(
        "--llm-url", default=None, help="a local vLLM/SGLang server (default: the replay server)"
    )
    parser.add_argument("--model", default=None, help="the server's model name (with --llm-url)")
    parser.add_argument(
        "--search-wall",
        type=float,
        default=60.0,
        help="seconds per policy in the search part (0 skips it)",
    )
    args = parser.parse_args(argv)
    if not args.dry_run and not torch.cuda.is_available():
        print("no CUDA device: run with --dry-run on CPU", file=sys.stderr)
        return 2
    device = "cpu" if args.dry_run else "cuda"
    t0 = time.perf_counter()
    cases: list[tuple[str, str, str, str]] = []  # (name, problem, source, expected verdict)
    for name in ADVERSARIAL:
        src = (EXAMPLES / "adversarial" / f"{name}.py").read_text()
        cases.append((f"adversarial/{name}", "softmax", src, _expect(src) or "?"))
    if args.dry_run:
        fast = [("softmax/c_fast", "softmax"), ("relu/c_fast", "relu")]
        fast = [(n, p) for n, p in fast if (EXAMPLES / f"{n}.py").is_file()]
        cases.append(
            ("adversarial/segfault", "softmax", (EXAMPLES / "adversarial/segfault.py").read_text(), "crashed")
        )
    else:
        fast = [("softmax/triton_kernel", "softmax"), ("relu/cuda_inline", "relu")]
        cases.append(("triton_illegal_address", "softmax", _illegal_triton(), "crashed"))
    for name, problem in fast:
        cases.append((name, problem, (EXAMPLES / f"{name}.py").read_text(), "correct"))

    config = PoolConfig(num_workers=2, timeout_s=60 if args.dry_run else 300, device=device, rounds=15)
    verdicts: list[dict[str, Any]] = []
    profiles: dict[str, Any] = {}
    with EvalPool(config) as pool:
        futs = [(n, p, e, pool.submit(p, s, kind="validate")) for n, p, s, e in cases]
        for name, problem, expect, fut in futs:
            r = fut.result()
            verdicts.append(
                {
                    "candidate": name,
                    "problem": problem,
                    "expect": expect,
                    "verdict": r.verdict,
                    "ok": r.verdict == expect,
                    "reason": r.reason[:300],
                    "wall_s": r.wall_s,
                    "compile_s": r.compile_s,
                }
            )
            print(f"{name:36s} {r.verdict:14s} (expected {expect}) {r.reason[:90]!r}", flush=True)
        pool.set_roles(["profile", "validate"])  # one profiler: timing runs never share the device
        correct = {
            n: (p, s)
            for n, p, s, _ in cases
            if any(v["candidate"] == n and v["verdict"] == "correct" for v in verdicts)
        }
        for name, (problem, src) in correct.items():
            runs = [pool.submit(problem, src, kind="profile").result() for _ in range(args.repeats)]
            ok = [r for r in runs if r.verdict == "correct" and r.speedup is not None]
            profiles[name] = {
                "problem": problem,
                "speedups": [round(float(r.speedup), 4) for r in ok],  # type: ignore[arg-type]
                "median_speedup": statistics.median(float(r.speedup) for r in ok) if ok else None,  # type: ignore[arg-type]
                "ref_time_s": statistics.median(float(r.ref_time_s) for r in ok) if ok else None,  # type: ignore[arg-type]
                "candidate_time_s": statistics.median(float(r.candidate_time_s) for r in ok) if ok else None,  # type: ignore[arg-type]
                "failed": [f"{r.verdict}: {r.reason[:200]}" for r in runs if r not in ok],
            }
            print(f"profile {name:28s} speedups {profiles[name]['speedups']}", flush=True)
    if args.search_wall <= 0:
        search: dict[str, Any] = {"skipped": "--search-wall 0"}
    else:
        try:
            search = _search_part(args)
        except ImportError as exc:  # the llm extra (starlette, uvicorn) is absent: keep the pool's results
            search = {"skipped": f"missing package {exc.name!r} (pip install 'steptune[llm]')"}
            print(f"search part skipped: {search['skipped']}", file=sys.stderr)
    out = {
        "search": search,
        "dry_run": args.dry_run,
        "device": torch.cuda.get_device_name() if device == "cuda" else platform.processor() or "cpu",
        "torch": torch.__version__,
        "python": platform.python_version(),
        "verdicts": verdicts,
        "all_expected": all(v["ok"] for v in verdicts),
        "profiles": profiles,
        "wall_s": time.perf_counter() - t0,
    }
    print(f"all verdicts as expected: {out['all_expected']}; {out['wall_s']:.0f} s")
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(out, indent=2) + "\n")
        print(f"wrote: {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
