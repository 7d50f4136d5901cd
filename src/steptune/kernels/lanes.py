"""Benchmark lanes for the search policies: `sim` (virtual time, SIMULATED services) and `cpu` (the replay
server and the real sandboxed pool, time-scaled).

Sim lane: for every seed, every policy (and SpecGen's ablations) runs with the same seed, budget, target and
number of evaluation GPUs; the services draw from RNGs seeded by (seed, role), so the first candidates of
every policy come from the same distributions. Reported per policy: medians over seeds with bootstrap 95%
confidence intervals; per baseline, the paired per-seed ratios (baseline e2e / SpecGen e2e, SpecGen
feedback / baseline feedback, baseline feedback latency / SpecGen feedback latency, where latency is the
median time from a candidate's creation to its profiling result: what priority is for). A run that never
reaches the target within the budget counts its e2e as the budget (censored; counted in `censored`): that
understates SpecGen's advantage when only the baseline is censored, overstates it when only SpecGen is, and
gives exactly 1.0 when both are (counted per baseline in `censored_both`, `censored_baseline`,
`censored_specgen`).
"""

from __future__ import annotations

import math
import random
import re
import statistics
from collections.abc import Callable
from concurrent.futures import ProcessPoolExecutor
from dataclasses import replace
from typing import Any

from steptune.kernels.clock import run
from steptune.kernels.kvtier import DEFAULT_LOCAL_CAPACITY_TOKENS, KVCostModel, KVTier, NullTier, SimTier
from steptune.kernels.search import Search, SearchConfig
from steptune.kernels.sim import QualityConfig, SimConfig, SimEval, SimLLM
from steptune.kernels.termination import Budget, TerminationConfig

__all__ = [
    "BASELINES",
    "KV_DEPLOYMENTS",
    "VARIANTS",
    "cpu_traces",
    "kv_tier_study",
    "lane_table",
    "run_cpu_lane",
    "run_sim_lane",
    "sim_run",
    "sweep",
]

BASELINES = ("sequential", "parallel", "early_exit")
# name -> (policy, SearchConfig overrides, KV tier on)
VARIANTS: dict[str, tuple[str, dict[str, Any], bool]] = {
    "sequential": ("sequential", {}, True),
    "parallel": ("parallel", {}, True),
    "early_exit": ("early_exit", {}, True),
    "specgen": ("specgen", {}, True),
    "specgen-no-forks": ("specgen", {"forks": False}, True),
    "specgen-no-realloc": ("specgen", {"realloc": False}, True),
    "specgen-no-priority": ("specgen", {"priority": False}, True),
    "specgen-no-kv-tier": ("specgen", {}, False),
    "specgen-no-early-stop": ("specgen", {"early_stop": False}, True),
}


def sim_run(
    variant: str,
    seed: int,
    *,
    wall_s: float = 7200.0,
    tokens: int | None = 1_000_000,
    target: float = 2.0,
    eval_gpus: int = 4,
    sim: SimConfig | None = None,
    quality: QualityConfig | None = None,
    spare_gib_per_gpu: float = 60.0,
    local_kv_tokens: int | None = None,
    prefill_tps: float | None = None,
) -> dict[str, Any]:
    """One seeded run of one variant on virtual time; returns the report as a dict."""
    policy, overrides, kv_on = VARIANTS[variant]
    cost = KVCostModel() if prefill_tps is None else KVCostModel(prefill_tps=prefill_tps)
    local = DEFAULT_LOCAL_CAPACITY_TOKENS if local_kv_tokens is None else local_kv_tokens
    if kv_on:
        # with several serving replicas, prefixes are stored as the engines compute them, so a fork on another
        # replica can fetch them; with one, only evictions go to the tier (write-through would only fill it)
        kv: KVTier = SimTier.from_eval_gpus(
            eval_gpus,
            spare_gib_per_gpu,
            cost,
            local_capacity_tokens=local,
            write_through=(sim or SimConfig()).replicas > 1,
        )
    else:
        kv = NullTier(local, cost)
    llm = SimLLM(random.Random(seed * 1000 + 1), kv, sim, quality)
    ev = SimEval(eval_gpus, random.Random(seed * 1000 + 2), sim)
    cfg = SearchConfig(
        policy=policy,
        budget=Budget(wall_s=wall_s, tokens=tokens),
        termination=TerminationConfig(target_speedup=target),
        **overrides,
    )
    report = run(Search(llm, ev, cfg).run(), virtual=True).to_json()
    report.update(
        variant=variant,
        seed=seed,
        prefill_s=llm.prefill_s,
        forks_off_replica=llm.forks_off_replica,
        fork_start_s=statistics.fmean(llm.fork_start_s) if llm.fork_start_s else None,
    )
    return report


