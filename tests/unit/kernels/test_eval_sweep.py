"""Verdicts a user sweep found wrong (2026-12-05), each with the candidate that showed it: cheats judged
correct, correct kernels judged crashed or incorrect, and problem faults blamed on the candidate."""

import random

import pytest
import torch

from steptune.kernels.agent import PROBLEM_ERROR
from steptune.kernels.pool import EvalPool, PoolConfig
from steptune.kernels.problems import Problem, load_problem

pytestmark = [pytest.mark.timeout(300), pytest.mark.slow]

HEAD = "import random\nimport torch\nfrom torch import nn\n"


def _problem(name: str, forward: str, inputs: str) -> Problem:
    source = (
        f"{HEAD}class Model(nn.Module):\n    def forward(self, *a):\n        {forward}\n"
        f"def get_inputs():\n    return {inputs}\n"
        "def get_init_inputs():\n    return []\n"
    )
    return Problem(name=name, source=source)


def _candidate(forward: str, init: str = "", prelude: str = "") -> str:
    init = f"    def __init__(self):\n        super().__init__()\n        {init}\n" if init else ""
    return f"{HEAD}{prelude}class ModelNew(nn.Module):\n{init}    def forward(self, *a):\n        {forward}\n"


SOFTMAX = _problem("sm", "return torch.softmax(a[0], dim=-1)", "[torch.randn(8, 64)]")
HAND_SOFTMAX = "e = torch.exp(a[0] - a[0].amax(-1, keepdim=True)); return e / e.sum(-1, keepdim=True)"
LISTS = _problem(
    "lists", "return torch.stack(a[0]).sum(0) * a[1]", "[[torch.randn(16) for _ in range(3)], 3]"
)


@pytest.fixture(scope="module")
def pools():
    cfg = dict(num_workers=2, timeout_s=30)
    with EvalPool(PoolConfig(**cfg)) as checked, EvalPool(PoolConfig(**cfg, static_checks=False)) as bare:
        yield checked, bare


def _verdict(pool, problem, source, kind="validate"):
    res = pool.submit(problem, source, kind=kind).result(timeout=120)
    return res.verdict, res.reason


def test_a_candidate_that_patches_torch_is_rejected_before_and_at_run_time(pools):
    # It was judged correct: the reference looked up the patched torch.softmax and returned zeros too
    checked, bare = pools
    patch = "torch.softmax = lambda x, dim=None, **k: torch.zeros_like(x)\n"
    source = _candidate("return torch.zeros_like(a[0])", prelude=patch)
    verdict, reason = _verdict(checked, SOFTMAX, source)
    assert verdict == "rejected" and "line 4: rebinds torch.softmax" in reason, reason
    verdict, reason = _verdict(bare, SOFTMAX, source)
    assert verdict == "rejected" and "rebinds torch.softmax" in reason, reason
    # through setattr with a literal name, and made slow to lift an honest kernel's speedup
    sneaky = (
        "_f = torch.softmax\nsetattr(torch, 'softmax', lambda *x, **k: [_f(*x, **k) for _ in range(4)][0])\n"
    )
    verdict, reason = _verdict(bare, SOFTMAX, _candidate(HAND_SOFTMAX, prelude=sneaky), kind="profile")
    assert verdict == "rejected" and "rebinds torch.softmax" in reason, reason
    assert _verdict(checked, SOFTMAX, _candidate(HAND_SOFTMAX, prelude=sneaky))[0] == "rejected"


def test_the_op_recorder_cannot_be_reached_through_an_alias(pools):
    checked, _ = pools
    for way in ("torch.nn.functional.torch._C", "operator.attrgetter('_C')(torch)"):
        source = f"import operator\nC = {way}\n" + _candidate(
            "with C._DisableTorchDispatch():\n            return torch.softmax(a[0], -1)"
        )
        verdict, reason = _verdict(checked, SOFTMAX, source)
        assert verdict == "rejected" and reason.startswith("static check: line "), reason


def test_tensors_inside_list_inputs_are_copied_and_checked(pools):
    # The candidate zeroed the list's tensors, which the reference then read: "correct, 4.76x"
    checked, _ = pools
    assert _verdict(checked, LISTS, _candidate("return (a[0][0] + a[0][1] + a[0][2]) * a[1]"))[0] == "correct"
    for cheat in (
        "[x.zero_() for x in a[0]]; return torch.zeros_like(a[0][0])",
        "a[0].pop(); return a[0][0] * 0",
    ):
        assert _verdict(checked, LISTS, _candidate(cheat)) == ("incorrect", "the candidate mutated input 0")


