"""`steptune kernels optimize` and `eval` when things go wrong: output paths that clash."""

import shutil
from pathlib import Path

import pytest

from steptune.cli import main

pytestmark = pytest.mark.timeout(60)

HONEST = """import torch
from torch import nn


class ModelNew(nn.Module):
    def forward(self, x):
        e = (x - x.amax(dim=-1, keepdim=True)).exp()
        return e / e.sum(dim=-1, keepdim=True)
"""
SOFTMAX = Path(__file__).resolve().parents[3] / "src/steptune/kernels/builtin_problems/softmax.py"


@pytest.mark.parametrize(
    "clash",
    [
        ["--problem", "{p}", "--out", "{p}"],
        ["--problem", "{p}", "--json", "{p}"],
        ["--problem", "softmax", "--out", "{d}/x.py", "--json", "{d}/x.py"],
        ["--problem", "softmax", "--json", "softmax_best.py"],  # the default --out
    ],
)
def test_optimize_refuses_outputs_that_clash_before_any_work(tmp_path, capsys, monkeypatch, clash):
    monkeypatch.chdir(tmp_path)
    prob = tmp_path / "myprob.py"
    shutil.copy(SOFTMAX, prob)
    before = prob.read_text()
    args = [a.format(p=prob, d=tmp_path) for a in clash]
    # the server URL is unreachable: reaching it would be a different error
    code = main(["kernels", "optimize", "--llm-url", "http://127.0.0.1:9/v1", "--model", "m", *args])
    err = capsys.readouterr().err
    assert code == 2 and "name the same file" in err and "give each its own path" in err, err
    assert prob.read_text() == before and not (tmp_path / "x.py").exists()


@pytest.mark.parametrize("flag", ["--candidate", "--problem"])
def test_eval_refuses_a_json_over_its_inputs(tmp_path, capsys, flag):
    cand, prob = tmp_path / "c.py", tmp_path / "p.py"
    cand.write_text(HONEST)
    shutil.copy(SOFTMAX, prob)
    target = cand if flag == "--candidate" else prob
    before = target.read_text()
    code = main(["kernels", "eval", "--problem", str(prob), "--candidate", str(cand), "--json", str(target)])
    err = capsys.readouterr().err
    assert code == 2 and f"{flag} and --json name the same file" in err, err
    assert target.read_text() == before