def _job(args: tuple[str, int, dict[str, Any]]) -> dict[str, Any]:
    variant, seed, kw = args
    return sim_run(variant, seed, **kw)


def _latency(run: dict[str, Any], wall: float) -> float:
    """A run's median profiling-feedback latency; the wall budget when nothing was profiled (censored)."""
    lat = run.get("feedback_latency_s")
    return float(lat) if lat is not None else wall


def _ci(values: list[float], rng: random.Random, n: int = 2000) -> tuple[float, float]:
    """Bootstrap 95% interval of the median."""
    if len(values) < 2:
        return (values[0], values[0]) if values else (math.nan, math.nan)
    meds = sorted(statistics.median(rng.choices(values, k=len(values))) for _ in range(n))
    return meds[int(0.025 * n)], meds[int(0.975 * n) - 1]


def _summary(values: list[float], rng: random.Random) -> dict[str, Any]:
    lo, hi = _ci(values, rng)
    return {"median": statistics.median(values), "ci95": [lo, hi]}


def run_sim_lane(
    *,
    seeds: int = 20,
    variants: tuple[str, ...] | None = None,
    workers: int = 2,
    progress: Callable[[str], None] | None = None,
    **kw: Any,
) -> dict[str, Any]:
    """Every variant x seed on virtual time; the report the bench CLI writes (SIMULATED)."""
    names = variants or tuple(VARIANTS)
    if "specgen" not in names:
        raise ValueError("the sim lane compares against specgen: include it in variants")
    jobs = [(v, s, kw) for s in range(seeds) for v in names]
    runs: list[dict[str, Any]] = []
    if workers > 1:
        with ProcessPoolExecutor(workers) as ex:
            for i, r in enumerate(ex.map(_job, jobs, chunksize=4)):
                runs.append(r)
                if progress and i % 10 == 0:
                    progress(f"sim lane: {i + 1}/{len(jobs)} runs")
    else:
        runs = [_job(j) for j in jobs]
    wall = float(kw.get("wall_s", 7200.0))
    by: dict[str, dict[int, dict[str, Any]]] = {}
    for r in runs:
        by.setdefault(r["variant"], {})[r["seed"]] = r
    rng = random.Random(0)
    policies: dict[str, Any] = {}
    for name in names:
        rs = [by[name][s] for s in range(seeds)]
        e2e = [r["e2e_time_s"] if r["e2e_time_s"] is not None else wall for r in rs]
        metrics = {
            "e2e_time_s": e2e,
            "feedback_count": [float(r["feedback_count"]) for r in rs],
            "eval_utilization": [r["eval_utilization"] for r in rs],
            "best_speedup": [r["best_speedup"] or 0.0 for r in rs],
            "tokens": [float(sum(r["tokens"].values())) for r in rs],
            "iterations": [float(r["iterations"]) for r in rs],
            "prefill_s": [r["prefill_s"] for r in rs],
            "feedback_latency_s": [_latency(r, wall) for r in rs],
        }
        policies[name] = {
            "censored": sum(r["e2e_time_s"] is None for r in rs),
            "latency_censored": sum(r["feedback_latency_s"] is None for r in rs),  # nothing correct: the wall
            "unprofiled_at_end": statistics.median(float(r["unprofiled_at_end"]) for r in rs),
        }
        for key, values in metrics.items():  # the median under the metric's name, its interval beside it
            summary = _summary(values, rng)
            policies[name][key] = summary["median"]
            policies[name][f"{key}_ci95"] = summary["ci95"]
    spec = [by["specgen"][s] for s in range(seeds)]
    ratios: dict[str, Any] = {}
    for name in names:
        if name == "specgen":
            continue
        other = [by[name][s] for s in range(seeds)]
        e2e_r = [
            (o["e2e_time_s"] if o["e2e_time_s"] is not None else wall)
            / (p["e2e_time_s"] if p["e2e_time_s"] is not None else wall)
            for o, p in zip(other, spec, strict=True)
        ]
        fb_r = [p["feedback_count"] / max(1, o["feedback_count"]) for o, p in zip(other, spec, strict=True)]
        lat_r = [_latency(o, wall) / _latency(p, wall) for o, p in zip(other, spec, strict=True)]
        s_e, s_f, s_l = _summary(e2e_r, rng), _summary(fb_r, rng), _summary(lat_r, rng)
        ratios[name] = {
            "e2e": s_e["median"],
            "e2e_ci95": s_e["ci95"],
            "feedback": s_f["median"],
            "feedback_ci95": s_f["ci95"],
            "latency": s_l["median"],
            "latency_ci95": s_l["ci95"],
            "censored_baseline": sum(o["e2e_time_s"] is None for o in other),
            "censored_specgen": sum(p["e2e_time_s"] is None for p in spec),
            "censored_both": sum(
                o["e2e_time_s"] is None and p["e2e_time_s"] is None for o, p in zip(other, spec, strict=True)
            ),
        }
    return {
        "lane": "sim",
        "simulated": True,
        "seeds": seeds,
        "config": {
            "wall_s": wall,
            **{k: (str(v) if not isinstance(v, int | float) else v) for k, v in kw.items()},
        },
        "assumptions": {
            "sim": repr(kw.get("sim") or SimConfig()),
            "quality": repr(kw.get("quality") or QualityConfig()),
        },
        "policies": policies,
        "ratios": ratios,
        "runs": [{k: v for k, v in r.items() if k not in ("best_timeline", "roles_timeline")} for r in runs],
    }


