"""SSE parsing and the streaming client against scripted byte streams (httpx.MockTransport, no sockets)."""

import asyncio
import itertools
import json

import httpx
import pytest

from steptune.kernels.llm import LLMClient, LLMHTTPError, LLMStreamError, SSEDecodeError, load_traces
from steptune.kernels.llm._think import ThinkSplitter
from steptune.kernels.llm.sse import SSEEvent, SSEParser

pytestmark = pytest.mark.timeout(60)

BASE = "http://llm.test/v1"


def chat_chunk(reasoning=None, content=None, *, field="reasoning_content", finish=None, ids=None):
    delta = {}
    if reasoning is not None:
        delta[field] = reasoning
    if content is not None:
        delta["content"] = content
    choice = {"index": 0, "delta": delta, "finish_reason": finish}
    if ids is not None:
        choice["token_ids"] = ids
    return {"id": "c1", "object": "chat.completion.chunk", "choices": [choice]}


def sse(*objs, sep="\n"):
    out = ""
    for obj in objs:
        out += obj if isinstance(obj, str) else f"data: {json.dumps(obj, ensure_ascii=False)}{sep}{sep}"
    return out.encode()


USAGE = {
    "choices": [],
    "usage": {
        "prompt_tokens": 11,
        "completion_tokens": 7,
        "total_tokens": 18,
        "prompt_tokens_details": {"cached_tokens": 8},
    },
}

# Both reasoning field names, multi-byte UTF-8, keep-alives, CRLF, a usage chunk and [DONE].
PAYLOAD = sse(
    ": keep-alive\n\n",
    chat_chunk(reasoning="Let me think → ", ids=[1, 2]),
    chat_chunk(reasoning="über 🚀 fast", field="reasoning", ids=[3]),
    ": keep-alive\r\n\r\n",
    chat_chunk(content="```python\nx = 1\n```", ids=[4, 5]),
    chat_chunk(finish="stop"),
    USAGE,
    "data: [DONE]\n\n",
)


def parse_all(chunks):
    parser = SSEParser()
    events = [e for c in chunks for e in parser.feed(c)]
    return events + parser.flush(), parser.num_comments


def test_parser_split_at_every_byte_boundary_gives_the_same_events():
    whole, comments = parse_all([PAYLOAD])
    assert [e.data for e in whole][-1] == "[DONE]" and whole[-1].done
    assert comments == 2
    for k in range(len(PAYLOAD) + 1):
        assert parse_all([PAYLOAD[:k], PAYLOAD[k:]]) == (whole, comments), k
    assert parse_all([PAYLOAD[i : i + 1] for i in range(len(PAYLOAD))]) == (whole, comments)


def test_parser_fields_multiline_data_crlf_and_lone_cr():
    text = b"event: delta\r\nid: 7\r\nretry: 250\r\ndata: a\r\ndata:b\r\n\r\n:c\rdata: x\r\rdata: tail"
    for split in range(len(text) + 1):
        events, comments = parse_all([text[:split], text[split:]])
        assert events == [
            SSEEvent("a\nb", "delta", "7", 250),
            SSEEvent("x", None, "7", None),
            SSEEvent("tail", None, "7", None),  # flushed without its blank line
        ]
        assert comments == 1


def test_parser_drops_events_without_data_and_ignores_unknown_fields():
    events, _ = parse_all([b"event: ping\n\nfoo: bar\ndata\n\n"])
    assert events == [SSEEvent("")]


def test_malformed_json_names_the_offending_text():
    with pytest.raises(SSEDecodeError, match=r"\{\"choices\": \[\}"):
        SSEEvent('{"choices": [}').json()


class ScriptedBody(httpx.AsyncByteStream):
    """Yields the given chunks, optionally then hangs until closed; records aclose()."""

    def __init__(self, chunks, hang=False):
        self.chunks, self.hang, self.closed = chunks, hang, False

    async def __aiter__(self):
        for chunk in self.chunks:
            yield chunk
        if self.hang:
            await asyncio.Event().wait()

    async def aclose(self):
        self.closed = True


def client_for(handler, **kwargs):
    return LLMClient(BASE, "m", transport=httpx.MockTransport(handler), **kwargs)


def bytewise(data):
    return [data[i : i + 1] for i in range(len(data))]


def test_chat_stream_byte_by_byte_both_reasoning_names_and_usage(tmp_path):
    seen = {}

    def handler(request):
        seen["body"] = json.loads(request.content)
        seen["url"] = str(request.url)
        return httpx.Response(200, stream=ScriptedBody(bytewise(PAYLOAD)))

    async def main():
        async with client_for(handler, record_to=tmp_path / "rec.jsonl") as client:
            stream = await client.stream_chat(
                [{"role": "user", "content": "hi"}], metadata={"problem_id": "p"}
            )
            chunks = [c async for c in stream]
            return stream, chunks

    stream, chunks = asyncio.run(main())
    assert seen["url"] == BASE + "/chat/completions"
    assert seen["body"]["stream"] is True and seen["body"]["stream_options"] == {"include_usage": True}
    assert [(c.kind, c.text, c.token_ids) for c in chunks] == [
        ("reasoning", "Let me think → ", (1, 2)),
        ("reasoning", "über 🚀 fast", (3,)),
        ("content", "```python\nx = 1\n```", (4, 5)),
    ]
    assert all(b.t >= a.t >= 0 for a, b in itertools.pairwise(chunks))
    assert stream.reasoning == "Let me think → über 🚀 fast"
    assert (stream.prompt_tokens, stream.completion_tokens, stream.cached_tokens) == (11, 7, 8)
    assert stream.finish_reason == "stop" and stream.finished and not stream.aborted
    assert stream.num_keepalives == 2
    (trace,) = load_traces(tmp_path / "rec.jsonl")
    assert trace.problem_id == "p" and trace.prompt_tokens == 11
    assert trace.reasoning == stream.reasoning and trace.content == stream.content
    assert [e.token_ids for e in trace.events] == [(1, 2), (3,), (4, 5)]