def test_timed_calls_are_checked_too(pools):
    # Right on the validation calls, then x.clone() while timed: it was "correct, 5.31x"
    checked, _ = pools
    counter = _candidate(
        f"self.n += 1\n        if self.n > 5:\n            return a[0].clone()\n        {HAND_SOFTMAX}",
        init="self.n = 0",
    )
    verdict, reason = _verdict(checked, SOFTMAX, counter, kind="profile")
    assert verdict == "incorrect" and "a timed call (round" in reason, reason
    verdict, reason = _verdict(checked, SOFTMAX, _candidate(HAND_SOFTMAX), kind="profile")
    assert verdict == "correct", reason


MM = _problem("mm", "return a[0] @ a[1]", "[torch.randn(160, 160), torch.randn(160, 160)]")
EINSUM = "torch.einsum('ij,jk->ik', a[0], a[1])"


def _memo(key: str) -> str:
    return _candidate(
        f"k = {key}\n        if k in self.c:\n            return self.c[k].clone()\n"
        f"        o = {EINSUM}\n        self.c[k] = o.clone()\n        return o",
        init="self.c = {}",
    )


def test_results_memoized_by_input_identity_are_not_timed_as_speedups(pools):
    # A session-47 sweep: caches keyed by the input tensors' pointers, their versions, or the last inputs
    # returned a copy of the first result while timed: "correct" at 16-46x on this matmul
    checked, _ = pools
    last = _candidate(
        f"if self.x is a[0] and self.y is a[1]:\n            return self.o.clone()\n"
        f"        self.x, self.y, self.o = a[0], a[1], {EINSUM}\n        return self.o.clone()",
        init="self.x = self.y = self.o = None",
    )
    for cheat in (_memo("(a[0].data_ptr(), a[1].data_ptr())"), last):
        verdict, reason = _verdict(checked, MM, cheat, kind="profile")
        assert verdict == "incorrect" and "inputs overwritten in place" in reason, reason
    # keyed by version too: every timed call bumps the inputs' versions, so it computes every time (or,
    # when a fresh unseen draw lands at a freed draw's address with version 0, returns that draw's result)
    res = checked.submit(MM, _memo("(a[0].data_ptr(), a[0]._version, a[1]._version)"), kind="profile")
    res = res.result(timeout=120)
    stale = res.verdict == "incorrect" and "a draw it had not seen" in res.reason
    computed = res.verdict == "correct" and res.speedup < 3.0 and not res.extra.get("suspicious")
    assert stale or computed, (res.verdict, res.speedup, res.reason)
    honest = checked.submit(MM, _candidate(f"return {EINSUM}"), kind="profile").result(timeout=120)
    assert honest.verdict == "correct" and not honest.extra.get("suspicious"), honest.reason
    assert 0.2 < honest.extra["unseen_speedup"] < 5.0, honest.extra


def test_results_memoized_by_input_contents_have_their_speedup_withheld(pools):
    # Keyed by the inputs' sums it hit on every timed call (two draws, seen over and over): "correct" at
    # 6.5-18.8x on this matmul. On five draws it had not seen it was 0.59-0.65x: flagged, not credited
    checked, _ = pools
    res = checked.submit(MM, _memo("(float(a[0].sum()), float(a[1].sum()))"), kind="profile")
    res = res.result(timeout=120)
    assert res.verdict == "correct" and res.extra.get("suspicious"), (res.verdict, res.speedup, res.reason)
    assert res.speedup > 2.5 * res.extra["unseen_speedup"], res.extra
    assert "a result cached by the inputs' contents?" in res.reason, res.reason