KV_DEPLOYMENTS: tuple[tuple[int, str], ...] = ((2, "load"), (4, "load"), (2, "prefix"))
"""(serving replicas, fork routing) where the KV tier ablation is rerun (the main lane serves from one)."""


def kv_tier_study(
    *,
    seeds: int = 20,
    deployments: tuple[tuple[int, str], ...] = KV_DEPLOYMENTS,
    workers: int = 2,
    progress: Callable[[str], None] | None = None,
    **kw: Any,
) -> list[dict[str, Any]]:
    """SpecGen with and without the KV tier on replicated serving (SIMULATED): what a fork routed away from
    its reasoning stream's replica pays when the prefix is not in a shared tier. Per deployment: median
    prefill seconds of a run with and without the tier, forks sent off-replica, the mean delay before a
    fork's first token, and the paired e2e and feedback ratios."""
    rows = []
    for replicas, routing in deployments:
        if progress:
            progress(f"KV tier study: {replicas} replicas, {routing} routing")
        sim = replace(kw.get("sim") or SimConfig(), replicas=replicas, fork_routing=routing)
        rep = run_sim_lane(
            seeds=seeds,
            variants=("specgen", "specgen-no-kv-tier"),
            workers=workers,
            **{**kw, "sim": sim},
        )
        off = [float(r["forks_off_replica"]) for r in rep["runs"] if r["variant"] == "specgen"]
        starts: dict[str, float | None] = {}
        for v in ("specgen", "specgen-no-kv-tier"):
            xs = [
                r["fork_start_s"] for r in rep["runs"] if r["variant"] == v and r["fork_start_s"] is not None
            ]
            starts[v] = statistics.median(xs) if xs else None  # None: no run forked
        tier, none = rep["policies"]["specgen"], rep["policies"]["specgen-no-kv-tier"]
        ratio = rep["ratios"]["specgen-no-kv-tier"]
        rows.append({
            "replicas": replicas, "fork_routing": routing,
            "prefill_s_tier": tier["prefill_s"], "prefill_s_tier_ci95": tier["prefill_s_ci95"],
            "prefill_s_no_tier": none["prefill_s"], "prefill_s_no_tier_ci95": none["prefill_s_ci95"],
            "forks_off_replica": statistics.median(off),
            "fork_start_s_tier": starts["specgen"], "fork_start_s_no_tier": starts["specgen-no-kv-tier"],
            "e2e": ratio["e2e"], "e2e_ci95": ratio["e2e_ci95"],
            "feedback": ratio["feedback"], "feedback_ci95": ratio["feedback_ci95"],
        })  # fmt: skip
    return rows


