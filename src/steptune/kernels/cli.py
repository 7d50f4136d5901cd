"""`steptune kernels` verbs: problems (list the built-in set) and eval (one candidate, sandboxed)."""

from __future__ import annotations

import argparse
import json
import shlex
import sys
from pathlib import Path
from typing import Any

from steptune.core.argtypes import distinct_paths, output_file, positive_float, positive_int, warn_ignored
from steptune.core.textfile import read_text

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
            + ("; SUSPICIOUS: not credited by optimize (reason above)" if res.extra.get("suspicious") else "")
        )
        ratios = res.extra.get("round_ratios") or []
        lo, hi = (min(ratios), max(ratios)) if ratios else (0.0, 0.0)
        if lo > 0 and hi / lo > 2:  # a busy box: the times beside it may not divide to the speedup
            lines.append(
                f"noise      per-round ratios {lo:.2f}-{hi:.2f}x: the machine was busy while timed; rerun, "
                "or raise --rounds"
            )
        if res.extra.get("unseen_speedup") is not None:
            note, draws = res.extra.get("unseen_note"), len(res.extra.get("unseen_draw_ratios", []))
            lines.append(
                f"unseen     {res.extra['unseen_speedup']:.2f}x on {draws} draws not timed before (one call "
                "each)" + (f"; {note}" if note else "")
            )
    if res.max_abs_diff is not None:
        lines.append(f"max diff   {res.max_abs_diff:.3g} against the reference")
    if res.compile_s is not None:
        lines.append(f"build      {res.compile_s:.2f} s (import and compile)")
    sandbox = res.extra.get("sandbox") or {}
    if sandbox:
        who = (
            "root (the unprivileged user cannot read this Python installation)"
            if sandbox.get("uid") == 0
            else f"uid {sandbox['uid']}"
        )
        net = "no network" if sandbox.get("network_isolated") else "network reachable"
        lines.append(f"sandbox    ran as {who}, {net}")
    return "\n".join(lines)


def _problem_file(spec: str) -> str | None:
    """`--problem` as a path when it names a file (else it is a built-in problem's name)."""
    return spec if Path(spec).is_file() else None


def _eval(args: argparse.Namespace) -> int:
    from steptune.kernels.pool import EvalPool, PoolConfig
    from steptune.kernels.problems import load_problem

    path = Path(args.candidate)
    if not path.is_file():
        raise ValueError(f"--candidate {args.candidate!r} is not a file")
    # the JSON must not replace the candidate or the problem file it was judged against
    distinct_paths(problem=_problem_file(args.problem), candidate=path, json=args.json)
    problem = load_problem(args.problem)
    source = read_text(path, "kernel candidate")
    if args.device == "cuda":
        import torch

        if not torch.cuda.is_available():
            raise ValueError("--device cuda: this machine's torch sees no CUDA device; use --device cpu")
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
        res = pool.evaluate(problem, source)
    print(describe(res, str(path)))
    if args.json:
        out = {
            "verdict": res.verdict,
            "reason": res.reason,
            "speedup": res.speedup,
            "suspicious": bool(res.extra.get("suspicious")),  # optimize does not credit such a speedup
            "ref_time_s": res.ref_time_s,
            "candidate_time_s": res.candidate_time_s,
            "problem": problem.name,
            "candidate": str(path),
            "validation_trials": args.trials,  # details is the profiling job's (it re-validates on 1 trial)
            "details": res.to_json(),
        }
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(out, indent=2) + "\n")
        print(f"wrote: {args.json}")
    from steptune.kernels.evaluate import PROBLEM_ERROR

    if res.reason.startswith(PROBLEM_ERROR):  # the problem file, not the kernel: fix it before judging any
        print(f"steptune kernels eval: error: {problem.path or problem.name}: {res.reason}", file=sys.stderr)
        return 2
    return 0 if res.verdict == "correct" else 1


