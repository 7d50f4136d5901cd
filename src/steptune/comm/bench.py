"""``steptune comm bench``: stock FSDP2 and TIDE side by side on gloo, every figure measured in one run.

Two parts:
- ``fsdp``: real FSDP2 training (spawned ranks, W in ``world_sizes``) of an MLP with uneven and zero-row
  shards and small HF Qwen3 / Llama models, stock and TIDE interleaved step by step: parameter equality,
  bytes copied for layout conversion (the dispatch-level copy counter), wire bytes by dtype, step time.
- ``rs_staging``: the reduce-scatter alone on thread ranks (real gloo groups), W = 2..8 at a fixed per-rank
  output: stock's path (FSDP2's ``chunk_cat`` into a full-group fp32 buffer, then ``reduce_scatter_tensor``
  with AVG) against TIDE's K-slot pipeline; staging bytes, result difference, time.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Sequence
from typing import Any

__all__ = ["fsdp_bench", "rs_staging_bench", "run_bench"]


def _median(xs: Sequence[float]) -> float:
    return float(statistics.median(xs)) if xs else float("nan")


def fsdp_bench(
    world_sizes: Sequence[int] = (2, 3, 4),
    models: Sequence[str] = ("mlp", "qwen3", "llama"),
    *,
    steps: int = 5,
    progress: Callable[[str], None] = lambda s: None,
) -> dict[str, Any]:
    from steptune.comm.compare import compare_rank
    from steptune.testing.spawn import SpawnPool

    runs = []
    for w in world_sizes:
        with SpawnPool(w, timeout=600, default_group=True) as pool:
            for model in models:
                progress(f"fsdp: {model} at W={w}")
                per_rank = pool.run(compare_rank, {"model": model, "steps": steps})
                r0 = per_rank[0]
                times = {k: _median(v[1:]) for k, v in r0["step_time_s"].items()}  # step 0 is lazy init
                runs.append(
                    {
                        "model": model,
                        "world_size": w,
                        "groups_on_tide": sum(v == "tide" for v in r0["groups"].values()),
                        "groups": len(r0["groups"]),
                        "bitwise_equal": all(r["bitwise_equal"] for r in per_rank),
                        "max_param_rel_diff": max(r["max_param_rel_diff"] for r in per_rank),
                        "layout_bytes": {k: m["layout_bytes"] for k, m in r0["meters"].items()},
                        "reduce_term_bytes": {k: m["reduce_term_bytes"] for k, m in r0["meters"].items()},
                        "wire_bytes": {k: m["wire_bytes"] for k, m in r0["meters"].items()},
                        "rs_staging_high_water_bytes": {
                            k: m["rs_staging_high_water_bytes"] for k, m in r0["meters"].items()
                        },
                        "rs_staging_allocated_bytes": {
                            k: m["rs_staging_allocated_bytes"] for k, m in r0["meters"].items()
                        },
                        "step_time_s": times,
                        "steps": steps,
                    }
                )
    return {"runs": runs}


def _rs_rank(rank: int, group: Any, rows_per_rank: int, cols: int, chunk: int, slots: int, reps: int) -> Any:
    import torch.distributed as dist
    import torch.distributed.fsdp._fully_shard._fsdp_collectives

    from steptune.comm.layout import GroupLayout, ParamSpec
    from steptune.comm.rs import reduce_scatter_into
    from steptune.comm.transport import ProcessGroupP2P

    w = group.size()
    shapes = [(rows_per_rank * w, cols), (3 * w - 1,)]  # one even, one uneven parameter
    g = torch.Generator().manual_seed(rank)
    grads = [torch.randn(s, generator=g).to(torch.bfloat16) for s in shapes]
    lay = GroupLayout(tuple(ParamSpec(s) for s in shapes), w)
    transport = ProcessGroupP2P(group)
    stock_t, tide_t = [], []
    for _ in range(reps):
        # Stock FSDP2 (foreach_reduce): full-group fp32 buffer, chunk_cat copy-in, then reduce_scatter AVG.
        t0 = time.perf_counter()
        rs_in = torch.empty(lay.stock_rs_input_numel(), dtype=torch.float32)
        torch.ops.fsdp.chunk_cat(grads, dim=0, num_chunks=w, out=rs_in.view(w, -1))
        stock_out = torch.empty(lay.out_numel, dtype=torch.float32)
        opts = dist.ReduceScatterOptions()
        opts.reduceOp = dist.ReduceOp.AVG
        group._reduce_scatter_base(stock_out, rs_in, opts).wait()
        stock_t.append(time.perf_counter() - t0)
        stock_bytes = rs_in.numel() * rs_in.element_size()
        del rs_in
        t0 = time.perf_counter()
        out = torch.empty(lay.out_numel, dtype=torch.float32)
        stats = reduce_scatter_into(
            lay, [x.view(-1) for x in grads], out, transport, chunk_numel=chunk, num_slots=slots, divide_by=w
        )
        tide_t.append(time.perf_counter() - t0)
    diff = 0.0
    for p in range(len(shapes)):
        n = lay.real_numel(p, rank)
        a = stock_out.narrow(0, lay.out_offset(p), n).double()
        b = out.narrow(0, lay.out_offset(p), n).double()
        if n:
            diff = max(diff, ((a - b).abs().max() / a.abs().max().clamp_min(1e-30)).item())
    return {
        "stock_bytes": stock_bytes,
        "tide_bytes": stats.staging_bytes,
        "out_bytes": lay.out_numel * 4,
        "rel_diff": diff,
        "stock_s": _median(stock_t),
        "tide_s": _median(tide_t),
    }


def rs_staging_bench(
    world_sizes: Sequence[int] = tuple(range(2, 9)),
    *,
    rows_per_rank: int = 256,
    cols: int = 256,
    chunk_numel: int = 16384,
    num_slots: int = 2,
    reps: int = 3,
    progress: Callable[[str], None] = lambda s: None,
) -> dict[str, Any]:
    from steptune.testing.threads import run_threads

    rows: dict[str, Any] = {}
    for w in world_sizes:
        progress(f"rs staging: W={w} (thread ranks)")
        res = run_threads(_rs_rank, w, rows_per_rank, cols, chunk_numel, num_slots, reps, timeout=300)
        rows[str(w)] = {
            "stock_bytes": res[0]["stock_bytes"],
            "tide_bytes": res[0]["tide_bytes"],
            "out_bytes": res[0]["out_bytes"],
            "max_rel_diff": max(r["rel_diff"] for r in res),
            "stock_s": _median([r["stock_s"] for r in res]),
            "tide_s": _median([r["tide_s"] for r in res]),
        }
    return {
        "rows_per_rank": rows_per_rank,
        "cols": cols,
        "chunk_numel": chunk_numel,
        "num_slots": num_slots,
        "by_world_size": rows,
    }


def run_bench(
    *, quick: bool = False, smoke: bool = False, progress: Callable[[str], None] = lambda s: None
) -> dict[str, Any]:
    """The comm benchmark JSON: ``"gloo"`` measured on this box, ``"sim"`` the cost model (SIMULATED).

    ``quick``: fewer world sizes and models; ``smoke``: the least that runs every path (W = 2, the MLP).
    """
    fsdp = fsdp_bench(
        (2,) if smoke else (2, 4) if quick else (2, 3, 4),
        ("mlp",) if smoke else ("mlp", "qwen3") if quick else ("mlp", "qwen3", "llama"),
        steps=2 if smoke else 3 if quick else 5,
        progress=progress,
    )
    rs = rs_staging_bench((2, 4) if smoke else (2, 4, 8) if quick else tuple(range(2, 9)), progress=progress)
    runs = fsdp["runs"]

    def total(key: str, path: str) -> int:
        return sum(r[key][path] for r in runs)

    def wire(path: str) -> dict[str, dict[str, int]]:
        agg: dict[str, dict[str, int]] = {}
        for r in runs:
            for op, by_dtype in r["wire_bytes"][path].items():
                for dt, b in by_dtype.items():
                    agg.setdefault(op, {}).setdefault(dt, 0)
                    agg[op][dt] += b
        return agg

    from steptune.comm.simreport import headline, sim_rows

    progress("cost model (simulated)")
    return {
        "sim": sim_rows(),
        "sim_headline": headline(),
        "gloo": {
            "max_param_rel_diff": max(r["max_param_rel_diff"] for r in runs),
            "bitwise_equal": all(r["bitwise_equal"] for r in runs),
            "layout_bytes": {p: total("layout_bytes", p) for p in ("stock", "tide")},
            "wire_bytes": {p: wire(p) for p in ("stock", "tide")},
            "rs_staging_bytes": {
                p: {w: row[f"{p}_bytes"] for w, row in rs["by_world_size"].items()} for p in ("stock", "tide")
            },
            "step_time_s": {
                p: {f"{r['model']}@W{r['world_size']}": r["step_time_s"][p] for r in runs}
                for p in ("stock", "tide")
            },
            "runs": runs,
            "rs_staging": rs,
        },
    }