def sweep(
    param: str, values: list[Any], *, seeds: int = 10, workers: int = 2, **kw: Any
) -> list[dict[str, Any]]:
    """SpecGen vs the best baseline as one assumption varies: where does SpecGen stop winning?"""
    rows = []
    for v in values:
        extra = dict(kw)
        if param in QualityConfig.__dataclass_fields__:
            extra["quality"] = replace(kw.get("quality") or QualityConfig(), **{param: v})
        elif param in SimConfig.__dataclass_fields__:
            extra["sim"] = replace(kw.get("sim") or SimConfig(), **{param: v})
        else:
            extra[param] = v
        rep = run_sim_lane(seeds=seeds, variants=("specgen", *BASELINES), workers=workers, **extra)
        closest = min(BASELINES, key=lambda b: rep["ratios"][b]["e2e"])  # the baseline SpecGen beats least
        rows.append({
            "param": param, "value": v, "closest_baseline": closest,
            "e2e_ratio": rep["ratios"][closest]["e2e"],
            "feedback_ratio": rep["ratios"][closest]["feedback"],
            "specgen_util": rep["policies"]["specgen"]["eval_utilization"],
        })  # fmt: skip
    return rows


def cpu_traces(problem: str = "softmax", *, count: int = 12, seed: int = 0, decode_tps: float = 40.0,
               reasoning_tokens: int = 4000) -> list[Any]:  # fmt: skip
    """Synthetic reasoning traces whose drafts and answers are real candidates for `problem` (the fast and
    slow C examples, the torch alternative, and wrong ones from the adversarial suite)."""
    from steptune.kernels.bench import EXAMPLES_DIR
    from steptune.kernels.llm import synth_trace

    pool = [p.read_text() for p in sorted((EXAMPLES_DIR / problem).glob("*.py")) if p.stem != "triton_kernel"]
    # Real variants of the C kernels: the same source built with other flags is another binary, with
    # another speed (-O1 and no vectorization are slower, unrolling may help or not).
    for src in list(pool):
        m = re.search(r"load_c\((\w+), flags=(.+)\)\n", src)
        if m:
            for extra in ('"-O1"', '"-O2"', '"-fno-tree-vectorize"', '"-funroll-loops"'):
                pool.append(
                    src.replace(m.group(0), f"load_c({m.group(1)}, flags=(*{m.group(2)}, {extra}))\n")
                )
    if problem == "softmax":
        pool += [
            (EXAMPLES_DIR / "adversarial" / f"{n}.py").read_text() for n in ("wrong_values", "nan_output")
        ]
    if len(pool) < 2:
        raise ValueError(f"problem {problem!r} has too few example candidates for the cpu lane")
    rng = random.Random(seed)
    traces = []
    for i in range(count):
        drafts = rng.sample(pool, k=3)
        traces.append(
            synth_trace(
                seed * 100 + i,
                reasoning_tokens=reasoning_tokens,
                decode_tps=decode_tps,
                drafts=drafts,
                final_code=rng.choice(pool),
                problem_id=problem,
                ttft_s=0.2,
            )
        )
    return traces