@pytest.mark.parametrize(
    ("forward", "inputs", "candidate"),
    [
        # a 0-d input: _same_bits viewed it as bytes and crashed
        (
            "return a[0] * a[1]",
            "[torch.randn(5), torch.tensor(3.0)]",
            "return torch.addcmul(torch.zeros_like(a[0]), a[0], a[1].expand_as(a[0]))",
        ),
        # complex outputs were compared bitwise (tolerance 0)
        ("return torch.fft.fft(a[0])", "[torch.randn(64)]", "return _dft(a[0])"),
        # a Python float output was compared exactly
        (
            "return float(a[0].sum())",
            "[torch.randn(1000)]",
            "return float(torch.dot(a[0], torch.ones_like(a[0])))",
        ),
    ],
    ids=["zero_dim_input", "complex_output", "float_output"],
)
def test_correct_kernels_are_judged_correct(pools, forward, inputs, candidate):
    checked, _ = pools
    dft = (
        "def _dft(x):\n    n = x.numel()\n    k = torch.arange(n, dtype=torch.float64)\n"
        "    w = torch.exp(-2j * torch.pi * torch.outer(k, k) / n)\n"
        "    return (w @ x.to(torch.complex128)).to(torch.complex64)\n"
    )
    verdict, reason = _verdict(checked, _problem("p", forward, inputs), _candidate(candidate, prelude=dft))
    assert verdict == "correct", reason


def test_a_tensor_where_the_reference_returns_a_float_is_incorrect(pools):
    checked, _ = pools
    problem = _problem("f", "return float(a[0].sum())", "[torch.randn(10)]")
    assert _verdict(checked, problem, _candidate("return a[0].cumsum(0)[-1]")) == (
        "incorrect",
        "output 0 is a Tensor, the reference gives a float",
    )


@pytest.mark.parametrize(
    "inputs",
    ["[torch.randn(3 - random.randint(0, 1))]", "[torch.randn(8)] if random.random() > 0.45 else 1 / 0"],
)
def test_a_problem_that_fails_on_a_later_draw_is_a_problem_error(pools, inputs):
    # An odd length the reference cannot view(2, -1), or get_inputs raising, on a later draw (the warm-up
    # draw, seeded 0, passes; trial 1's or 4's fails): this was blamed on the candidate ("crashed"), and
    # optimize went on searching
    checked, _ = pools
    problem = _problem("late", "return a[0].view(2, -1).sum(0)", inputs)
    halves = _candidate("return a[0].view(2, -1)[0] + a[0].view(2, -1)[1]")
    verdict, reason = _verdict(checked, problem, halves)
    assert verdict == "crashed" and reason.startswith(PROBLEM_ERROR), reason


def test_inputs_drawn_with_pythons_random_are_seeded(pools):
    # A value from random.randint: only torch was seeded, so verdicts changed from run to run
    checked, _ = pools
    problem = _problem("coin", "return a[0] * 2", "[torch.full((4,), float(random.randint(0, 1)))]")
    wrong_on_ones = _candidate("return torch.where(a[0] > 0.5, a[0] + a[0] + 0.5, a[0] + a[0])")
    coins = []
    for trial in range(5):
        random.seed(1000 + trial)  # the evaluator's seed for trial k (problem seed 0)
        coins.append(random.randint(0, 1))
    want = ("correct", "") if 1 not in coins else ("incorrect", f"trial {coins.index(1)}")
    for _ in range(2):
        verdict, reason = _verdict(checked, problem, wrong_on_ones)
        assert verdict == want[0] and want[1] in reason, (coins, verdict, reason)


def test_problem_constants_are_checked_when_loaded(tmp_path):
    base = SOFTMAX.source
    for line, message in [
        ("ATOL = [1e-3]", "ATOL = [0.001]; write a finite number >= 0"),
        ("RTOL = -1.0", "RTOL = -1.0; write a finite number >= 0"),
        ("FORBIDDEN_OPS = ['aten::mm', 'torch.mm']", "would match nothing: name aten ops as the recorder"),
    ]:
        path = tmp_path / "p.py"
        path.write_text(f"{base}\n{line}\n")
        with pytest.raises(ValueError, match=message.replace("[", r"\[").replace("]", r"\]")):
            load_problem(path)
    path.write_text(f"{base}\nFORBIDDEN_OPS = ['aten.mm', 'aten.addmm']\nATOL = 0\n")
    assert load_problem(path).forbidden_ops == ("aten.mm", "aten.addmm")


def test_a_crash_names_the_candidates_failing_line(pools):
    # The last 4 frames were the evaluator's, the op recorder's and torch's: the failing line was cut off
    checked, _ = pools
    helpers = "def deep(x):\n    return x.view(3, -1, 7)\n\n\ndef helper(x):\n    return deep(x) * 2\n\n\n"
    verdict, reason = _verdict(checked, SOFTMAX, _candidate("return helper(a[0])", prelude=helpers))
    assert verdict == "crashed" and "in deep\n" in reason and "x.view(3, -1, 7)" in reason, reason
    assert "_ops.py" not in reason and "evaluate.py" not in reason, reason


