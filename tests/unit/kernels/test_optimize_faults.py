"""`steptune kernels optimize` and `eval` when things go wrong: a broken or non-streaming LLM server,
Ctrl-C or SIGTERM, a budget that ends before profiling, output paths that clash. The server is an
httpx.MockTransport and the evaluation pool a fake, so nothing here starts a process or a socket."""

import asyncio
import json
import shutil
import signal
import threading
from pathlib import Path

import httpx
import pytest

from steptune.cli import main
from steptune.kernels.agent import Delta, EvalOutcome
from steptune.kernels.clock import run
from steptune.kernels.extract import normalized_hash
from steptune.kernels.llm import LLMClient
from steptune.kernels.search import Search, SearchConfig
from steptune.kernels.termination import Budget

pytestmark = pytest.mark.timeout(60)

HONEST = """import torch
from torch import nn


class ModelNew(nn.Module):
    def forward(self, x):
        e = (x - x.amax(dim=-1, keepdim=True)).exp()
        return e / e.sum(dim=-1, keepdim=True)
"""
SOFTMAX = Path(__file__).resolve().parents[3] / "src/steptune/kernels/builtin_problems/softmax.py"


def chunk(**delta):
    return "data: " + json.dumps({"choices": [{"index": 0, "delta": delta}]}) + "\n\n"


def good_reply(n):
    code = HONEST if n == 1 else HONEST.replace("e / e.sum(dim=-1, keepdim=True)", "e * e.sum(-1, True)**-1")
    body = chunk(reasoning_content="thinking. ") + chunk(content="```python\n" + code + "```\n")
    return httpx.Response(200, text=body + "data: [DONE]\n\n", headers={"content-type": "text/event-stream"})


def sse_reply(body):
    return httpx.Response(200, text=body, headers={"content-type": "text/event-stream"})


class FakePool:
    def __init__(self, config):
        self.config = config

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return None


class FakeEval:
    """Every candidate is correct; profiling gives 1.5x, or never ends with `profile=False`."""

    profile = True

    def __init__(self, pool, problem):
        self.num_workers = 2

    def submit(self, cand, kind, priority):
        loop = asyncio.get_running_loop()
        fut = loop.create_future()
        if kind == "validate":
            loop.call_soon(fut.set_result, EvalOutcome("correct", None, "", 0.0))
        elif self.profile:
            loop.call_soon(fut.set_result, EvalOutcome("correct", 1.5, "", 0.0))
        return fut

    def set_roles(self, roles):
        pass

    def busy_seconds(self):
        return 0.0


@pytest.fixture
def fake(monkeypatch, tmp_path):
    """Returns `setup(handler)`: the CLI's optimize against `handler` (chat replies by call number)."""
    import steptune.kernels.llm as llm_pkg

    monkeypatch.setattr("steptune.kernels.optimize.EvalPool", FakePool)
    monkeypatch.setattr("steptune.kernels.real.RealEval", FakeEval)
    monkeypatch.setattr("steptune.kernels.cli._check_server", lambda *a: None)
    monkeypatch.setattr(FakeEval, "profile", True)
    calls = []

    def setup(reply):
        def handler(request):
            calls.append(request.url.path)
            return reply(len(calls))

        def client(base_url, model, *, api_key=None):
            return LLMClient(base_url, model, api_key=api_key, transport=httpx.MockTransport(handler))

        monkeypatch.setattr(llm_pkg, "LLMClient", client)
        return calls

    return setup


def optimize(tmp_path, *extra):
    out, js = tmp_path / "best.py", tmp_path / "opt.json"
    args = ["kernels", "optimize", "--problem", "softmax", "--llm-url", "http://llm.test/v1", "--model", "m"]
    args += ["--policy", "sequential", "--out", str(out), "--json", str(js), *extra]
    return main(args), out, js


@pytest.mark.parametrize(
    "second",
    [
        "data: {not json\n\n",  # malformed JSON (was: exit 2, nothing written)
        "data: " + json.dumps({"choices": "nope"}) + "\n\n",  # wrong shape (was: an AttributeError traceback)
        "data: " + json.dumps({"choices": [{"delta": {"content": 5}}]}) + "\n\n",  # (was: a TypeError)
    ],
)
def test_a_broken_stream_keeps_what_was_found_and_blames_the_server(fake, tmp_path, capsys, second):
    fake(lambda n: good_reply(n) if n == 1 else sse_reply(chunk(reasoning_content="x") + second))
    code, out, js = optimize(tmp_path, "--iterations", "5")
    err = capsys.readouterr().err
    assert code == 1 and "the LLM server failed" in err, err
    assert normalized_hash(out.read_text()) == normalized_hash(HONEST)
    data = json.loads(js.read_text())
    assert data["report"]["stop_reason"].startswith("llm error") and data["report"]["iterations"] == 1
    assert [c["speedup"] for c in data["candidates"]] == [1.5]