async def _real_search(config: SearchConfig, base_url: str, model: str, problem: Any, pool: Any) -> Any:
    from steptune.kernels.llm import LLMClient
    from steptune.kernels.real import RealEval, RealLLM

    async with LLMClient(base_url, model) as client:
        return await Search(
            RealLLM(client, problem), RealEval(pool, problem), config, problem=problem.name
        ).run()


def run_cpu_lane(
    *,
    problem: str = "softmax",
    policies: tuple[str, ...] = ("sequential", "specgen"),
    wall_s: float = 30.0,
    speed: float = 20.0,
    workers: int = 2,
    progress: Callable[[str], None] | None = None,
) -> dict[str, Any]:
    """Each policy for `wall_s` real seconds against the replay server (traces with real candidates,
    replayed `speed` times faster) and the real sandboxed pool; feedback per minute compared."""
    from steptune.kernels.llm import serve_replay
    from steptune.kernels.pool import EvalPool, PoolConfig
    from steptune.kernels.problems import load_problem

    prob = load_problem(problem)
    traces = cpu_traces(problem)
    out: dict[str, Any] = {
        "lane": "cpu",
        "problem": problem,
        "wall_s": wall_s,
        "speed": speed,
        "policies": {},
    }
    roles = ("validate", "profile") if workers == 2 else None
    for name in policies:
        # a fresh pool per policy, every worker started before the clock runs: no policy inherits another's
        # queue, roles or cold start
        with EvalPool(PoolConfig(num_workers=workers, timeout_s=60, roles=roles)) as pool:
            warm = [pool.submit(prob, "x = 1\n", kind=k) for k in ("validate", "profile")]
            for f in warm:
                f.result()
            if progress:
                progress(f"cpu lane: {name}")
            config = SearchConfig(
                policy=name,
                budget=Budget(wall_s=wall_s),
                termination=TerminationConfig(target_speedup=None, improvement=0.05),
                triggers=replace(SearchConfig().triggers, min_gap_tokens=100, periodic_tokens=400),
            )
            with serve_replay(traces, speed=speed) as server:
                model = traces[0].model
                report = run(
                    _real_search(config, server.base_url, model, prob, pool), virtual=False
                ).to_json()
                stats = server.wait_idle(5.0)
                aborted_main = sum(r.endpoint == "chat" and r.status == "aborted" for r in stats.records)
                report["server"] = {"requests": stats.requests, "aborted": stats.aborted,
                                    "aborted_main": aborted_main, "completed": stats.completed}  # fmt: skip
            report["feedback_per_min"] = report["feedback_count"] / (report["elapsed_s"] / 60.0)
            out["policies"][name] = {k: v for k, v in report.items() if k not in ("roles_timeline",)}
    if "specgen" in out["policies"] and "sequential" in out["policies"]:
        s, q = out["policies"]["specgen"], out["policies"]["sequential"]
        # None when either got no feedback at all: a 0 or a 1e9 would read as a measured ratio
        both = s["feedback_count"] > 0 and q["feedback_count"] > 0
        out["feedback_per_min_ratio"] = s["feedback_per_min"] / q["feedback_per_min"] if both else None
    return out


def _e2e_bound(name: str, r: dict[str, Any], seeds: int) -> tuple[str, str]:
    """How to read a paired e2e ratio when runs were censored (counted as the budget): a lower bound when
    only the baseline missed the target, an upper bound when only SpecGen did."""
    base = r.get("censored_baseline", 0) - r.get("censored_both", 0)
    spec = r.get("censored_specgen", 0) - r.get("censored_both", 0)
    if base and not spec:
        return (
            ">=",
            f" ({name} never reached the target in {base} of {seeds} seeds: e2e counted as the budget)",
        )
    if spec and not base:
        return (
            "<=",
            f" (SpecGen never reached the target in {spec} of {seeds} seeds: e2e counted as the budget)",
        )
    if base and spec:
        return "~", f" (censored both ways: {name} in {base}, SpecGen in {spec} of {seeds} seeds)"
    return "", ""


