"""ResiHP's runtime in a plain torchrun data-parallel training loop (fail-slow detection and DP rebalancing).

    torchrun --standalone --nproc-per-node 4 examples/resilience_torchrun.py --steps 60 \
        --slow-rank 1 --factor 1.6 --at 20 --json runs/torchrun.json

The lines marked ``# <- runtime`` are what a training loop adds. Everything else is an ordinary loop:
a model, a global batch of variable-length microbatches that every rank sees, a backward per
microbatch, a gradient all-reduce and an optimizer step. On a CPU box the runtime emulates an H100's
device time for an 8B model (``RuntimeConfig(emulate=True)``); on GPUs pass ``emulate=False`` and it
times the real work. ``--slow-rank`` injects a slowdown so there is something to detect (a real
cluster brings its own).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os

import torch
import torch.distributed as dist

from steptune.core.argtypes import non_negative_int, output_file, positive_float, positive_int
from steptune.resilience.live import global_batch, microbatch_loss, proxy_model, stage_model
from steptune.resilience.runtime import Runtime, RuntimeConfig, SlowFault, fault_range_error


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=positive_int, default=60, help="training steps (default: 60)")
    ap.add_argument(
        "--slow-rank", type=non_negative_int, default=None, help="the rank to slow down (default: none)"
    )
    ap.add_argument("--factor", type=float, default=1.6, help="slowdown factor, >= 1 (default: 1.6)")
    ap.add_argument("--at", type=non_negative_int, default=20, help="the first slow step (default: 20)")
    ap.add_argument(
        "--time-scale",
        type=positive_float,
        default=0.02,
        help="emulated device seconds slept per modelled second (default: 0.02)",
    )
    ap.add_argument("--json", type=output_file, default=None, help="rank 0 writes its step reports here")
    args = ap.parse_args()
    if "RANK" not in os.environ:
        ap.error("run it under torchrun: torchrun --standalone --nproc-per-node 4 " + __file__)
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if args.slow_rank is not None:
        if args.slow_rank >= world:
            ap.error(f"--slow-rank {args.slow_rank}: the ranks are 0..{world - 1}")
        if args.at >= args.steps:
            ap.error(f"--at {args.at}: the slowdown would start after the last step ({args.steps} steps)")
        names = ("slow-rank", "factor", "at", "")
        problem = fault_range_error(args.slow_rank, args.factor, args.at, None, names=names)
        if problem:
            ap.error("--" + problem.replace("):", ":", 1))

    # The model and its optimizer come before the process group on purpose. Building the first optimizer
    # imports torch._dynamo, which keeps 10 references to a default group that already exists (torch 2.13),
    # so destroy_process_group could not free it: its gloo worker threads then outlived the script and,
    # now and then, freed a tensor during interpreter shutdown and aborted ("terminate called without
    # an active exception", SIGABRT; pytorch/pytorch#190489). Found with a core dump on 2026-12-05.
    torch.set_num_threads(1)
    model = proxy_model(seed=0)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
    rank, group = dist.get_rank(), dist.group.WORLD
    faults = (
        [SlowFault(rank=args.slow_rank, factor=args.factor, start=args.at)]
        if args.slow_rank is not None
        else []
    )
    rt = Runtime(
        group, stage_model("llama3.1-8b"), RuntimeConfig(time_scale=args.time_scale), faults=faults
    )  # <- runtime
    rows = []
    for step in range(args.steps):
        lengths, tokens = global_batch(seed=0, step=step)  # the same global batch on every rank
        total = sum(t.shape[1] - 1 for t in tokens)
        loss_sum = torch.zeros(())
        for i in rt.assign(lengths):  # <- runtime: this rank's microbatches under the current plan
            with rt.timed(lengths[i]):  # <- runtime: forward + backward of microbatch i
                loss = microbatch_loss(model, tokens[i], total)
                loss.backward()
            loss_sum += loss.detach()
        for p in model.parameters():  # SUM: each microbatch's loss is already weighted by its tokens
            if p.grad is None:
                p.grad = torch.zeros_like(p)
            dist.all_reduce(p.grad, group=group)
        dist.all_reduce(loss_sum, group=group)
        opt.step()
        opt.zero_grad()
        report = rt.end_step()  # <- runtime: gather timings, predict, detect, plan the next step
        rows.append({"step": step, "loss": float(loss_sum), "wall_s": report.wall_s, "tokens": report.tokens,
                     "alarms": [(a.unit, round(a.slowdown, 3)) for a in report.alarms],
                     "speeds": list(report.speeds)})  # fmt: skip
        if rank == 0 and report.alarms:
            print(f"step {step}: detected {[(a.unit, round(a.slowdown, 2)) for a in report.alarms]}; "
                  f"next step's speeds {[round(s, 2) for s in report.speeds]}", flush=True)  # fmt: skip
    if rank == 0:
        tail = rows[-10:]
        print(f"world {dist.get_world_size()} (torchrun, LOCAL_RANK {os.environ.get('LOCAL_RANK')}): "
              f"last 10 steps {sum(r['tokens'] for r in tail) / sum(r['wall_s'] for r in tail):.0f} "
              "tokens/s (emulated)")  # fmt: skip
        if args.json:
            args.json.parent.mkdir(parents=True, exist_ok=True)
            args.json.write_text(json.dumps({"world": dist.get_world_size(), "steps": rows}, indent=2))
    # Both ranks reach teardown together: a rank that tears gloo down while its peer still holds the
    # connection can abort at exit ("terminate called without an active exception"; once, in a
    # clean-clone suite run on 2026-12-01).
    dist.barrier(group=group)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