def test_review_of_the_sweep_fixes_torch_compile_numpy_inputs_and_numpy_init(pools):
    # Found reviewing the fixes above: torch.compile's dynamo rebinds Module.__init__ (taken for a patch),
    # a numpy input was "mutated" (== on arrays is elementwise), and ModelNew's numpy draws were unseeded
    checked, _ = pools
    compiled = _candidate(
        "return self.f(a[0])", init="self.f = torch.compile(lambda x: x * 2.0, backend='eager')"
    )
    verdict, reason = _verdict(checked, _problem("c", "return a[0] + a[0]", "[torch.randn(8)]"), compiled)
    assert verdict == "correct", reason
    numpy_in = _problem(
        "np", "return a[0][torch.as_tensor(a[1])]", "[torch.randn(8), __import__('numpy').array([0, 3, 5])]"
    )
    verdict, reason = _verdict(
        checked, numpy_in, _candidate("return torch.index_select(a[0], 0, torch.tensor(a[1]))")
    )
    assert verdict == "correct", reason
    src = HEAD + (
        "import numpy as np\nclass Model(nn.Module):\n    def __init__(self):\n        super().__init__()\n"
        "        self.register_buffer('p', torch.as_tensor(np.random.permutation(8)))\n"
        "    def forward(self, x):\n        return x[self.p]\n"
        "def get_inputs():\n    return [torch.randn(8)]\ndef get_init_inputs():\n    return []\n"
    )
    cand = HEAD + (
        "import numpy as np\nclass ModelNew(nn.Module):\n    def __init__(self):\n"
        "        super().__init__()\n"
        "        self.register_buffer('p', torch.as_tensor(np.random.permutation(8)))\n"
        "    def forward(self, x):\n        return torch.index_select(x, 0, self.p)\n"
    )
    verdict, reason = _verdict(checked, Problem(name="perm", source=src), cand)
    assert verdict == "correct", reason


@pytest.mark.parametrize(
    ("forward", "inputs", "candidate"),
    [
        # an output that views its input
        ("return torch.flatten(a[0], 1)", "[torch.randn(64, 8, 32)]", "return a[0].view(a[0].shape[0], -1)"),
        # sorted input values the candidate relies on
        ("return torch.searchsorted(a[0], a[1])", "[torch.sort(torch.randn(2000)).values, torch.randn(500)]",
         "return (a[0].unsqueeze(0) < a[1].unsqueeze(1)).sum(1)"),
        # a strided (non-dense) float input
        ("return a[0] * 2 + a[1].sum()", "[torch.randn(64, 64)[:, ::2], torch.randn(64, 32)]",
         "return a[0] + a[0] + a[1].sum()"),
    ],
    ids=["output-views-input", "sorted-input", "strided-input"],
)  # fmt: skip
def test_kernels_of_views_sorted_and_strided_inputs_profile_as_correct(pools, forward, inputs, candidate):
    # A first version of varied profiling inputs (session 44, reverted) judged each of these incorrect or a
    # problem error: the cases any later version must pass
    checked, _ = pools
    res = checked.submit(_problem("p", forward, inputs), _candidate(candidate), kind="profile").result(120)
    assert res.verdict == "correct", res


LIAR = (
    "class Liar(torch.Tensor):\n"
    "    @classmethod\n"
    "    def __torch_function__(cls, func, types, args=(), kwargs=None):\n"
    "        if func is torch.allclose:\n            return True\n"
    "        return super().__torch_function__(func, types, args, kwargs or {})\n"
)
HOOK = (
    "def _slow(m, i, o):\n    for _ in range(3):\n        torch.softmax(i[0], -1)\n"
    "torch.nn.modules.module.register_module_forward_hook(_slow)\n"
)


