"""`steptune kernels` verbs: problems (list the built-in set) and eval (one candidate, sandboxed)."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

__all__ = ["register"]


def _problems(args: argparse.Namespace) -> int:
    from steptune.kernels.problems import builtin_problems, load_problem

    for name in builtin_problems():
        print(f"{name:20s} {load_problem(name).description}")
    return 0


def _fmt_time(s: float | None) -> str:
    if s is None:
        return "-"
    return f"{s * 1e3:.3f} ms" if s >= 1e-4 else f"{s * 1e6:.1f} us"


def describe(res: Any, candidate: str) -> str:
    """The human-readable report of one evaluation."""
    lines = [f"problem    {res.problem}", f"candidate  {candidate}", f"verdict    {res.verdict}"]
    if res.reason:
        lines.append("reason     " + res.reason.strip().replace("\n", "\n           "))
    if res.speedup is not None:
        rounds = res.extra.get("rounds", "?")
        lines.append(
            f"speedup    {res.speedup:.2f}x   reference {_fmt_time(res.ref_time_s)}, candidate "
            f"{_fmt_time(res.candidate_time_s)} (median of {rounds} interleaved rounds, paired ratios)"
        )
    if res.max_abs_diff is not None:
        lines.append(f"max diff   {res.max_abs_diff:.3g} against the reference")
    if res.compile_s is not None:
        lines.append(f"build      {res.compile_s:.2f} s (import and compile)")
    sandbox = res.extra.get("sandbox") or {}
    if sandbox:
        who = "root (nobody cannot read this Python)" if sandbox.get("uid") == 0 else f"uid {sandbox['uid']}"
        net = "no network" if sandbox.get("network_isolated") else "network reachable"
        lines.append(f"sandbox    ran as {who}, {net}")
    return "\n".join(lines)


def _eval(args: argparse.Namespace) -> int:
    from steptune.kernels.pool import EvalPool, PoolConfig
    from steptune.kernels.problems import load_problem

    problem = load_problem(args.problem)
    path = Path(args.candidate)
    if not path.is_file():
        raise ValueError(f"--candidate {args.candidate!r} is not a file")
    config = PoolConfig(
        num_workers=1,
        timeout_s=args.timeout,
        memory_bytes=int(args.memory_mib * 2**20),
        trials=args.trials,
        rounds=args.rounds,
        device=args.device,
    )
    if sys.stderr.isatty():
        print(f"evaluating {path} on {problem.name} ...", file=sys.stderr)
    with EvalPool(config) as pool:
        res = pool.evaluate(problem, path.read_text())
    print(describe(res, str(path)))
    if args.json:
        out = {
            "verdict": res.verdict,
            "reason": res.reason,
            "speedup": res.speedup,
            "ref_time_s": res.ref_time_s,
            "candidate_time_s": res.candidate_time_s,
            "problem": problem.name,
            "candidate": str(path),
            "details": res.to_json(),
        }
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(out, indent=2) + "\n")
        print(f"wrote: {args.json}")
    return 0 if res.verdict == "correct" else 1


def _bench(args: argparse.Namespace) -> int:
    from rich.console import Console

    from steptune.kernels.bench import bench_table, run_bench, write_json

    console = Console(stderr=True)
    with console.status("profiling ...") as status:
        report = run_bench(repeats=args.repeats, problems=args.problems or None, progress=status.update)
    if args.json:  # first: nothing measured is lost if printing fails
        print(f"wrote: {write_json(report, args.json)}")
    bench_table(report).print()
    n, fast, sep = len(report["rows"]), report["problems_fast"], report["problems_separated"]
    print(
        f"{fast} of {n} problems: the fast C kernel beat the reference in every profile; "
        f"{sep} separate fast from slow in all {args.repeats} repeats"
    )
    return 0


def register(sub: Any) -> None:
    from steptune.core.config import field_docs
    from steptune.kernels.pool import PoolConfig

    docs = field_docs(PoolConfig)
    p = sub.add_parser(
        "kernels",
        help="SpecGen: kernel problems, a sandboxed validation/profiling pool, LLM client and replay server",
        description="SpecGen: agentic kernel optimization. Built: problems, the evaluation pool, the LLM "
        "client and the trace-replay server (issue #11). Not built yet: speculative orchestration (#12).",
    )
    verbs = p.add_subparsers(dest="verb", metavar="VERB", required=True)
    lp = verbs.add_parser("problems", help="list the built-in CPU problems")
    lp.set_defaults(func=_problems)
    ev = verbs.add_parser(
        "eval",
        help="validate and profile one candidate in the sandbox",
        description="Validate a candidate (a Python file defining ModelNew; C kernels via "
        "steptune.kernels.cext.load_c) against a problem in a sandboxed worker, then profile it against the "
        "reference if it is correct. Exit status 0 when correct, 1 for any other verdict.",
    )
    ev.add_argument("--problem", required=True, help="a built-in problem name or a KernelBench-format file")
    ev.add_argument("--candidate", required=True, help="the candidate file (defines ModelNew)")
    ev.add_argument("--json", default=None, help="also write the result as JSON to this path")
    ev.add_argument("--timeout", type=float, default=60.0, help=docs.get("timeout_s", ""))
    ev.add_argument("--memory-mib", type=float, default=2048, help=docs.get("memory_bytes", "") + " (MiB)")
    ev.add_argument("--trials", type=int, default=5, help=docs.get("trials", ""))
    ev.add_argument("--rounds", type=int, default=15, help=docs.get("rounds", ""))
    ev.add_argument("--device", default="cpu", choices=("cpu", "cuda"), help=docs.get("device", ""))
    ev.set_defaults(func=_eval)
    be = verbs.add_parser(
        "bench",
        help="profile the fast and slow C examples repeatedly: does profiling tell them apart?",
    )
    be.add_argument(
        "--lane",
        default="examples",
        choices=("examples",),
        help="examples: fast and slow C examples profiled repeatedly (the policy lanes come with issue #12)",
    )
    be.add_argument("--repeats", type=int, default=10, help="profiles per candidate (default: 10)")
    be.add_argument(
        "--problems", nargs="*", default=None, help="subset of problems (default: all with examples)"
    )
    be.add_argument("--json", default=None, help="write the report as JSON to this path")
    be.set_defaults(func=_bench)