@pytest.mark.parametrize(
    ("reply", "says"),
    [
        # a server that ignores "stream": true (was: 2727 iterations in 5 s, 0 tokens, "none correct")
        (lambda n: httpx.Response(200, json={"choices": [{"message": {}}]}), "application/json"),
        (lambda n: httpx.Response(200, text='{"choices": []}'), "no server-sent events"),  # no content type
        (lambda n: sse_reply("data: [DONE]\n\n"), "without any text"),  # an empty stream, every time
    ],
)
def test_a_server_that_does_not_stream_stops_the_search(fake, tmp_path, capsys, reply, says):
    calls = fake(reply)
    code, out, js = optimize(tmp_path, "--iterations", "50")
    err = capsys.readouterr().err
    assert code == 1 and "the LLM server failed" in err and says in err, err
    assert len(calls) == 1 and not out.exists()
    report = json.loads(js.read_text())["report"]
    assert report["stop_reason"].startswith("llm error") and says in report["stop_reason"]


def test_a_validated_candidate_unprofiled_at_the_end_is_kept():
    # Found in a sweep: profiling still running when the wall budget ended dropped the candidate entirely.
    class Gen:
        def __init__(self):
            self.reasoning, self.content, self.tokens, self.aborted, self._sent = "", "", 0, False, False

        def __aiter__(self):
            return self

        async def __anext__(self):
            if self._sent:
                raise StopAsyncIteration
            self._sent = True
            await asyncio.sleep(1.0)
            self.content, self.tokens = "```python\n" + HONEST + "```\n", 10
            return Delta("content", self.content, 10)

        async def aclose(self):
            pass

    class LLM:
        async def reason(self, prompt, sid):
            return Gen()

    class Ev(FakeEval):
        profile = False

    async def go():
        s = Search(LLM(), Ev(None, None), SearchConfig(policy="sequential", budget=Budget(wall_s=30.0)))
        return s, await s.run()

    search, rep = run(go(), virtual=True)
    assert rep.validated == 1 and rep.unprofiled_at_end == 1 and rep.feedback_count == 0
    [fb] = search.feedback
    assert fb.verdict == "correct" and fb.speedup is None and not fb.profiled
    assert fb.reason.startswith("validated; not profiled before the search ended (wall time 30 s spent")


def test_optimize_writes_a_correct_kernel_that_was_not_profiled_in_time(fake, tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(FakeEval, "profile", False)
    fake(good_reply)
    code, out, js = optimize(tmp_path, "--wall", "0.3")
    printed = capsys.readouterr().out
    assert code == 0, printed
    assert "best        a correct kernel without a measured speedup" in printed and "not profiled" in printed
    assert "verdicts    correct 1" in printed and "1 candidates, 0 profiled" in printed
    assert normalized_hash(out.read_text()) == normalized_hash(HONEST)
    [cand] = json.loads(js.read_text())["candidates"]
    assert cand["verdict"] == "correct" and cand["speedup"] is None and "not profiled" in cand["reason"]


def _interrupt(how):
    if how == "SIGINT":
        signal.raise_signal(signal.SIGINT)  # asyncio.run's handler cancels the search's task
    elif how == "SIGTERM":
        signal.raise_signal(signal.SIGTERM)  # steptune's CLI handler raises SystemExit(143)
    else:  # a KeyboardInterrupt out of the event loop itself (no asyncio handler installed)
        asyncio.get_running_loop().call_soon(_raise_keyboard_interrupt)


def _raise_keyboard_interrupt():
    raise KeyboardInterrupt


@pytest.mark.parametrize("how", ["SIGINT", "SIGTERM", "loop"])
def test_an_interrupted_search_writes_what_it_found(fake, tmp_path, capsys, how):
    # Found in a sweep: Ctrl-C during optimize exited 130 with no JSON and no best kernel.
    if how != "loop" and threading.current_thread() is not threading.main_thread():
        pytest.skip("signals reach the main thread only")
    if how == "SIGINT" and signal.getsignal(signal.SIGINT) is not signal.default_int_handler:
        pytest.skip("SIGINT is not Python's default handler here, so asyncio.run installs none")

    def reply(n):
        if n == 2:
            _interrupt(how)
        return good_reply(n)

    fake(reply)
    if how == "SIGTERM":
        with pytest.raises(SystemExit) as info:
            optimize(tmp_path, "--iterations", "5")
        code, out, js = info.value.code, tmp_path / "best.py", tmp_path / "opt.json"
        assert code == 143
    else:
        code, out, js = optimize(tmp_path, "--iterations", "5")
        assert code == 130
    captured = capsys.readouterr()
    want = "SIGTERM" if how == "SIGTERM" else "Ctrl-C"
    assert f"stopped by  interrupted ({want})" in captured.out
    assert normalized_hash(out.read_text()) == normalized_hash(HONEST)
    data = json.loads(js.read_text())
    assert data["report"]["stop_reason"] == f"interrupted ({want})"
    assert [c["speedup"] for c in data["candidates"]] == [1.5]


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
