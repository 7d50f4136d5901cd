"""``steptune resilience elastic``: a user's own loop from a file, one rank SIGKILLed, the rest go on."""

import json
import re
import sys

import pytest

from steptune.cli import main

pytestmark = [pytest.mark.dist, pytest.mark.timeout(180)]

TRAIN = """
import os, signal
import torch

def train(ctx, steps, kill="none"):
    torch.manual_seed(0)
    model = torch.nn.Linear(8, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    ctx.track(model, opt)
    losses = {}
    while ctx.step < int(steps):
        with ctx.attempt():
            g = torch.Generator().manual_seed(ctx.step)
            x = torch.randn(12, 8, generator=g)
            mine = list(ctx.shard(len(x)))
            loss = ((model(x[mine]) - x[mine].sum(1, keepdim=True)) ** 2).sum() / len(x)
            loss.backward()
            if f"{ctx.orig}:{ctx.step}" in kill.split(","):
                os.kill(os.getpid(), signal.SIGKILL)
            if f"{ctx.orig}:{ctx.step}:stop" in kill.split(","):
                os.kill(os.getpid(), signal.SIGSTOP)  # hung, not dead
            losses[ctx.step] = ctx.sync(model, loss)
            opt.step()
            opt.zero_grad()
    return losses
"""


@pytest.fixture(autouse=True)
def _own_sys_path(monkeypatch):  # the verb appends the target file's folder
    monkeypatch.setattr(sys, "path", list(sys.path))


def test_a_loop_from_a_file_survives_a_kill(tmp_path, capsys):
    script = tmp_path / "elastic_cli_loop.py"
    script.write_text(TRAIN)
    (tmp_path / "json.py").write_text("raise SystemExit('a neighbour named json.py was imported')\n")
    out = tmp_path / "res.json"
    opts = ["--nproc-per-node", "3", "--json", str(out), "--group-timeout", "2", "--hang-timeout", "3"]
    args = ["resilience", "elastic", *opts, f"{script}:train", "5", "1:2,2:1:stop"]
    assert main(args) == 0
    text = capsys.readouterr().out
    assert "rank 1 lost (SIGKILL)" in text and "survivors [0]" in text, text
    assert re.search(r"rank 2 lost \(hung: silent \d+(\.\d)? s as its peers rejoined; killed\)", text), text
    res = json.loads(out.read_text())
    assert res["survivors"] == [0] and sorted(res["results"]) == ["0"] and list(res["hung"]) == ["2"], res
    assert len(res["results"]["0"]) == 5


@pytest.mark.parametrize(
    ("target", "says"),
    [("nofunction", "module:function"), ("missing_file.py:train", "no such file"),
     ("json:nothere", "has no function 'nothere'"), ("no_such_module_xyz:f", "cannot import")],
)  # fmt: skip
def test_a_bad_target_says_what_is_wrong(target, says, capsys):
    assert main(["resilience", "elastic", target]) == 2
    assert says in capsys.readouterr().err


def test_a_file_shadowed_or_broken_and_misplaced_options_are_named(tmp_path, capsys):
    (tmp_path / "json.py").write_text("def train(ctx):\n    return 1\n")
    assert main(["resilience", "elastic", f"{tmp_path / 'json.py'}:train"]) == 2
    assert "shadowed by the module 'json'" in capsys.readouterr().err
    (tmp_path / "broken_loop.py").write_text("def train(ctx:\n")
    assert main(["resilience", "elastic", f"{tmp_path / 'broken_loop.py'}:train"]) == 2
    assert "SyntaxError" in capsys.readouterr().err
    script = tmp_path / "quick_loop.py"
    script.write_text("def train(ctx, *args):\n    return list(args)\n")
    out = tmp_path / "missing" / "r.json"  # a folder --json names is created (it ran, then lost the JSON)
    args = ["resilience", "elastic", "--json", str(out), f"{script}:train", "--nproc-per-node", "2"]
    assert main(args) == 0
    assert "come after the target" in capsys.readouterr().err
    assert json.loads(out.read_text())["results"] == {"0": ["--nproc-per-node", "2"]}


def test_json_over_the_training_script_is_refused_before_any_rank_starts(tmp_path, capsys):
    script = tmp_path / "victim_loop.py"
    script.write_text(TRAIN)
    assert main(["resilience", "elastic", "--json", str(script), f"{script}:train", "2"]) == 2
    assert "is the training script" in capsys.readouterr().err
    assert script.read_text() == TRAIN  # before, the results replaced the script


