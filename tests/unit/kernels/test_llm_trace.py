"""Trace format, synthetic traces, the toy tokenizer, the prefix cache and reply planning."""

import json
import subprocess
import sys

import pytest
from hypothesis import given
from hypothesis import strategies as st

from steptune.kernels.llm import ForkReply, Trace, TraceEvent, load_traces, save_traces, synth_trace
from steptune.kernels.llm._plan import fork_steps, limit_steps, trace_steps
from steptune.kernels.llm._tokens import PrefixCache, SeqBlocks, Vocabulary, render_chat, split_tokens

pytestmark = pytest.mark.timeout(60)

HEAD = "import torch\n\n\nclass ModelNew(torch.nn.Module):\n    def forward(self, x):\n"
DRAFTS = [HEAD + "        return x.relu()\n", HEAD + "        return x.clamp_min(0)\n"]


def test_synth_is_deterministic_and_seed_dependent():
    a = synth_trace(3, reasoning_tokens=800, drafts=DRAFTS)
    assert a == synth_trace(3, reasoning_tokens=800, drafts=DRAFTS)
    assert a.reasoning != synth_trace(4, reasoning_tokens=800, drafts=DRAFTS).reasoning


def test_synth_structure_drafts_cues_and_answer():
    trace = synth_trace(0, reasoning_tokens=1500, decode_tps=50.0, drafts=DRAFTS, ttft_s=0.25)
    r = trace.reasoning
    assert trace.meta["synthetic"] is True
    assert 1500 <= len(split_tokens(r)) < 1500 + 120
    # Complete fenced drafts inside the reasoning, in order, each with a fork reply at its lead-in.
    starts = [r.index(f"```python\n{d}```") for d in DRAFTS]
    assert starts == sorted(starts)
    assert [f.text for f in trace.forks] == [d + "```\n" for d in DRAFTS] + [DRAFTS[-1] + "```\n"]
    assert all(f.at_chars < start for f, start in zip(trace.forks, starts, strict=False))
    assert trace.forks[-1].at_chars == len(r)
    assert any(cue in r for cue in ("\n\nWait,", "\n\nHmm,", "\n\nAlternatively,", "\n\nBut wait,"))
    assert trace.content.startswith("Here is") and f"```python\n{DRAFTS[-1]}```" in trace.content
    # Timing follows the decode rate exactly: the last reasoning token arrives at ttft + (n - 1) / tps.
    times = [e.t for e in trace.events]
    assert times == sorted(times) and times[0] == pytest.approx(0.25 + 3 / 50.0)
    last_reasoning = max(e.t for e in trace.events if e.kind == "reasoning")
    assert last_reasoning == pytest.approx(0.25 + (len(split_tokens(r)) - 1) / 50.0, abs=1e-5)


def test_fork_reply_picks_the_largest_point_not_after_the_prefix():
    trace = synth_trace(1, reasoning_tokens=600, drafts=DRAFTS)
    f0, f1, end = trace.forks
    assert trace.fork_reply(f0.at_chars - 1) is None
    assert trace.fork_reply(f0.at_chars) == f0 and trace.fork_reply(f1.at_chars - 1) == f0
    assert trace.fork_reply(f1.at_chars + 5) == f1 and trace.fork_reply(10**9) == end


def test_round_trip_several_traces_with_append(tmp_path):
    a = synth_trace(0, reasoning_tokens=200, drafts=DRAFTS[:1], problem_id="p0")
    b = Trace(
        "m",
        "p1",
        12,
        33.5,
        (TraceEvent(0.1, "reasoning", "hm", (5, 6)), TraceEvent(0.2, "content", "ok")),
        (ForkReply(1, "x\n```\n"),),
        {"endpoint": "chat", "aborted": False},
    )
    path = save_traces([a], tmp_path / "t.jsonl")
    save_traces([b], path, append=True)
    assert load_traces(path) == [a, b]
    loaded = load_traces(path)[1]
    assert loaded.meta == {"endpoint": "chat", "aborted": False} and loaded.events[0].token_ids == (5, 6)
    header = json.loads(path.read_text().splitlines()[0])
    assert header["kind"] == "header" and header["decode_tps"] == a.decode_tps


