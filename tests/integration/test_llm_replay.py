"""The replay server over real loopback HTTP: the official openai client, our client, forks, aborts, timing,
prefix caching, concurrency and record-then-replay."""

import asyncio
import time

import httpx
import openai
import pytest

from steptune.kernels.llm import (
    FORK_SUFFIX,
    LLMClient,
    LLMHTTPError,
    Trace,
    TraceEvent,
    load_traces,
    serve_replay,
    synth_trace,
)

pytestmark = pytest.mark.timeout(60)

HEAD = "import torch\n\n\nclass ModelNew(torch.nn.Module):\n    def forward(self, x):\n"
DRAFTS = [HEAD + "        return x.relu()\n", HEAD + "        return x.clamp_min(0)\n"]
MESSAGES = [{"role": "user", "content": "Write a faster ReLU."}]


def trace(seed=0, tokens=300, tps=200.0, **kw):
    return synth_trace(seed, reasoning_tokens=tokens, decode_tps=tps, drafts=DRAFTS, ttft_s=0.05, **kw)


def openai_chat(server, model, **kw):
    client = openai.OpenAI(base_url=server.base_url, api_key="x", max_retries=0)
    return client, client.chat.completions.create(model=model, messages=MESSAGES, stream=True, **kw)


@pytest.mark.parametrize("field", ["reasoning_content", "reasoning"])
def test_openai_client_streams_chat_with_reasoning_unchanged(field):
    t = trace()
    with serve_replay([t], speed=20, reasoning_field=field) as server:
        client, stream = openai_chat(server, t.model, stream_options={"include_usage": True})
        reasoning, content, usage = [], [], None
        for chunk in stream:
            usage = chunk.usage or usage
            for choice in chunk.choices:
                reasoning.append((choice.delta.model_extra or {}).get(field) or "")
                content.append(choice.delta.content or "")
        assert "".join(reasoning) == t.reasoning and "".join(content) == t.content
        assert usage.prompt_tokens > 0 and usage.completion_tokens > len(reasoning) // 2
        assert usage.prompt_tokens_details.cached_tokens == 0
        assert [m.id for m in client.models.list()] == [t.model]
        # Non-streaming chat and a raw completion (reasoning inline, as without a reasoning parser).
        reply = client.chat.completions.create(model=t.model, messages=MESSAGES)
        assert reply.choices[0].message.content == t.content
        assert reply.choices[0].message.model_extra[field] == t.reasoning
        raw = client.completions.create(model=t.model, prompt="<|user|>\nq\n<|assistant|>\n<think>\n")
        assert raw.choices[0].text == t.reasoning + "\n</think>\n\n" + t.content
        assert server.wait_idle().completed == 3


def test_fork_from_partial_prefix_gets_the_fork_reply_with_cache_hits():
    t = trace(tokens=600)
    f0, f1, _ = t.forks
    with serve_replay([t], speed=50) as server:

        async def main():
            async with LLMClient(server.base_url, t.model) as client:
                tokens = await client.tokenize(messages=MESSAGES, return_token_strs=True)
                rendered = "".join(tokens.token_strs)
                # Text forks between the two draft points, and before the first one.
                mid = await (await client.fork(rendered + t.reasoning[: f1.at_chars - 3])).collect()
                early = await (await client.fork(rendered + t.reasoning[: f0.at_chars - 3])).collect()
                # A token-id fork from a live stream: prompt ids + reasoning ids so far + suffix ids.
                main_stream = await client.stream_chat(MESSAGES, return_token_ids=True)
                ids = []
                async for chunk in main_stream:
                    ids += chunk.token_ids
                    if len(main_stream.reasoning) > f1.at_chars + 10:
                        break
                by_ids = await (await client.fork(main_stream.prompt_token_ids + ids)).collect()
                await main_stream.aclose()
                return mid, early, by_ids

        mid, early, by_ids = asyncio.run(main())
        assert mid.content == DRAFTS[0] and mid.finish_reason == "stop"  # stop=["```"] cut the fence
        assert early.content == "pass\n"  # before any fork point: the short default
        assert by_ids.content == DRAFTS[1]
        # The id fork reuses the blocks the still-running stream had filled.
        assert by_ids.cached_tokens >= by_ids.prompt_tokens - 2 * 16 - len(FORK_SUFFIX)
        stats = server.wait_idle()
        assert [r.fork for r in stats.records] == [True, True, False, True]
        assert [r.endpoint for r in stats.records] == ["completion", "completion", "chat", "completion"]
        assert stats.cached_tokens == sum(r.cached_tokens for r in stats.records) > 0


def test_closing_a_stream_is_seen_by_the_server_as_aborted():
    t = trace(tokens=2000, tps=100.0)  # 20 s of trace: the test must not wait for it
    with serve_replay([t], speed=1) as server:

        async def main():
            async with LLMClient(server.base_url, t.model) as client:
                stream = await client.stream_chat(MESSAGES)
                async for _ in stream:
                    if len(stream.chunks) == 3:
                        break
                await stream.aclose()
                return stream

        stream = asyncio.run(main())
        assert stream.aborted
        _, ostream = openai_chat(server, t.model)
        next(iter(ostream))
        ostream.close()  # the official client's close() must abort too
        stats = server.wait_idle(timeout_s=10)
        assert (stats.aborted, stats.completed) == (2, 0)
        assert all(r.generated_tokens < 200 and r.end_s - r.start_s < 10 for r in stats.records)