@pytest.mark.parametrize(
    ("prelude", "forward", "kind", "static", "runtime"),
    [
        # a subclass answering allclose with True: zeros judged "correct, 6.66x"
        (LIAR, "return torch.zeros_like(a[0]).as_subclass(Liar)", "validate",
         "defines __torch_function__", "tensor subclass"),
        # a plain subclass passes the static checks; its type alone is refused
        ("class Plain(torch.Tensor):\n    pass\n", f"{HAND_SOFTMAX}\n        ".replace("return ", "out = ")
         + "return out.as_subclass(Plain)", "validate", None, "a Plain, a tensor subclass"),
        # the evaluator's own op list, widened from the candidate: the reference's op then "did not count"
        ("from steptune.kernels.evaluate import _NON_COMPUTE\n_NON_COMPUTE.add('aten._softmax')\n",
         "return torch.softmax(a[0], -1)", "validate", "imports steptune",
         "'frozenset' object has no attribute 'add'"),
        # ... or reached through torch.sys (a review), or its comparison switched off: zeros judged correct
        ("ev = torch.sys.modules['steptune.kernels.evaluate']\n"
         "ev._Namespaces.check = lambda self, when: None\n",
         "return torch.zeros_like(a[0])", "validate", "uses the attribute sys", None),
        ("import steptune.kernels.evaluate as ev\nev._compare = lambda *a, **k: 0.0\n",
         "return torch.zeros_like(a[0])", "validate", "imports steptune",
         "rebinds steptune.kernels.evaluate._compare"),
        # a clock that hides 90% of the candidate's time: "correct 3.03x" for a 0.4x kernel
        ("import time\n_real = time.perf_counter\ntime.__setattr__('perf_counter', lambda: _real() * 0.1)\n",
         HAND_SOFTMAX, "profile", "uses the attribute __setattr__", "rebinds time.perf_counter"),
        # a global module hook that reruns softmax three times inside the reference: 2.02x for a 0.42x kernel
        (HOOK, HAND_SOFTMAX, "profile", None, "torch.nn.modules.module._global_forward_hooks"),
        # a lower default dtype widened a float output's tolerance; grad mode left on slowed the reference
        ("torch.set_default_dtype(torch.float64)\n", HAND_SOFTMAX, "validate", None, "the default dtype"),
        # the new TF32 API made the legacy read raise: the state check crashed instead of rejecting (a review)
        ("torch.backends.cuda.matmul.fp32_precision = 'tf32'\n", HAND_SOFTMAX, "validate",
         "rebinds torch.backends.cuda.matmul.fp32_precision", "changed the fp32"),
        ("", f"torch.set_grad_enabled(True)\n        {HAND_SOFTMAX}", "profile", None,
         "grad mode (False -> True)"),
    ],
    ids=["subclass-liar", "plain-subclass", "evaluator-set", "torch-sys", "evaluator-patch", "clock-patch",
         "global-hook", "default-dtype", "fp32-precision", "grad-mode"],
)  # fmt: skip
def test_candidates_that_change_the_evaluator_or_torch_globals_are_rejected(
    pools, prelude, forward, kind, static, runtime
):
    # A user sweep (session 46): each was judged correct (and most faster than they are) before
    checked, bare = pools
    source = _candidate(forward, prelude=prelude)
    verdict, reason = _verdict(checked, SOFTMAX, source, kind)
    assert verdict == "rejected" and (static or runtime) in reason, reason
    if runtime is None:  # in-process checks cannot stop a candidate holding the evaluator (docs/kernels.md)
        return
    verdict, reason = _verdict(bare, SOFTMAX, source, kind)  # past the static checks, the run time's
    assert verdict != "correct" and runtime in reason, reason


PRECOMPUTED = _candidate(
    "o = self.c.get(float(a[0][0, 0]))\n        return o.clone() if o is not None else " + EINSUM,
    init=(
        "self.c = {}\n        for s in [1000 + t for t in range(5)] + [99 + 100 * k for k in range(7)]:\n"
        "            torch.manual_seed(s)\n            x, y = torch.randn(160, 160), torch.randn(160, 160)\n"
        "            self.c[float(x[0, 0])] = torch.einsum('ij,jk->ik', x, y)"
    ),
)


def test_profiling_draws_come_from_a_secret_seed(pools):
    # A red team (session 48): the profiling draws were seeded from the public seed, so a candidate
    # regenerated all of them and their answers in __init__ and looked them up while timed, unseen draws
    # included ("correct", about 6x on this matmul with a spin to stay under the 10x flag)
    checked, _ = pools
    res = checked.submit(MM, PRECOMPUTED, kind="profile").result(timeout=120)
    # looked up it was 6x and more; computed it is about 0.9x (3x leaves room for a busy box's noise)
    assert res.verdict == "correct" and res.speedup < 3.0, (res.speedup, res.reason, res.extra)
    other = checked.submit(MM, PRECOMPUTED, kind="profile").result(timeout=120)
    assert res.extra["profile_seed"] != other.extra["profile_seed"]
    # a given seed reproduces the draws (the validation draws keep the public seed)
    with EvalPool(PoolConfig(num_workers=1, timeout_s=30, profile_seed=res.extra["profile_seed"])) as pool:
        again = pool.submit(MM, PRECOMPUTED, kind="profile").result(timeout=120)
    assert again.extra["profile_seed"] == res.extra["profile_seed"]  # the draws: the next test


