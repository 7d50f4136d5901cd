"""The search loop in real mode: one policy object drives both lanes; the cpu lane (replay server + real
pool) gives SpecGen more profiling feedback per minute than Sequential and its early stop aborts the main
stream on the server; `steptune kernels optimize` finds the fastest embedded correct candidate."""

import contextlib
import json
import random
from pathlib import Path

import pytest

from steptune.cli import main
from steptune.kernels.clock import run
from steptune.kernels.extract import normalized_hash
from steptune.kernels.kvtier import SimTier
from steptune.kernels.lanes import _real_search, cpu_traces
from steptune.kernels.llm import serve_replay, synth_trace
from steptune.kernels.pool import EvalPool, PoolConfig
from steptune.kernels.problems import load_problem
from steptune.kernels.search import Search, SearchConfig
from steptune.kernels.sim import SimEval, SimLLM
from steptune.kernels.termination import Budget, TerminationConfig

pytestmark = [pytest.mark.timeout(300), pytest.mark.slow]

EXAMPLES = Path(__file__).resolve().parents[2] / "src/steptune/kernels/examples"


def test_one_policy_object_drives_both_lanes():
    config = SearchConfig(
        policy="specgen",
        budget=Budget(iterations=3, wall_s=7200.0),
        termination=TerminationConfig(target_speedup=None, improvement=0.05),
    )
    sim = run(
        Search(SimLLM(random.Random(5), SimTier(0)), SimEval(2, random.Random(6)), config).run(), virtual=True
    )
    problem = load_problem("softmax")
    with serve_replay(cpu_traces(count=4), speed=40.0) as server, EvalPool(PoolConfig(num_workers=2)) as pool:
        real = run(_real_search(config, server.base_url, "synth-reasoner", problem, pool), virtual=False)
    for rep in (sim, real):
        assert rep.policy == "specgen" and rep.iterations == 3 and rep.stop_reason == "iterations"
        assert rep.validated >= 2 and rep.tokens["fork"] > 0


def test_cpu_lane_more_feedback_and_early_stop_aborts_main_stream(cpu_lane_report):
    rep = cpu_lane_report  # run_cpu_lane(wall_s=15.0), with one rerun if SpecGen stopped early nowhere
    assert rep["lane"] == "cpu" and rep["wall_s"] == 15.0
    spec, seq = rep["policies"]["specgen"], rep["policies"]["sequential"]
    assert spec["feedback_per_min"] > seq["feedback_per_min"]
    assert spec["early_stops"] >= 1
    assert spec["server"]["aborted_main"] >= spec["early_stops"]  # the server saw the main stream closed


def test_optimize_finds_the_fastest_embedded_candidate(tmp_path, capsys):
    src = {n: (EXAMPLES / "softmax" / f"{n}.py").read_text() for n in ("c_slow", "torch_alt", "c_fast")}
    wrong = (EXAMPLES / "adversarial" / "wrong_values.py").read_text()
    traces = [
        synth_trace(1, reasoning_tokens=3000, decode_tps=40, drafts=[src["c_slow"], wrong],
                    final_code=src["torch_alt"], problem_id="softmax", ttft_s=0.1),
        synth_trace(2, reasoning_tokens=3000, decode_tps=40, drafts=[src["torch_alt"], src["c_fast"]],
                    final_code=src["c_slow"], problem_id="softmax", ttft_s=0.1),
    ]  # fmt: skip
    out, js = tmp_path / "best.py", tmp_path / "opt.json"
    with serve_replay(traces, speed=40.0) as server:
        args = ["--model", traces[0].model, "--iterations", "2", "--out", str(out), "--json", str(js)]
        code = main(["kernels", "optimize", "--problem", "softmax", "--llm-url", server.base_url, *args])
    text = capsys.readouterr().out
    assert code == 0, text
    assert "best " in text and "wrote:" in text
    assert normalized_hash(out.read_text()) == normalized_hash(src["c_fast"])
    data = json.loads(js.read_text())
    verdicts = {c["verdict"] for c in data["candidates"]}
    assert "incorrect" in verdicts and "correct" in verdicts
    assert data["candidates"][0]["speedup"] > 1.0