def test_load_rejects_bad_lines_with_file_and_line(tmp_path):
    path = tmp_path / "bad.jsonl"
    path.write_text('{"t": 0.1, "kind": "reasoning", "text": "x"}\n')
    with pytest.raises(ValueError, match=r"bad.jsonl:1: .*header"):
        load_traces(path)
    path.write_text('{"kind": "header", "model": "m"}\n{"t": 1, "kind": "thinking", "text": "x"}\n')
    with pytest.raises(ValueError, match=r"bad.jsonl:2: .*thinking"):
        load_traces(path)


@given(st.text(alphabet=st.sampled_from("ab _-\n\t.é1"), max_size=60))
def test_tokens_concatenate_back_and_ids_decode(text):
    vocab = Vocabulary()
    assert "".join(split_tokens(text)) == text
    assert vocab.decode(vocab.encode(text)) == text


def test_vocabulary_rejects_unknown_ids_and_template_ends_in_open_think():
    vocab = Vocabulary()
    vocab.encode("a b")
    with pytest.raises(ValueError, match=r"\[7\] were never issued"):
        vocab.decode([0, 7])
    rendered = render_chat([{"role": "user", "content": "hi"}])
    assert rendered == "<|user|>\nhi\n<|assistant|>\n<think>\n"


def test_prefix_cache_chained_blocks_partial_tail_and_lru():
    cache = PrefixCache(block_size=4, capacity_tokens=12)
    seq = SeqBlocks()
    cache.extend(seq, range(10))  # blocks [0..3], [4..7] cached; the tail 8, 9 is not
    assert len(cache) == 2
    assert cache.lookup(list(range(12))) == 8
    assert cache.lookup(list(range(8))) == 4  # a full hit still recomputes the last token's block
    assert cache.lookup([9, 9, 9, 9, *range(4, 8)]) == 0  # same block after a different parent: miss
    cache.extend(seq, [10, 11])  # the third block fills as the sequence grows
    assert cache.lookup(list(range(13))) == 12
    other = SeqBlocks()
    cache.extend(other, [7] * 8)  # two new blocks evict the two least recently used
    assert len(cache) == 3 and cache.lookup(list(range(13))) == 0
    with pytest.raises(ValueError):
        PrefixCache(block_size=16, capacity_tokens=8)


def test_plan_recuts_on_tokens_hides_think_close_and_applies_limits():
    trace = Trace(
        "m",
        "p",
        1,
        10.0,
        (
            TraceEvent(0.1, "reasoning", "Let me th"),
            TraceEvent(0.2, "reasoning", "ink ok"),
            TraceEvent(0.3, "content", "x = 1 ```\ntail"),
        ),
    )
    vocab = Vocabulary()
    chat = trace_steps(trace, vocab, raw=False)
    assert [(s.t, s.kind, s.text) for s in chat] == [
        (0.1, "reasoning", "Let me"),
        (0.2, "reasoning", " think ok"),  # " th" + "ink" is one token, sent when it ends
        (0.3, "hidden", "\n</think>\n\n"),
        (0.3, "content", "x = 1 ```\ntail"),
    ]
    raw = trace_steps(trace, vocab, raw=True)
    assert "".join(s.text for s in raw) == "Let me think ok\n</think>\n\nx = 1 ```\ntail"
    cut, finish = limit_steps(raw, max_tokens=None, stop=["```"])
    assert "".join(s.text for s in cut).endswith("x = 1 ") and finish == "stop"
    short, finish = limit_steps(chat, max_tokens=3, stop=())
    assert sum(len(s.ids) for s in short) == 3 and finish == "length"
    fork = fork_steps("a b c", 4.0, vocab)
    assert [s.t for s in fork] == [0.25, 0.5, 0.75] and "".join(s.text for s in fork) == "a b c"


def test_importing_the_package_loads_no_http_stack():
    code = (
        "import sys, steptune.kernels, steptune.kernels.llm; "
        "print(sorted(m for m in ('httpx', 'starlette', 'uvicorn', 'openai') if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"