def test_the_secret_seed_does_not_reach_the_candidate(pools):
    # A review (session 48): the RNGs kept the last profiling draw's seed, so module code read the secret
    # from torch.initial_seed() and looked every profiling draw up (2.35x with one exp per call, credited)
    checked, _ = pools
    leak = _candidate(
        "o = self.c.get(float(a[0][0, 0]))\n        return o.clone() if o is not None else " + EINSUM,
        init=(
            "self.c = {}\n        for k in range(7):\n            torch.manual_seed(_S + 100 * k)\n"
            "            x, y = torch.randn(160, 160), torch.randn(160, 160)\n"
            "            self.c[float(x[0, 0])] = torch.einsum('ij,jk->ik', x, y)"
        ),
        prelude="_S = torch.initial_seed() - 600\n",
    )
    res = checked.submit(MM, leak, kind="profile").result(timeout=120)
    assert res.verdict == "correct" and res.speedup < 3.0, (res.speedup, res.reason, res.extra)


def test_a_profile_seed_reproduces_the_draws(tmp_path):
    from steptune.kernels.evaluate import _prepare

    problem = {"source": MM.source, "seed": 0}

    def draws(seed):
        return [inputs for inputs, _ in _prepare(problem, tmp_path, "cpu", 1, seed).profile]

    a, b, c = draws(12345), draws(12345), draws(777)
    assert all(torch.equal(x, y) for da, db in zip(a, b, strict=True) for x, y in zip(da, db, strict=True))
    assert not torch.equal(a[0][0], c[0][0])
    # the RNGs end on the public seed, not the secret one
    assert torch.initial_seed() == 0


def test_draws_of_unequal_work_are_not_compared(pools):
    # A loop count drawn per call: the two timed draws ran 7 and 6 iterations, the unseen ones 1-6, so an
    # exact closed form was 10.5x timed and 1.73x unseen, and its speedup was withheld as a cache
    checked, _ = pools
    problem = _problem(
        "loop",
        "y = a[0]\n        for _ in range(a[1]):\n            y = y * 0.5 + 1.0\n        return y",
        "[torch.randn(256, 256), random.randint(1, 8)]",
    )
    closed = _candidate("c = 0.5 ** a[1]\n        return a[0] * c + 2.0 * (1.0 - c)")
    res = checked.submit(problem, closed, kind="profile").result(timeout=120)
    assert res.verdict == "correct" and not res.extra.get("suspicious"), (res.reason, res.extra)
    assert "differ in shapes or non-tensor inputs" in res.extra["unseen_note"]


@pytest.mark.parametrize(
    "prelude",
    [
        # a generator's frame walked back to the evaluator's locals (prep held every reference output)
        "def _up():\n    yield 0\n_F = (lambda g: g.gi_frame.f_back)(_up())\n",
        "import traceback\n_F = list(traceback.walk_stack(None))\n",
        "import logging\n_F = logging.currentframe()\n",
        # the secret seeds fixed through random's os.urandom
        "_M = [random]\n_M[0]._urandom = lambda n: bytes(n)\n",
    ],
    ids=["gi_frame", "traceback", "logging", "urandom"],
)
def test_routes_to_the_evaluators_frames_and_seeds_are_rejected(pools, prelude):
    # A second red team (session 48): each of these passed the checks and was credited 4.4-7.4x
    checked, _ = pools
    verdict, reason = _verdict(checked, MM, _candidate(f"return {EINSUM}", prelude=prelude), kind="profile")
    assert verdict == "rejected" and "static check" in reason, reason


def test_the_urandom_patch_is_caught_at_run_time_too(pools):
    _, bare = pools
    patch = "_M = [random]\n_M[0]._urandom = lambda n: bytes(n)\n"
    verdict, reason = _verdict(bare, MM, _candidate(f"return {EINSUM}", prelude=patch), kind="profile")
    assert verdict == "rejected" and "random._urandom" in reason, reason