# Assumptions varied one at a time: feedback's value, early forks' yield, pool size, decode speed.
SWEEPS: tuple[tuple[str, list[Any]], ...] = (
    ("learn", [0.0, 0.06, 0.18]),
    ("p_valid_start", [0.05, 0.25, 0.5]),
    ("eval_gpus", [2, 3, 4, 8]),
    ("decode_tps", [20.0, 40.0, 80.0]),
)


def _bench(args: argparse.Namespace) -> int:
    from rich.console import Console

    from steptune.kernels.bench import bench_table, run_bench, write_json

    console = Console(stderr=True)
    unused = {"examples": ("seeds", "sweep", "wall"), "sim": ("wall", "repeats", "problems"),
              "cpu": ("seeds", "sweep", "repeats", "problems")}  # fmt: skip
    warn_ignored(args, unused[args.lane], f"with --lane {args.lane}")
    if args.lane in ("sim", "cpu"):
        from steptune.kernels.lanes import kv_tier_study, lane_table, run_cpu_lane, run_sim_lane, sweep

        with console.status(f"{args.lane} lane ...") as status:
            if args.lane == "sim":
                report = run_sim_lane(seeds=args.seeds, progress=status.update)
                report["kv_tier"] = kv_tier_study(seeds=args.seeds, progress=status.update)
                if args.sweep:
                    report["sweeps"] = {}
                    for param, values in SWEEPS:
                        status.update(f"sweep {param}")
                        report["sweeps"][param] = sweep(param, values, seeds=max(5, args.seeds // 2))
            else:
                report = run_cpu_lane(wall_s=args.wall, progress=status.update)
        if args.json:
            print(f"wrote: {write_json(report, args.json)}")
        lane_table(report).print()
        return 0
    with console.status("profiling ...") as status:
        # spaces or commas, as the other verbs' list flags take them (a sweep: "a,b" was one unknown name)
        names = [n for item in args.problems or () for n in item.split(",") if n]
        report = run_bench(repeats=args.repeats, problems=names or None, progress=status.update)
    if args.json:  # first: nothing measured is lost if printing fails
        print(f"wrote: {write_json(report, args.json)}")
    bench_table(report).print()
    n, fast, sep = len(report["rows"]), report["problems_fast"], report["problems_separated"]
    print(
        f"{fast} of {n} problems: the fast C kernel beat the reference in every profile; "
        f"{sep} separate fast from slow in all {args.repeats} repeats"
    )
    return 0


def _check_server(base_url: str, model: str) -> None:
    """Fail before the search starts when the server is not there (one GET /models, 10 s)."""
    import httpx

    url = base_url.rstrip("/") + "/models"
    try:
        resp = httpx.get(url, timeout=10.0)
        resp.raise_for_status()
        names = [m.get("id") for m in resp.json().get("data", [])]
    except (httpx.HTTPError, httpx.InvalidURL, ValueError, AttributeError) as exc:
        raise ValueError(
            f"--llm-url {base_url}: GET {url} failed ({type(exc).__name__}: {exc}). Start an "
            "OpenAI-compatible server there (vLLM, SGLang, or steptune.kernels.llm.replay's ReplayServer) "
            "and pass its /v1 base URL"
        ) from None
    if names and model not in names:
        print(f"warning: --model {model!r} is not among the server's models {names}", file=sys.stderr)


def _optimize(args: argparse.Namespace) -> int:
    from steptune.kernels.optimize import OptimizeInterrupted, optimize
    from steptune.kernels.problems import load_problem
    from steptune.kernels.search import POLICIES, SearchConfig
    from steptune.kernels.termination import Budget, TerminationConfig

    if args.policy not in POLICIES:
        raise ValueError(f"unknown --policy {args.policy!r}: choose one of {', '.join(POLICIES)}")
    problem = load_problem(args.problem)
    out = Path(args.out or f"{problem.name}_best.py")
    # before the search: a clash would overwrite the problem file or lose the kernel or the JSON at its end
    distinct_paths(problem=_problem_file(args.problem), out=out, json=args.json)
    _check_server(args.llm_url, args.model)
    config = SearchConfig(
        policy=args.policy,
        budget=Budget(wall_s=args.wall, tokens=args.tokens, iterations=args.iterations),
        termination=TerminationConfig(target_speedup=args.target),
        stop_at_target=args.target is not None,
    )

    def progress(search: Any) -> None:
        if sys.stderr.isatty():
            best = f"{search.best:.2f}x" if search.best else "-"
            print(f"\r{len(search.feedback)} evaluated, best {best}", end="", file=sys.stderr, flush=True)

    try:
        res = optimize(problem, base_url=args.llm_url, model=args.model, config=config, progress=progress)
    except OptimizeInterrupted as exc:  # Ctrl-C or SIGTERM: write what was found, then stop as asked
        _report(args, problem, exc.result, out)
        raise (exc.__cause__ or exc) from None
    return _report(args, problem, res, out)


def _report(args: argparse.Namespace, problem: Any, res: Any, out: Path) -> int:
    """Print the search's summary, write the best kernel and the JSON; the exit status."""
    rep = res.report
    if sys.stderr.isatty():
        print(file=sys.stderr)
    print(f"problem     {problem.name} ({problem.description})")
    print(f"policy      {rep.policy}: {rep.iterations} iterations, {rep.elapsed_s:.1f} s")
    print(f"stopped by  {rep.stop_reason}")
    for note in rep.notes:
        print(f"note        {note}")
    parts = ", ".join(f"{k} {v}" for k, v in rep.tokens.items())
    print(f"tokens      {sum(rep.tokens.values())} generated ({parts})")
    n_eval = len(res.feedback)
    print(f"evaluated   {n_eval} candidates, {rep.feedback_count} profiled, {rep.early_stops} early stops")
    counts: dict[str, int] = {}
    for fb in res.feedback:
        counts[fb.verdict] = counts.get(fb.verdict, 0) + 1
    print("verdicts    " + ", ".join(f"{v} {n}" for v, n in sorted(counts.items())))
    best = res.best_correct  # the fastest profiled one, else a correct one without a measured speedup
    if best is None:
        print("best        none correct: read the reasons in the JSON and adjust the prompt or the model")
        code = 1
    else:
        c = best.candidate
        where = f"from {c.origin} in iteration {c.iteration} at {c.created_s:.1f} s"
        if best.speedup is not None:
            print(f"best        {best.speedup:.2f}x the reference, {where}")
        else:  # correct, but no speedup to rank it by: still the search's result, said as such
            print(f"best        a correct kernel without a measured speedup, {where} ({best.reason})")
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(c.code)
        again = shlex.join(
            ["steptune", "kernels", "eval", "--problem", args.problem, "--candidate", str(out)]
        )
        print(f"wrote: {out} (the best kernel; check it with {again})")
        code = 0
    if args.json:
        data = {
            "report": rep.to_json(),
            "candidates": [
                {
                    "origin": f.candidate.origin,
                    "iteration": f.candidate.iteration,
                    "verdict": f.verdict,
                    "speedup": f.speedup,
                    "reason": f.reason,
                    "at_s": f.at_s,
                    "code": f.candidate.code,
                }
                for f in res.feedback
            ],
        }
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(data, indent=2) + "\n")
        print(f"wrote: {args.json}")
    from steptune.kernels.agent import PROBLEM_ERROR

    if rep.stop_reason.startswith(PROBLEM_ERROR):  # the problem file, not the kernels: fix it and rerun
        print(f"steptune kernels optimize: error: {rep.stop_reason}", file=sys.stderr)
        return 2
    if rep.stop_reason.startswith("llm error"):
        print(f"steptune kernels optimize: the LLM server failed, so the search stopped early "
              f"({rep.stop_reason}); what it found is written above", file=sys.stderr)  # fmt: skip
        return 1
    return code


def register(sub: Any) -> None:
    from steptune.core.config import field_docs
    from steptune.kernels.pool import PoolConfig

    docs = field_docs(PoolConfig)
    p = sub.add_parser(
        "kernels",
        help="SpecGen: kernel problems, a sandboxed validation/profiling pool, LLM client and replay server",
        description="SpecGen: agentic kernel optimization. Problems, a sandboxed evaluation pool, an "
        "OpenAI-compatible LLM client and a trace-replay server (issue #11); the search loop with "
        "speculative generation (policy specgen, against sequential, parallel and early_exit), the elastic "
        "allocator and the KV tier (issue #12). `bench --lane sim|cpu` compares the policies "
        "(docs/kernels.md).",
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
    ev.add_argument(
        "--json", type=output_file, default=None, help="also write the result as JSON to this path"
    )
    ev.add_argument("--timeout", type=positive_float, default=60.0, help=docs.get("timeout_s", ""))
    ev.add_argument(
        "--memory-mib", type=positive_float, default=2048, help=docs.get("memory_bytes", "") + " (MiB)"
    )
    ev.add_argument("--trials", type=positive_int, default=5, help=docs.get("trials", ""))
    ev.add_argument("--rounds", type=positive_int, default=15, help=docs.get("rounds", ""))
    ev.add_argument("--device", default="cpu", choices=("cpu", "cuda"), help=docs.get("device", ""))
    ev.set_defaults(func=_eval)
    op = verbs.add_parser(
        "optimize",
        help="search for a faster kernel with an LLM server (vLLM, SGLang, or the replay server)",
        description="Run the search loop against an OpenAI-compatible server; candidates are validated and "
        "profiled in the sandboxed pool; the best kernel is written to a file. Exit 0 when a correct "
        "candidate was found.",
    )
    op.add_argument("--problem", required=True, help="a built-in problem name or a KernelBench-format file")
    op.add_argument("--llm-url", required=True, help="base URL of the server, e.g. http://127.0.0.1:8000/v1")
    op.add_argument("--model", required=True, help="model name as the server knows it")
    op.add_argument("--policy", default="specgen", help="specgen (default), sequential, parallel, early_exit")
    op.add_argument(
        "--wall", type=positive_float, default=1800.0, help="wall-clock budget in seconds (default: 1800)"
    )
    op.add_argument("--tokens", type=positive_int, default=None, help="generated-token budget (forks count)")
    op.add_argument("--iterations", type=positive_int, default=None, help="iteration budget")
    op.add_argument(
        "--target", type=positive_float, default=None, help="stop once a kernel reaches this speedup"
    )
    op.add_argument(
        "--out",
        type=output_file,
        default=None,
        help="where to write the best kernel (default: PROBLEM_best.py)",
    )
    op.add_argument(
        "--json", type=output_file, default=None, help="write the report and every candidate here"
    )
    op.set_defaults(func=_optimize)
    be = verbs.add_parser(
        "bench",
        help="--lane examples: can profiling tell the fast and slow C examples apart? --lane sim|cpu: the "
        "search policies side by side (SpecGen vs sequential, parallel, early exit)",
    )
    be.add_argument(
        "--lane",
        default="examples",
        choices=("examples", "sim", "cpu"),
        help="examples: fast and slow C examples profiled repeatedly; sim: every policy on virtual time "
        "(SIMULATED services); cpu: policies against the replay server and the real pool",
    )
    be.add_argument("--seeds", type=positive_int, default=20, help="sim lane: seeds per policy (default: 20)")
    be.add_argument("--sweep", action="store_true", help="sim lane: add sensitivity sweeps (slower)")
    be.add_argument(
        "--wall", type=positive_float, default=30.0, help="cpu lane: real seconds per policy (default: 30)"
    )
    be.add_argument("--repeats", type=positive_int, default=10, help="profiles per candidate (default: 10)")
    be.add_argument(
        "--problems",
        nargs="*",
        default=None,
        help="subset of problems, by spaces or commas (default: all with examples)",
    )
    be.add_argument("--json", type=output_file, default=None, help="write the report as JSON to this path")
    be.set_defaults(func=_bench)