def _s(seconds: float | None) -> str:
    return "-" if seconds is None else f"{seconds:.2f} s"


def lane_table(report: dict[str, Any]) -> Any:
    """The policy comparison of a lane report as a table (ratios with CIs in its notes)."""
    from steptune.core.report import Table

    sim = report["lane"] == "sim"
    t = Table(
        title=f"Search policies, {report['lane']} lane"
        + (f" (SIMULATED, medians over {report['seeds']} seeds)" if sim else " (replay server + real pool)"),
        columns=[
            "policy",
            "e2e to target",
            "profiling feedback",
            "eval utilization",
            "best speedup",
            "tokens",
            "feedback latency",
        ],
    )
    for name, p in report["policies"].items():
        if sim:
            cens = f" ({p['censored']} never)" if p["censored"] else ""
            t.add(name, f"{p['e2e_time_s']:.0f} s{cens}", f"{p['feedback_count']:.0f}",
                  f"{p['eval_utilization']:.1%}", f"{p['best_speedup']:.2f}x",
                  f"{p['tokens'] / 1e3:.0f}k", f"{p['feedback_latency_s']:.0f} s")  # fmt: skip
        else:
            best = f"{p['best_speedup']:.2f}x" if p["best_speedup"] else "-"
            fb = f"{p['feedback_count']} ({p['feedback_per_min']:.1f}/min)"
            toks = f"{sum(p['tokens'].values()) / 1e3:.1f}k"
            lat = p.get("feedback_latency_s")
            t.add(
                name,
                "-",
                fb,
                f"{p['eval_utilization']:.1%}",
                best,
                toks,
                "-" if lat is None else f"{lat:.1f} s",
            )
    if sim:
        for name, r in report["ratios"].items():
            bound, why = _e2e_bound(name, r, report["seeds"])
            t.notes.append(
                f"SpecGen vs {name}: e2e {bound}{r['e2e']:.2f}x "
                f"[{r['e2e_ci95'][0]:.2f}, {r['e2e_ci95'][1]:.2f}]{why}, "
                f"feedback {r['feedback']:.2f}x [{r['feedback_ci95'][0]:.2f}, {r['feedback_ci95'][1]:.2f}], "
                f"feedback latency {r['latency']:.2f}x "
                f"[{r['latency_ci95'][0]:.2f}, {r['latency_ci95'][1]:.2f}]"
            )
        for row in report.get("kv_tier", []):
            t.notes.append(
                f"KV tier, {row['replicas']} serving replicas, {row['fork_routing']} routing: prefill "
                f"{row['prefill_s_tier']:.0f} s with the tier vs {row['prefill_s_no_tier']:.0f} s without "
                f"per run ({row['forks_off_replica']:.0f} forks off their stream's replica; a fork's first "
                f"token after {_s(row.get('fork_start_s_tier'))} vs {_s(row.get('fork_start_s_no_tier'))}, "
                "mean per run); "
                f"e2e {row['e2e']:.2f}x [{row['e2e_ci95'][0]:.2f}, {row['e2e_ci95'][1]:.2f}]"
            )
        t.notes.append("simulated services; assumptions in docs/kernels.md")
    elif report.get("feedback_per_min_ratio") is not None:
        t.notes.append(
            f"SpecGen / sequential profiling feedback per minute: {report['feedback_per_min_ratio']:.2f}x"
        )
    elif "feedback_per_min_ratio" in report:
        none = [n for n, p in report["policies"].items() if not p["feedback_count"]]
        t.notes.append(
            f"no ratio: {', '.join(none)} got no profiling feedback in {report.get('wall_s', '?')} s per "
            "policy; raise --wall (a candidate needs its generation, compile and validation first)"
        )
    return t
