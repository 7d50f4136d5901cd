"""The built-in CPU problems and their example candidates: every reference runs on its own inputs, every
candidate matches its reference on fresh seeded inputs without dispatching the reference's compute ops, and
the c_fast / c_slow candidates land on the expected side of the reference in a short in-process timing.

The timing here is deliberately lenient (a shared two-core box is noisy); the evaluation pool does the real
profiling.
"""

from __future__ import annotations

import importlib.util
import math
import statistics
import time
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from steptune.kernels.checks import static_check
from steptune.kernels.problems import BUILTIN_DIR, builtin_problems, load_problem, tolerance

pytestmark = pytest.mark.timeout(300)

EXAMPLES = BUILTIN_DIR.with_name("examples")
PROBLEMS = builtin_problems()
# The CPU candidates; other files under examples/ (GPU kernels, adversarial cases) have their own tests.
CPU_KINDS = ("c_fast", "c_slow", "torch_alt")
CANDIDATES = [
    f"{d.name}/{kind}"
    for d in sorted(EXAMPLES.iterdir())
    if d.name in PROBLEMS
    for kind in CPU_KINDS
    if (d / f"{kind}.py").is_file()
]
TIMED = [c for c in CANDIDATES if c.endswith(("/c_fast", "/c_slow"))]
# Allocations and views (those the op schema marks as views, plus these) are not "compute": a C candidate
# still allocates its output with torch.empty.
_NON_COMPUTE = {
    "aten.empty",
    "aten.empty_like",
    "aten.empty_strided",
    "aten.detach",
    "aten.lift_fresh",
    "aten._unsafe_view",
}


def _import(path: Path, name: str) -> ModuleType:
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _problem(name: str) -> ModuleType:
    return _import(BUILTIN_DIR / f"{name}.py", f"_builtin_problem_{name}")


def _candidate(spec: str) -> ModuleType:
    problem, stem = spec.split("/")
    return _import(EXAMPLES / problem / f"{stem}.py", f"_example_{problem}_{stem}")


def _pair(spec: str) -> tuple[ModuleType, torch.nn.Module, torch.nn.Module]:
    """The problem module, its Model and the candidate's ModelNew, built from the same seed (as the
    evaluator does, so that parameters drawn in __init__ agree)."""
    prob = _problem(spec.split("/")[0])
    cand = _candidate(spec)
    torch.manual_seed(0)
    ref = prob.Model(*prob.get_init_inputs()).eval()
    torch.manual_seed(0)
    new = cand.ModelNew(*prob.get_init_inputs()).eval()
    return prob, ref, new