def _flaky_server(code: str, *, fail_after: int = 1, tokenize: bool = True, seen: list | None = None):  # type: ignore[no-untyped-def]
    """An OpenAI-compatible server: its first ``fail_after`` chat answers carry ``code``, later ones are HTTP
    500; without ``tokenize`` it answers 404 to ``/tokenize`` (a server that is not vLLM). ``seen`` collects
    the paths posted."""
    import threading
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    chats = []

    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, *args) -> None:  # type: ignore[no-untyped-def]
            pass

        def _send(self, status: int, body: str, ctype: str = "application/json") -> None:
            data = body.encode()
            self.send_response(status)
            self.send_header("Content-Type", ctype)
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def do_GET(self) -> None:
            self._send(200, json.dumps({"object": "list", "data": [{"id": "m"}]}))

        def do_POST(self) -> None:
            self.rfile.read(int(self.headers.get("Content-Length", 0)))
            if seen is not None:
                seen.append(self.path)
            if self.path == "/tokenize" and not tokenize:
                return self._send(404, json.dumps({"detail": "Not Found"}))
            if self.path == "/tokenize":
                return self._send(
                    200, json.dumps({"tokens": [1, 2], "token_strs": ["<|user|>", "hi"], "count": 2})
                )
            chats.append(self.path)
            if len(chats) > fail_after:
                return self._send(500, json.dumps({"error": {"message": "engine dead"}}))
            chunks = [{"choices": [{"index": 0, "delta": {"content": "```python\n" + code + "```\n"}}]},
                      {"choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}]}]  # fmt: skip
            stream = "".join(f"data: {json.dumps(c)}\n\n" for c in chunks) + "data: [DONE]\n\n"
            return self._send(200, stream, "text/event-stream")

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server


def test_optimize_keeps_what_it_found_when_the_llm_server_fails(tmp_path, capsys):
    # Found in review: one HTTP 500 after a good kernel ended the run in a traceback, writing nothing.
    fast = (EXAMPLES / "softmax" / "c_fast.py").read_text()
    server = _flaky_server(fast)
    try:
        url = f"http://127.0.0.1:{server.server_address[1]}/v1"
        out, js = tmp_path / "best.py", tmp_path / "opt.json"
        args = ["--iterations", "3", "--policy", "sequential", "--out", str(out), "--json", str(js)]
        code = main(["kernels", "optimize", "--problem", "softmax", "--llm-url", url, "--model", "m", *args])
    finally:
        server.shutdown()
    captured = capsys.readouterr()
    assert code == 1 and "the LLM server failed" in captured.err and "HTTP 500" in captured.err
    assert normalized_hash(out.read_text()) == normalized_hash(fast)
    report = json.loads(js.read_text())["report"]
    assert report["stop_reason"].startswith("llm error") and report["best_speedup"] > 0


@pytest.mark.parametrize("policy", ["specgen", "sequential"])
def test_optimize_runs_on_a_server_without_tokenize(tmp_path, capsys, policy):
    # Found in review: every policy tokenized each prompt through vLLM's /tokenize, so on any other
    # OpenAI-compatible server the first iteration ended the run ("llm error: HTTP 404").
    fast = (EXAMPLES / "softmax" / "c_fast.py").read_text()
    seen: list[str] = []
    server = _flaky_server(fast, fail_after=10, tokenize=False, seen=seen)
    try:
        url = f"http://127.0.0.1:{server.server_address[1]}/v1"
        out, js = tmp_path / "best.py", tmp_path / "opt.json"
        args = ["--iterations", "2", "--policy", policy, "--out", str(out), "--json", str(js)]
        warns = policy == "specgen"
        with (
            pytest.warns(RuntimeWarning, match="no vLLM-style /tokenize")
            if warns
            else contextlib.nullcontext()
        ):
            code = main(
                ["kernels", "optimize", "--problem", "softmax", "--llm-url", url, "--model", "m", *args]
            )
    finally:
        server.shutdown()
    captured = capsys.readouterr()
    assert code == 0, captured.err
    report = json.loads(js.read_text())["report"]
    assert report["stop_reason"] == "iterations" and report["iterations"] == 2 and report["best_speedup"] > 0
    assert report["tokens"]["fork"] == report["tokens"]["probe"] == 0
    assert normalized_hash(out.read_text()) == normalized_hash(fast)
    if policy == "specgen":  # tried once, said once, then no more /tokenize calls
        assert seen.count("/tokenize") == 1 and "no vLLM-style /tokenize" in report["notes"][0]
        assert "note        the server has no vLLM-style /tokenize" in captured.out
    else:  # a policy that never forks does not need it
        assert "/tokenize" not in seen and report["notes"] == []