def test_counts_fall_back_without_usage():
    with_ids = sse(
        chat_chunk(content="a", ids=[1, 2, 3]), chat_chunk(content="b", ids=[4]), "data: [DONE]\n\n"
    )
    without = sse(
        chat_chunk(content="a"), chat_chunk(content="b"), chat_chunk(content="c")
    )  # no [DONE] either

    async def run(payload):
        client = client_for(lambda r: httpx.Response(200, content=payload))
        stream = await (await client.stream_chat([{"role": "user", "content": "x"}])).collect()
        await client.aclose()
        return stream

    a, b = asyncio.run(run(with_ids)), asyncio.run(run(without))
    assert (a.completion_tokens, a.prompt_tokens, a.cached_tokens, a.usage) == (4, 0, 0, None)
    assert (b.completion_tokens, b.content, b.finished) == (3, "abc", True)


def test_raw_completion_splits_think_tags_across_chunk_boundaries():
    text_chunks = ["Plan: fuse.\n</th", "ink>\n\nAnswer <thi", "nk>again</think>!", "<th"]
    payload = sse(*[{"choices": [{"index": 0, "text": t}]} for t in text_chunks], "data: [DONE]\n\n")

    async def main():
        client = client_for(lambda r: httpx.Response(200, stream=ScriptedBody(bytewise(payload))))
        stream = await client.stream_completion("<|user|>\nq\n<think>\n", think_tags=True)
        await stream.collect()
        await client.aclose()
        return stream

    stream = asyncio.run(main())
    assert stream.reasoning == "Plan: fuse.\nagain"
    assert stream.content == "\n\nAnswer !<th"  # a dangling partial tag is released at the end
    splitter = ThinkSplitter(in_reasoning=False)
    assert splitter.feed("no tags <b>") == [("content", "no tags <b>")]


def test_early_close_closes_the_response_and_marks_aborted():
    body = ScriptedBody([sse(chat_chunk(reasoning="a")), sse(chat_chunk(reasoning="b"))], hang=True)

    async def main():
        client = client_for(lambda r: httpx.Response(200, stream=body))
        stream = await client.stream_chat([{"role": "user", "content": "x"}])
        got = []
        async for chunk in stream:
            got.append(chunk.text)
            if len(got) == 2:
                break
        await stream.aclose()
        await stream.aclose()  # idempotent
        await client.aclose()
        return stream, got

    stream, got = asyncio.run(main())
    assert got == ["a", "b"] and body.closed
    assert stream.aborted and not stream.finished


def test_malformed_data_in_a_stream_raises_with_the_text():
    payload = sse(chat_chunk(content="ok")) + b'data: {"choices": [{"delta": oops}]}\n\n'

    async def main():
        client = client_for(lambda r: httpx.Response(200, content=payload))
        stream = await client.stream_chat([{"role": "user", "content": "x"}])
        try:
            await stream.collect()
        finally:
            await client.aclose()

    with pytest.raises(SSEDecodeError, match="oops"):
        asyncio.run(main())


def test_http_and_in_stream_errors_carry_the_server_message():
    def handler(request):
        if request.url.path.endswith("/completions") and b"bad" in request.content:
            return httpx.Response(400, json={"error": {"message": "prompt too long", "code": 400}})
        if request.url.path == "/tokenize":
            return httpx.Response(503, text="overloaded")
        return httpx.Response(200, content=sse({"error": {"message": "engine died"}}))

    async def main():
        client = client_for(handler)
        with pytest.raises(LLMHTTPError, match=r"HTTP 400 .*prompt too long") as info:
            await client.stream_completion("bad")
        assert info.value.status_code == 400 and info.value.message == "prompt too long"
        with pytest.raises(LLMHTTPError, match=r"HTTP 503 .*overloaded"):
            await client.tokenize("x")
        stream = await client.stream_completion("fine")
        with pytest.raises(LLMStreamError, match="engine died"):
            await stream.collect()
        await client.aclose()

    asyncio.run(main())


def test_fork_request_shapes_and_suffix_tokenized_once():
    bodies = []

    def handler(request):
        body = json.loads(request.content)
        bodies.append((request.url.path, body))
        if request.url.path == "/tokenize":
            return httpx.Response(200, json={"tokens": [90, 91], "count": 2})
        return httpx.Response(200, content=sse({"choices": [{"text": "x = 1\n"}]}, "data: [DONE]\n\n"))

    async def main():
        async with client_for(handler) as client:
            text = await (await client.fork("prompt<think>\nthought", max_tokens=64)).collect()
            await (await client.fork([1, 2, 3])).collect()
            await (await client.fork([4])).collect()
            return text

    stream = asyncio.run(main())
    assert stream.content == "x = 1\n"
    paths = [p for p, _ in bodies]
    assert paths == ["/v1/completions", "/tokenize", "/v1/completions", "/v1/completions"]
    first = bodies[0][1]
    assert first["prompt"] == "prompt<think>\nthought\n</think>\n\n```python\n"
    assert (first["max_tokens"], first["stop"], first["temperature"], first["stream"]) == (
        64,
        ["```"],
        0.0,
        True,
    )
    assert bodies[1][1]["prompt"] == "\n</think>\n\n```python\n"
    assert bodies[2][1]["prompt"] == [1, 2, 3, 90, 91] and bodies[3][1]["prompt"] == [4, 90, 91]
