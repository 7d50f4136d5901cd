"""Static checks, problem loading and the C backend: fast, in-process tests (no pool)."""

import ctypes

import pytest
import torch

from steptune.kernels.cext import CompileError, load_c, ptr
from steptune.kernels.checks import static_check
from steptune.kernels.problems import builtin_problems, load_problem, tolerance

pytestmark = pytest.mark.timeout(60)


@pytest.mark.parametrize(
    ("source", "rule"),
    [
        ("try:\n    import x\nexcept ImportError:\n    pass\n", "try-fallback"),
        ("import subprocess\n", "banned-import"),
        ("from multiprocessing import Pool\n", "banned-import"),
        ("import threading as t\n", "banned-import"),
        ("import os\nos.fork()\n", "banned-call"),
        ("import os as o\no.system('ls')\n", "banned-call"),
        ("from os import execv\n", "banned-call"),
        ("import torch\ntorch._C._set_grad_enabled(False)\n", "banned-attribute"),
        ("from torch.utils import _python_dispatch\n", "banned-import"),
        ("import torch\ns = torch.cuda.Stream()\n", "banned-attribute"),
        ("import sys\nf = sys._getframe(1)\n", "banned-attribute"),
        ("x = eval('1')\n", "banned-call"),
        ("m = __import__('os')\n", "banned-call"),
        ("import torch\nf = getattr(torch, 'sof' + 'tmax')\n", "computed-attribute"),
        ("b = __builtins__\n", "banned-attribute"),
        ("import steptune_problem\n", "banned-import"),
    ],
)
def test_static_check_rejects(source, rule):
    found = static_check(source)
    assert rule in {f.rule for f in found}, found


def test_static_check_passes_honest_kernels():
    honest = (
        "import ctypes\nimport math\nimport torch\nfrom torch import nn\n"
        "from steptune.kernels.cext import DEFAULT_CFLAGS, load_c, ptr\n"
        "# try: this comment mentions subprocess and eval, which is fine\n"
        "lib = load_c('void f(float* y) { y[0] = 0; }', flags=(*DEFAULT_CFLAGS, '-ffast-math'))\n"
        "class ModelNew(nn.Module):\n"
        "    def forward(self, x):\n"
        "        y = torch.empty_like(x)\n"
        "        lib.f(ptr(y))\n"
        "        return getattr(y, 'contiguous')()\n"
    )
    assert static_check(honest) == []
    assert static_check("def broken(:\n") == []  # a syntax error is the worker's compile_error, not a finding


def test_builtin_problems_load():
    names = builtin_problems()
    assert len(names) >= 12
    for n in names:
        p = load_problem(n)
        assert p.name == n and "class Model" in p.source and p.description


def test_problem_errors_say_what_to_change(tmp_path):
    with pytest.raises(ValueError, match="unknown problem 'nope'"):
        load_problem("nope")
    bad = tmp_path / "bad.py"
    bad.write_text("import torch\nclass Model: pass\n")
    with pytest.raises(ValueError, match="lacks get_inputs, get_init_inputs"):
        load_problem(bad)
    good = tmp_path / "mine.py"
    good.write_text(
        "ATOL = 1e-3\nFORBIDDEN_OPS = ['aten.mm']\nclass Model: pass\n"
        "def get_inputs(): return []\ndef get_init_inputs(): return []\n"
    )
    p = load_problem(good)
    assert (p.name, p.atol, p.rtol, p.forbidden_ops) == ("mine", 1e-3, None, ("aten.mm",))
    assert tolerance(torch.float32) == 1e-4 and tolerance(torch.bfloat16) == 1e-2
    assert tolerance(torch.int64) == 0.0


def test_load_c_compiles_caches_and_reports_errors(tmp_path, monkeypatch):
    monkeypatch.setenv("STEPTUNE_KERNELS_BUILD", str(tmp_path))
    src = (
        "void axpy(float a, const float* x, float* y, long n) {"
        " for (long i = 0; i < n; i++) y[i] += a * x[i]; }"
    )
    lib = load_c(src)
    lib.axpy.argtypes = [ctypes.c_float, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_long]
    x, y = torch.arange(5.0), torch.ones(5)
    lib.axpy(2.0, x.data_ptr(), y.data_ptr(), 5)
    assert torch.equal(y, 1 + 2 * torch.arange(5.0))
    assert len(list(tmp_path.glob("*.so"))) == 1
    load_c(src)  # cached: no second library
    assert len(list(tmp_path.glob("*.so"))) == 1
    with pytest.raises(CompileError, match="failed") as info:
        load_c("void f( { }")
    assert "error" in info.value.log
    with pytest.raises(ValueError, match="contiguous"):
        ptr(torch.ones(4, 4).t())


def test_a_directory_named_like_a_builtin_problem_does_not_shadow_it(tmp_path, monkeypatch):

    from steptune.kernels.problems import load_problem

    monkeypatch.chdir(tmp_path)
    (tmp_path / "softmax").mkdir()  # was: "problem file 'softmax' not found"
    assert load_problem("softmax").name == "softmax"
    (tmp_path / "mine").mkdir()
    with pytest.raises(ValueError, match="'mine' is a directory, not a problem file"):
        load_problem("mine")


def test_the_static_checks_allow_exactly_cexts_public_names():
    # checks.py lists them itself (importing cext there would import torch into the CLI)
    from steptune.kernels import cext
    from steptune.kernels.checks import _ALLOWED_FROM

    assert {"steptune.kernels.cext": set(cext.__all__)} == _ALLOWED_FROM
    assert static_check("from steptune.kernels.cext import load_c, ptr\n") == []
    assert static_check("from steptune.kernels.cext import subprocess\n")
