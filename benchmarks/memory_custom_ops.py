"""What a custom op in a block costs TapeSAC, and what ``TapeSACConfig(pure_ops=...)`` gives back.

Eight residual MLP blocks (width 256, batch 64) on CPU, one thread. The activation is ``tanh(x) * 1.5``
written with aten ops, or the same math as a ``torch.library`` op with its own autograd; one variant wraps
the aten block in ``record_function``. Each model trains under TapeSAC (replay-only) or without it;
the step times are interleaved, 5 steps per sample, the median of ``--rounds`` samples.

    PYTHONPATH=src python benchmarks/memory_custom_ops.py [--rounds 15]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from torch import nn

from steptune.memory import TapeSACConfig, apply_tapesac_


@torch.library.custom_op("steptune_bench::scaled_tanh", mutates_args=())
def scaled_tanh(x: torch.Tensor) -> torch.Tensor:
    return torch.tanh(x) * 1.5


@scaled_tanh.register_fake
def _(x: torch.Tensor) -> torch.Tensor:
    return torch.empty_like(x)


def _setup(ctx, inputs, output) -> None:  # type: ignore[no-untyped-def]
    ctx.save_for_backward(output)


def _backward(ctx, grad):  # type: ignore[no-untyped-def]
    (y,) = ctx.saved_tensors
    return grad * (1.5 - y * y / 1.5)


scaled_tanh.register_autograd(_backward, setup_context=_setup)


class Block(nn.Module):
    def __init__(self, width: int, kind: str) -> None:
        super().__init__()
        self.a, self.b, self.kind = nn.Linear(width, width), nn.Linear(width, width), kind

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.kind == "custom":
            return x + self.b(scaled_tanh(self.a(x)))
        if self.kind == "ranged":
            with torch.autograd.profiler.record_function("block"):
                return x + self.b(torch.tanh(self.a(x)) * 1.5)
        return x + self.b(torch.tanh(self.a(x)) * 1.5)


class Stack(nn.Module):
    def __init__(self, kind: str, width: int = 256, num: int = 8) -> None:
        super().__init__()
        self.layers = nn.ModuleList(Block(width, kind) for _ in range(num))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return x


CASES = {  # name: (block kind, TapeSACConfig options, or None without TapeSAC)
    "aten, no TapeSAC": ("aten", None),
    "custom op, no TapeSAC": ("custom", None),
    "aten": ("aten", {}),
    "custom op (force-saved)": ("custom", {}),
    "custom op, pure_ops": ("custom", {"pure_ops": {"steptune_bench.scaled_tanh"}}),
    "aten in record_function": ("ranged", {}),
}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rounds", type=int, default=15)
    args = ap.parse_args()
    torch.set_num_threads(1)
    x = torch.randn(64, 256)
    models = {}
    for name, (kind, options) in CASES.items():
        torch.manual_seed(0)
        model = Stack(kind)
        handle = None
        if options is not None:
            handle = apply_tapesac_(model, TapeSACConfig(blocks="layers.*", **options))
        for _ in range(3):
            model(x).sum().backward()
        models[name] = (model, handle)
    times: dict[str, list[float]] = {name: [] for name in CASES}
    for _ in range(args.rounds):  # interleaved
        for name, (model, _) in models.items():
            t0 = time.perf_counter()
            for _ in range(5):
                model(x).sum().backward()
            times[name].append((time.perf_counter() - t0) / 5)
    base = statistics.median(times["aten"])
    print(f"{'model':26s} {'ms/step':>8s} {'vs aten':>8s}  forwards recorded, values force-saved")
    for name, (_, handle) in models.items():
        med = statistics.median(times[name])
        extra = ""
        if handle is not None:
            s = handle.stats
            extra = f"{s.recorded}/{s.forwards}, {sum(s.force_saved.values())}"
        print(f"{name:26s} {med * 1e3:8.2f} {med / base:7.2f}x  {extra}")


if __name__ == "__main__":
    main()
