"""How long the evaluation pool takes to get its workers going: forked from a template or fresh.

Per round and per mode (`fork_workers` True / False, alternating which goes first), one pool of
`--workers` workers; timed:
- start: from `EvalPool(...)` to every worker's first verdict (one honest candidate per worker);
- replace: SIGKILL one idle worker, then the time to the next verdict (the pool starts a new worker);
- cpu: CPU seconds of the pool's processes over the round (children's rusage: the template, the
  fresh interpreters, the workers and their sandbox children; workers forked by the template count only
  once the template is reaped, which `close()` does);
- first_after_delay: a second pool, idle for `--delay` s after it is built (an LLM still writing the first
  candidate), then the time to its first verdict (a forking pool starts its template when it is built).
Prints the medians and writes `--json`.

    PYTHONPATH=src python benchmarks/pool_start.py --workers 2 --repeats 5 --json /tmp/pool_start.json
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import signal
import statistics
import time
from pathlib import Path

from steptune.kernels.pool import EvalPool, PoolConfig

ADV = Path(__file__).resolve().parents[1] / "src/steptune/kernels/examples/adversarial"
GOOD = (ADV / "honest_torch.py").read_text()


def _children_cpu() -> float:
    r = resource.getrusage(resource.RUSAGE_CHILDREN)
    return r.ru_utime + r.ru_stime


def one_round(fork: bool, workers: int) -> dict[str, float]:
    cpu0, t0 = _children_cpu(), time.perf_counter()
    with EvalPool(PoolConfig(num_workers=workers, timeout_s=60, fork_workers=fork)) as pool:
        futs = [pool.submit("softmax", GOOD) for _ in range(workers)]
        verdicts = [f.result(120).verdict for f in futs]
        start = time.perf_counter() - t0
        if verdicts != ["correct"] * workers or len(pool.worker_pids()) != workers:
            raise RuntimeError(f"pool did not come up: {verdicts}, pids {pool.worker_pids()}")
        os.kill(pool.worker_pids()[0], signal.SIGKILL)
        time.sleep(0.1)
        t1 = time.perf_counter()
        # one request per worker: the live one answers at once, the killed one's request restarts it
        futs = [pool.submit("softmax", GOOD) for _ in range(workers)]
        verdicts = [f.result(120).verdict for f in futs]
        replace = time.perf_counter() - t1
    cpu = _children_cpu() - cpu0
    if verdicts.count("correct") < workers - 1:
        raise RuntimeError(f"unexpected verdicts after the kill: {verdicts}")
    return {"start_s": start, "replace_s": replace, "cpu_s": cpu}


def first_after(fork: bool, workers: int, delay_s: float) -> float:
    with EvalPool(PoolConfig(num_workers=workers, timeout_s=60, fork_workers=fork)) as pool:
        time.sleep(delay_s)
        t0 = time.perf_counter()
        verdict = pool.submit("softmax", GOOD).result(120).verdict
        if verdict != "correct":
            raise RuntimeError(f"unexpected verdict {verdict}")
        return time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--delay", type=float, default=5.0)
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args()
    rows: dict[str, list[dict[str, float]]] = {"forked": [], "fresh": []}
    for r in range(args.repeats):
        order = [True, False] if r % 2 == 0 else [False, True]
        for fork in order:
            row = one_round(fork, args.workers)
            row["first_after_delay_s"] = first_after(fork, args.workers, args.delay)
            rows["forked" if fork else "fresh"].append(row)
            print(f"round {r} {'forked' if fork else 'fresh':6s} {rows['forked' if fork else 'fresh'][-1]}")
    out: dict[str, object] = {"workers": args.workers, "repeats": args.repeats, "delay_s": args.delay}
    out.update(rows=rows, median={})
    for mode, rs in rows.items():
        keys = ("start_s", "replace_s", "cpu_s", "first_after_delay_s")
        med = {k: statistics.median(x[k] for x in rs) for k in keys}
        out["median"][mode] = med  # type: ignore[index]
        line = f"start {med['start_s']:.2f} s, replace {med['replace_s']:.2f} s, cpu {med['cpu_s']:.1f} s, "
        line += f"first verdict {args.delay:g} s after the build {med['first_after_delay_s']:.2f} s"
        print(f"{mode:6s} median: {line}")
    if args.json:
        args.json.write_text(json.dumps(out, indent=1))
        print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