def test_close_cuts_running_streams_without_waiting():
    t = trace(tokens=2000, tps=100.0)
    server = serve_replay([t], speed=1)

    async def main():
        async with LLMClient(server.base_url, t.model) as client:
            stream = await client.stream_chat(MESSAGES)
            with pytest.raises(httpx.RemoteProtocolError):
                async for _ in stream:
                    if len(stream.chunks) == 2:
                        start = time.monotonic()
                        await asyncio.to_thread(server.close)
                        closed_in = time.monotonic() - start
            return closed_in

    assert asyncio.run(main()) < 3.0
    assert server.stats.aborted == 1


def test_speed_factor_scales_wall_time():
    t = trace(tokens=400, tps=200.0)  # ~2.05 s of trace
    elapsed = {}
    for speed in (4.0, 20.0):
        with serve_replay([t], speed=speed) as server:
            start = time.monotonic()
            _, stream = openai_chat(server, t.model)
            for _ in stream:
                pass
            elapsed[speed] = time.monotonic() - start
    for speed, wall in elapsed.items():
        # The server never sends early, so the lower bound is firm; the upper one allows a loaded machine.
        assert t.duration_s / speed <= wall <= t.duration_s / speed + 1.0, (speed, wall)


def test_keepalive_comments_during_long_gaps():
    events = (TraceEvent(0.02, "reasoning", "think"), TraceEvent(0.7, "content", "done"))
    t = Trace("m", "gap", 5, 10.0, events)
    with serve_replay([t], keepalive_s=0.1) as server:

        async def main():
            async with LLMClient(server.base_url, "m") as client:
                return await (await client.stream_chat(MESSAGES)).collect()

        stream = asyncio.run(main())
        assert (stream.reasoning, stream.content) == ("think", "done")
        assert stream.num_keepalives >= 3
        _, ostream = openai_chat(server, "m")
        assert "".join(c.choices[0].delta.content or "" for c in ostream if c.choices) == "done"


def test_prefix_cache_counts_hits_on_a_repeated_prefix():
    t = trace(tokens=100)
    long_prompt = [{"role": "user", "content": "Optimize this. " * 40}]
    with serve_replay([t], speed=50) as server:

        async def main():
            async with LLMClient(server.base_url, t.model) as client:
                first = await (await client.stream_chat(long_prompt)).collect()
                second = await (await client.stream_chat(long_prompt)).collect()
                return first, second

        first, second = asyncio.run(main())
        assert first.cached_tokens == 0 and first.prompt_tokens > 64
        assert second.cached_tokens == (second.prompt_tokens - 1) // 16 * 16
        stats = server.wait_idle()
        assert stats.cached_tokens == second.cached_tokens and stats.prompt_tokens == 2 * first.prompt_tokens


def test_concurrent_streams_overlap_and_stay_separate():
    traces = [trace(seed=s, tokens=200, problem_id=f"p{s}") for s in range(6)]
    speed = 4.0
    with serve_replay(traces, speed=speed) as server:

        async def main():
            async with LLMClient(server.base_url, traces[0].model) as client:

                async def one(t):
                    stream = await client.stream_chat(MESSAGES, metadata={"problem_id": t.problem_id})
                    return await stream.collect()

                start = time.monotonic()
                streams = await asyncio.gather(*(one(t) for t in traces))
                return streams, time.monotonic() - start

        streams, wall = asyncio.run(main())
        for t, stream in zip(traces, streams, strict=True):
            assert (stream.reasoning, stream.content) == (t.reasoning, t.content)
        sequential = sum(t.duration_s for t in traces) / speed
        assert wall < 0.6 * sequential, (wall, sequential)
        assert server.wait_idle().completed == 6


def test_trace_choice_round_robin_problem_id_and_errors():
    a, b = trace(seed=1, problem_id="a"), trace(seed=2, problem_id="b")
    with serve_replay([a, b], speed=100) as server:

        async def main():
            async with LLMClient(server.base_url, a.model) as client:
                got = [(await (await client.stream_chat(MESSAGES)).collect()).content for _ in range(3)]
                pinned = await (await client.stream_chat(MESSAGES, metadata={"problem_id": "b"})).collect()
                with pytest.raises(LLMHTTPError, match=r"HTTP 404 .*problem_id 'zzz'"):
                    await client.stream_chat(MESSAGES, metadata={"problem_id": "zzz"})
                with pytest.raises(LLMHTTPError, match=r"HTTP 400 .*never issued"):
                    await client.stream_completion([10**6])
                return got, pinned

        got, pinned = asyncio.run(main())
        assert got == [a.content, b.content, a.content] and pinned.content == b.content
        oai = openai.OpenAI(base_url=server.base_url, api_key="x", max_retries=0)
        with pytest.raises(openai.BadRequestError, match="messages"):
            oai.chat.completions.create(model=a.model, messages=[])


def test_recorded_trace_replays_identically(tmp_path):
    t = trace(tokens=300, tps=100.0, problem_id="rec")
    path = tmp_path / "rec.jsonl"

    async def run(server, record_to=None):
        async with LLMClient(server.base_url, t.model, record_to=record_to) as client:
            return await (await client.stream_chat(MESSAGES, metadata={"problem_id": "rec"})).collect()

    with serve_replay([t], speed=10) as server:
        original = asyncio.run(run(server, record_to=path))
    (recorded,) = load_traces(path)
    assert recorded.problem_id == "rec" and recorded.meta["completion_tokens"] == original.completion_tokens
    with serve_replay([recorded], speed=1) as server:
        replayed = asyncio.run(run(server))
    assert [(c.kind, c.text) for c in replayed.chunks] == [(c.kind, c.text) for c in original.chunks]
    assert replayed.completion_tokens == original.completion_tokens
    assert replayed.chunks[-1].t == pytest.approx(original.chunks[-1].t, abs=0.5)