def test_no_survivors_lists_how_each_rank_ended(tmp_path, capsys):
    """It said "their stderr says why", but a SIGKILLed rank writes no stderr."""
    script = tmp_path / "elastic_cli_all_die.py"
    script.write_text("import os, signal\n\ndef train(ctx):\n    os.kill(os.getpid(), signal.SIGKILL)\n")
    assert main(["resilience", "elastic", "--nproc-per-node", "2", "--timeout", "60", f"{script}:train"]) == 1
    err = capsys.readouterr().err
    assert "no survivors" in err and "rank 0: killed by SIGKILL, rank 1: killed by SIGKILL" in err, err


def test_arguments_the_function_cannot_take_are_refused_before_any_rank_starts(tmp_path, capsys):
    # Found in review: each rank raised "missing 1 required positional argument" after the group formed.
    script = tmp_path / "needs_steps_loop.py"
    script.write_text("def train(ctx, steps):\n    return int(steps)\n")
    assert main(["resilience", "elastic", "--nproc-per-node", "2", f"{script}:train"]) == 2
    err = capsys.readouterr().err
    assert "train(ctx, steps) cannot be called as train(ctx)" in err and "as strings" in err, err
    assert main(["resilience", "elastic", "--nproc-per-node", "2", f"{script}:train", "1", "2"]) == 2
    assert "cannot be called as train(ctx, '1', '2')" in capsys.readouterr().err


HEADS = """
import torch
from torch import nn


def build():
    torch.manual_seed(0)
    body, a, b = nn.Linear(8, 16), nn.Linear(16, 1), nn.Linear(16, 1)
    model = nn.ModuleDict({"body": body, "a": a, "b": b})
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2)


def loss_of(model, step, rows):
    g = torch.Generator().manual_seed(step)
    x, y = torch.randn(8, 8, generator=g), torch.randn(8, 1, generator=g)
    head = model["a"] if step % 2 == 0 else model["b"]  # the other head gets no gradient this step
    return ((head(torch.tanh(model["body"](x[rows]))) - y[rows]) ** 2).sum() / 8


def train(ctx, steps):
    model, opt = build()
    ctx.track(model, opt)
    out = []
    while ctx.step < int(steps):
        with ctx.attempt():
            loss = loss_of(model, ctx.step, list(ctx.shard(8)))
            loss.backward()
            out.append(ctx.sync(model, loss))
            opt.step()
            opt.zero_grad()
    return out


def reference(steps):
    model, opt = build()
    out = []
    for step in range(steps):
        loss = loss_of(model, step, list(range(8)))
        loss.backward()
        out.append(float(loss.detach()))
        opt.step()
        opt.zero_grad()
    return out


def mismatched(ctx):
    model = nn.Linear(8, 1) if ctx.orig != 1 else nn.Linear(8, 2)
    ctx.track(model)
    with ctx.attempt():
        model(torch.randn(2, 8)).sum().backward()
        ctx.sync(model)
"""


def test_sync_leaves_a_parameter_no_rank_computed_a_gradient_for_without_one(tmp_path):
    # Found in a sweep (2026-12-05): ctx.sync gave such a parameter zeros, so AdamW decayed and moved it
    # where one process (and DDP) skips it: losses 0.5949 vs 0.6096 at step 5
    script = tmp_path / "two_heads.py"
    script.write_text(HEADS)
    out = tmp_path / "r.json"
    assert (
        main(["resilience", "elastic", "--nproc-per-node", "2", "--json", str(out), f"{script}:train", "6"])
        == 0
    )
    ns: dict = {}
    exec(compile(HEADS, str(script), "exec"), ns)
    ref = ns["reference"](6)
    for losses in json.loads(out.read_text())["results"].values():
        assert max(abs(a - b) for a, b in zip(losses, ref, strict=True)) < 1e-6, (losses, ref)


def test_a_module_in_the_current_folder_and_torchruns_spelling(tmp_path, monkeypatch):
    # found in a user sweep (2026-12-05): `my_train:train` from the file's folder said "No module named",
    # and torchrun's --nproc_per_node was refused
    (tmp_path / "heads_here.py").write_text(HEADS)
    monkeypatch.chdir(tmp_path)
    out = tmp_path / "r.json"
    assert (
        main(["resilience", "elastic", "--nproc_per_node", "2", "--json", str(out), "heads_here:train", "2"])
        == 0
    )
    assert sorted(json.loads(out.read_text())["results"]) == ["0", "1"]


def test_ranks_whose_models_differ_stop_the_job_instead_of_one_surviving(tmp_path, capsys):
    # Found in a sweep (2026-12-05): gloo aborted the ranks on the size mismatch, the launcher took that
    # for deaths, and the one odd rank "survived" alone with exit code 0
    script = tmp_path / "mismatched.py"
    script.write_text(HEADS)
    argv = ["resilience", "elastic", "--nproc-per-node", "3", "--group-timeout", "5", f"{script}:mismatched"]
    assert main(argv) == 1
    assert "the ranks' models have different parameter shapes" in capsys.readouterr().err
