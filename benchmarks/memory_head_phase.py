"""Does the peak model predict planned peaks when the step peaks before any block replays?

A Qwen3-shaped stack (4 layers, random weights) on CPU, MemTracker peaks. With a large vocabulary the
logits and their gradient hold the step peak (the head phase); with a small one a block's backward does.
For four limits between the replay-only and no-checkpointing peaks it plans, measures, and prints the
predicted and measured peaks, with the head-phase term (``calibrate(..., head_peak)``) or without it.

    PYTHONPATH=src python benchmarks/memory_head_phase.py --vocab 32768 --seq 512 --hidden 128 [--no-head]
"""

from __future__ import annotations

import argparse

import torch
from transformers import AutoConfig, AutoModelForCausalLM

from steptune.memory.measure import measure_peak
from steptune.memory.plan import calibrate, last_free_plan, plan_saves
from steptune.memory.profile import profile_model


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--vocab", type=int, default=32768)
    ap.add_argument("--seq", type=int, default=512)
    ap.add_argument("--hidden", type=int, default=128)
    ap.add_argument("--no-head", action="store_true", help="calibrate without the head-phase term")
    args = ap.parse_args()
    h = args.hidden
    cfg = AutoConfig.for_model("qwen3", num_hidden_layers=4, vocab_size=args.vocab, hidden_size=h,
                               intermediate_size=3 * h, num_attention_heads=4, num_key_value_heads=2,
                               head_dim=h // 4, use_cache=False)  # fmt: skip
    cfg._attn_implementation = "sdpa"
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg).train()
    ids = torch.randint(0, args.vocab, (1, args.seq))
    batch = {"input_ids": ids, "labels": ids}
    mib = 2**20
    top = measure_peak(model, batch, "no_ac")[0]
    head: list[int] = []
    floor = measure_peak(model, batch, "tapesac_replay", head=head)[0]
    profiles = profile_model(model, batch)
    head_lf: list[int] = []
    last = measure_peak(
        model, batch, "tapesac_plan", plans={"tapesac_plan": last_free_plan(profiles)}, head=head_lf
    )[0]
    heads = (None, None) if args.no_head else (head[0], head_lf[0])
    peak_model = calibrate(profiles, floor, last, *heads)
    print(f"no_ac {top / mib:.1f} MiB, replay-only {floor / mib:.1f} MiB (head phase {head[0] / mib:.1f})")
    for frac in (0.15, 0.3, 0.5, 0.7):
        limit = int(floor + frac * (top - floor))
        plan = plan_saves(profiles, peak_model, limit, last_block_free=False)
        got = measure_peak(model, batch, "tapesac_plan", plans={"tapesac_plan": plan.save_plan(profiles)})[0]
        err = (plan.predicted_peak - got) / got
        print(f"limit {limit / mib:.1f}: predicted {plan.predicted_peak / mib:.1f}, "
              f"measured {got / mib:.1f} MiB ({err:+.1%})")  # fmt: skip


if __name__ == "__main__":
    main()
