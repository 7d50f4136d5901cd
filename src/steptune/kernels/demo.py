"""Kernels demo: one replayed LLM iteration feeding the sandboxed pool, the adversarial suite's verdicts,
fast vs slow C kernels told apart by profiling, and the search policies on the simulated lane (4 seeds).

The LLM is the trace-replay server playing a synthetic reasoning trace (labelled synthetic) whose drafts
are real candidates for the built-in `softmax` problem; our client streams it over loopback HTTP and
submits each draft the moment its code block closes, forks once from the reasoning prefix, and evaluates
the final answer, so evaluation overlaps generation (the idea SpecGen builds on, issue #12).
"""

from __future__ import annotations

import asyncio
import json
import time
from concurrent.futures import Future
from pathlib import Path
from typing import Any

from steptune.core.demo import DemoResult
from steptune.core.report import Table
from steptune.kernels.bench import EXAMPLES_DIR, bench_table, run_bench
from steptune.kernels.extract import code_blocks, fork_code, normalized_hash
from steptune.kernels.lanes import BASELINES, lane_table, run_sim_lane
from steptune.kernels.pool import EvalPool, PoolConfig, Result

__all__ = ["run_kernels_demo"]

ADVERSARIAL = [
    "segfault",
    "oob_write",
    "infinite_loop",
    "calls_reference_op",
    "memory_reuse",
    "leaves_child_process",
]


async def _iteration(pool: EvalPool, out_dir: Path) -> list[dict[str, Any]]:
    from steptune.kernels.llm import LLMClient, serve_replay, synth_trace

    src = {v: (EXAMPLES_DIR / "softmax" / f"{v}.py").read_text() for v in ("c_slow", "torch_alt", "c_fast")}
    trace = synth_trace(
        7,
        reasoning_tokens=1200,
        decode_tps=60.0,
        drafts=[src["c_slow"], src["torch_alt"]],
        final_code=src["c_fast"],
        problem_id="softmax",
        ttft_s=0.3,
    )
    submitted: dict[str, tuple[str, float, str, Future[Result]]] = {}
    t0 = time.perf_counter()

    def submit(code: str, origin: str) -> None:
        key = normalized_hash(code)
        if key not in submitted:
            fut = pool.submit("softmax", code, kind="validate")
            submitted[key] = (origin, time.perf_counter() - t0, code, fut)

    messages = [{"role": "user", "content": "Write a faster row softmax for CPU as ModelNew (C via ctypes)."}]
    with serve_replay([trace], speed=8.0) as server:
        async with LLMClient(
            server.base_url, trace.model, record_to=out_dir / "recorded_trace.jsonl"
        ) as client:
            rendered = "".join((await client.tokenize(messages=messages, return_token_strs=True)).token_strs)
            stream = await client.stream_chat(messages)
            forked = False
            async for _chunk in stream:
                for code in code_blocks(stream.reasoning):
                    submit(code, "draft in reasoning")
                if not forked and submitted:  # fork once, right after the first draft closes
                    forked = True
                    reply = await (await client.fork(rendered + stream.reasoning)).collect()
                    code = fork_code(reply.content)
                    if code:
                        submit(code, "fork from reasoning prefix")
            for code in code_blocks(stream.content):
                submit(code, "final answer")
            stream_s = time.perf_counter() - t0
    rows = []
    for origin, at, code, fut in submitted.values():
        res = fut.result()
        if res.verdict == "correct":
            res = pool.submit("softmax", code, kind="profile").result()
        rows.append(
            {
                "origin": origin,
                "submitted_at_s": round(at, 2),
                "stream_s": round(stream_s, 2),
                "verdict": res.verdict,
                "speedup": res.speedup,
                "reason": res.reason,
            }
        )
    return rows


def run_kernels_demo(out_dir: Path, *, quick: bool = False) -> DemoResult:
    out_dir.mkdir(parents=True, exist_ok=True)
    # the infinite loop holds a worker until the timeout; --quick (the tests) waits less for it
    cfg = PoolConfig(num_workers=2, timeout_s=5 if quick else 10, memory_bytes=2**30)
    with EvalPool(cfg) as pool:
        llm_rows = asyncio.run(_iteration(pool, out_dir))
        adv_futs = []
        for name in ADVERSARIAL:
            code = (EXAMPLES_DIR / "adversarial" / f"{name}.py").read_text()
            expect = next(
                ln.split(":", 1)[1].strip() for ln in code.splitlines() if ln.startswith("# expect:")
            )
            adv_futs.append((name, expect, pool.submit("softmax", code)))
        adv_rows = [
            {
                "candidate": n,
                "expected": e,
                "verdict": (r := f.result()).verdict,
                "reason": r.reason.split("\n")[0],
            }
            for n, e, f in adv_futs
        ]
    problems = ["softmax"] if quick else ["softmax", "rmsnorm", "gelu_tanh"]
    report = run_bench(repeats=1 if quick else 3, problems=problems)
    lane = run_sim_lane(seeds=1 if quick else 4, variants=("specgen", *BASELINES), workers=2)

    t1 = Table(
        title="One LLM iteration replayed (synthetic trace, x8 speed) into the sandboxed pool: softmax",
        columns=["candidate from", "submitted at", "verdict", "speedup vs torch", "reason"],
    )
    for r in llm_rows:
        sp = f"{r['speedup']:.2f}x" if r["speedup"] else "-"
        t1.add(
            r["origin"],
            f"{r['submitted_at_s']:.1f} s of {r['stream_s']:.1f} s",
            r["verdict"],
            sp,
            r["reason"][:60],
        )
    t1.notes.append("drafts are evaluated while the reasoning stream is still running")
    t2 = Table(
        title="Adversarial candidates (softmax): verdicts",
        columns=["candidate", "expected", "verdict", "reason"],
    )
    for r in adv_rows:
        t2.add(r["candidate"], r["expected"], r["verdict"], r["reason"][:70])
    t3 = bench_table(report)
    t4 = lane_table(lane)
    path = out_dir / "kernels_demo.json"
    data = {"llm_iteration": llm_rows, "adversarial": adv_rows, "bench": report, "sim_lane": lane}
    path.write_text(json.dumps(data, indent=2))
    return DemoResult(
        title="kernels: SpecGen (evaluation pool, LLM client, replay server, search policies)",
        tables=[t1, t2, t3, t4],
        artifacts=[path, out_dir / "recorded_trace.jsonl"],
    )