class _ComputeOps(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.ops: set[str] = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        name = str(func.overloadpacket)
        if not func.is_view and name not in _NON_COMPUTE:
            self.ops.add(name)
        return func(*args, **(kwargs or {}))


@pytest.fixture
def one_thread() -> Iterator[None]:
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def test_builtin_set_is_complete():
    assert len(PROBLEMS) >= 13
    with_fast = {c.split("/")[0] for c in CANDIDATES if c.endswith("/c_fast")}
    with_slow = {c.split("/")[0] for c in CANDIDATES if c.endswith("/c_slow")}
    assert len(with_fast) >= 6
    assert with_fast == with_slow


@pytest.mark.parametrize("name", PROBLEMS)
def test_builtin_problem_loads_and_runs(name):
    problem = load_problem(name)
    assert problem.description and "\n" not in problem.description
    prob = _problem(name)
    torch.manual_seed(0)
    model = prob.Model(*prob.get_init_inputs())
    inputs = prob.get_inputs()
    assert inputs and all(x.device.type == "cpu" and x.dtype == torch.float32 for x in inputs)
    assert not torch.equal(inputs[0], prob.get_inputs()[0]), "get_inputs() must draw fresh tensors"
    with torch.no_grad(), _ComputeOps() as ref_ops:
        out = model(*inputs)
    assert isinstance(out, torch.Tensor) and out.dtype == torch.float32
    assert torch.isfinite(out).all()
    if problem.forbidden_ops is not None:  # an explicit list widens the default, never narrows it
        assert ref_ops.ops <= set(problem.forbidden_ops), sorted(ref_ops.ops - set(problem.forbidden_ops))


@pytest.mark.parametrize("spec", CANDIDATES)
def test_candidate_matches_reference(spec):
    path = EXAMPLES / f"{spec}.py"
    assert static_check(path.read_text()) == []
    prob, ref, new = _pair(spec)
    forbidden = set(load_problem(spec.split("/")[0]).forbidden_ops or ())
    with torch.no_grad():
        for trial in range(5):
            torch.manual_seed(1000 + trial)
            inputs = prob.get_inputs()
            pristine = [x.clone() for x in inputs]
            with _ComputeOps() as cand_ops:
                out = new(*inputs)
            with _ComputeOps() as ref_ops:
                expected = ref(*inputs)
            assert all(torch.equal(x, p) for x, p in zip(inputs, pristine, strict=True)), "input mutated"
            assert out.shape == expected.shape and out.dtype == expected.dtype
            tol = tolerance(expected.dtype)
            diff = (out - expected).abs().max().item()
            assert torch.allclose(out, expected, atol=tol, rtol=tol), f"trial {trial}: max |diff| {diff:.3g}"
            shared = cand_ops.ops & (ref_ops.ops | forbidden)
            assert not shared, f"the candidate dispatches forbidden or reference op(s) {sorted(shared)}"


def _per_call(fn, inputs, n: int) -> float:
    t0 = time.perf_counter()
    for _ in range(n):
        fn(*inputs)
    return (time.perf_counter() - t0) / n


def speed_ratio(ref, new, inputs, *, rounds: int = 15, round_s: float = 2e-3) -> float:
    """Median over interleaved rounds of t_ref / t_new, each side timed over enough calls to last
    `round_s` (so both see the same machine noise)."""
    with torch.no_grad():
        for fn in (ref, new, ref, new):
            fn(*inputs)
        n_ref = max(1, math.ceil(round_s / _per_call(ref, inputs, 1)))
        n_new = max(1, math.ceil(round_s / _per_call(new, inputs, 1)))
        ratios = []
        for r in range(rounds):
            if r % 2:
                t_new, t_ref = _per_call(new, inputs, n_new), _per_call(ref, inputs, n_ref)
            else:
                t_ref, t_new = _per_call(ref, inputs, n_ref), _per_call(new, inputs, n_new)
            ratios.append(t_ref / t_new)
    return statistics.median(ratios)


# Timed but not asserted: on 2026-12-02 this box read layernorm/c_fast at 0.64-1.41x of torch from one run
# to the next, alone or in the suite (in the pool's bench of 2026-11-30, 1.16-1.68x). Its only edge over
# torch's one-pass kernel is non-temporal stores, which this machine's memory system does not always reward.
UNSTABLE = {"layernorm/c_fast": "0.64-1.41x of torch across runs on 2026-12-02 (non-temporal stores only)"}


@pytest.mark.parametrize("spec", TIMED)
def test_c_candidate_speed_is_on_the_expected_side(spec, one_thread):
    if spec in UNSTABLE:
        pytest.skip(f"{spec}: not on a stable side on this box: {UNSTABLE[spec]}")
    prob, ref, new = _pair(spec)
    torch.manual_seed(7)
    inputs = prob.get_inputs()
    fast = spec.endswith("/c_fast")
    ratios = []
    for _ in range(3):  # a noisy neighbour can sink one measurement; three misses in a row is a real miss
        ratios.append(speed_ratio(ref, new, inputs))
        if (ratios[-1] > 1.1) if fast else (ratios[-1] < 0.9):
            return
    want = "> 1.1 (faster)" if fast else "< 0.9 (slower)"
    pytest.fail(f"{spec}: t_ref / t_candidate {[round(r, 2) for r in ratios]}, expected {want}")
