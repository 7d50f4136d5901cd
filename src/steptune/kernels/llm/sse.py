"""Incremental, tolerant Server-Sent-Events parser (the WHATWG `text/event-stream` rules).

Contract: `SSEParser.feed(data)` takes bytes in any split (a chunk may end mid-line, mid-UTF-8 character or
mid-JSON) and returns the events completed by that chunk; `flush()` ends the stream and returns an event
left without its terminating blank line. Lines end in `\\n`, `\\r\\n` or `\\r`; a `\\r` at the end of a chunk
is held back until the next byte says whether a `\\n` follows. Lines starting with `:` are comments
(`: keep-alive`); they are counted, never returned. Several `data:` lines join with `\\n`. An event with no
`data:` line is dropped, as the spec says. Undecodable UTF-8 becomes U+FFFD rather than an error: a garbled
byte must not kill a long stream. JSON is parsed only on request (`SSEEvent.json`), and malformed JSON
raises `SSEDecodeError` naming the offending text.
"""

from __future__ import annotations

import codecs
import json
from collections.abc import AsyncIterable, AsyncIterator
from dataclasses import dataclass
from typing import Any

__all__ = ["SSEDecodeError", "SSEEvent", "SSEParser", "aiter_events"]

_MAX_QUOTE = 200


class SSEDecodeError(ValueError):
    """An SSE `data:` field that should hold JSON does not."""


@dataclass(frozen=True, slots=True)
class SSEEvent:
    """One dispatched event."""

    data: str
    """The `data:` lines joined with newlines."""
    event: str | None = None
    """The `event:` field, if any."""
    id: str | None = None
    """The `id:` field, if any."""
    retry: int | None = None
    """The `retry:` field in milliseconds, if any."""

    @property
    def done(self) -> bool:
        """True for the OpenAI end-of-stream sentinel `data: [DONE]`."""
        return self.data.strip() == "[DONE]"

    def json(self) -> Any:
        """The data parsed as JSON; raises `SSEDecodeError` quoting the text when it is not JSON."""
        try:
            return json.loads(self.data)
        except json.JSONDecodeError as err:
            text = self.data if len(self.data) <= _MAX_QUOTE else self.data[:_MAX_QUOTE] + "..."
            raise SSEDecodeError(
                f"malformed JSON in SSE data {text!r} ({err.msg} at char {err.pos}); "
                "the server sent something that is not an OpenAI-style stream chunk"
            ) from None


class SSEParser:
    """Feed bytes, get events. Not thread-safe; one parser per stream."""

    def __init__(self) -> None:
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self._buf = ""
        self._data: list[str] = []
        self._event: str | None = None
        self._id: str | None = None
        self._retry: int | None = None
        self.num_comments = 0
        """Comment lines seen so far (keep-alives)."""

    def feed(self, data: bytes) -> list[SSEEvent]:
        """Consume a chunk; return the events it completes, in order."""
        return self._consume(self._decoder.decode(data), final=False)

    def flush(self) -> list[SSEEvent]:
        """End of stream: dispatch any event still waiting for its blank line."""
        events = self._consume(self._decoder.decode(b"", final=True), final=True)
        if self._buf:
            self._line(self._buf, events)
            self._buf = ""
        self._line("", events)
        return events

    def _consume(self, text: str, *, final: bool) -> list[SSEEvent]:
        buf = self._buf + text
        events: list[SSEEvent] = []
        start = 0
        n = len(buf)
        while start < n:
            cr = buf.find("\r", start)
            lf = buf.find("\n", start)
            if cr < 0 and lf < 0:
                break
            if cr < 0 or (0 <= lf < cr):
                self._line(buf[start:lf], events)
                start = lf + 1
                continue
            # A '\r' ends the line; if it is the last char we cannot yet tell '\r' from '\r\n'.
            if cr == n - 1 and not final:
                break
            self._line(buf[start:cr], events)
            start = cr + 2 if cr + 1 < n and buf[cr + 1] == "\n" else cr + 1
        self._buf = buf[start:]
        return events

    def _line(self, line: str, events: list[SSEEvent]) -> None:
        if not line:
            if self._data:
                events.append(SSEEvent("\n".join(self._data), self._event, self._id, self._retry))
            self._data, self._event, self._retry = [], None, None
            return
        if line.startswith(":"):
            self.num_comments += 1
            return
        name, sep, value = line.partition(":")
        if sep and value.startswith(" "):
            value = value[1:]
        if name == "data":
            self._data.append(value)
        elif name == "event":
            self._event = value
        elif name == "id" and "\0" not in value:
            self._id = value
        elif name == "retry" and value.isdigit():
            self._retry = int(value)
        # Unknown fields are ignored, per the spec.


async def aiter_events(
    chunks: AsyncIterable[bytes], parser: SSEParser | None = None
) -> AsyncIterator[SSEEvent]:
    """Events from an async byte stream, flushing at its end."""
    parser = parser or SSEParser()
    async for chunk in chunks:
        for event in parser.feed(chunk):
            yield event
    for event in parser.flush():
        yield event
