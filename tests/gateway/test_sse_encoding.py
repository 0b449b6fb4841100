"""SSE events stay one line whatever text a token decodes to: JSON keeps U+0085, U+2028 and
U+2029 raw, and line readers built on str.splitlines (httpx's aiter_lines among them) split
there, which cut a streamed event in two (seen once as a JSONDecodeError in the overload test)."""

from __future__ import annotations

import json

import httpx
import pytest

from services.gateway.api.responses import encode_sse

TEXTS = ["a\u2028b", "\u2029", "x\x85y", "line\nbreak\r", "\x0b\x0c\x1c\x1d\x1e", "é 😀 \u00a0"]


@pytest.mark.parametrize("text", TEXTS)
def test_an_event_is_one_line_for_every_line_reader_and_round_trips(text):
    event = encode_sse({"choices": [{"text": text}]}).decode()
    assert event.endswith("\n\n")
    line = event[:-2]
    assert line.splitlines() == [line]
    assert json.loads(line.removeprefix("data: "))["choices"][0]["text"] == text


def test_httpx_reads_the_stream_as_whole_events():
    body = b"".join(encode_sse({"text": t}) for t in TEXTS) + encode_sse("[DONE]")
    transport = httpx.MockTransport(lambda request: httpx.Response(200, content=body))
    with httpx.Client(transport=transport) as client, client.stream("GET", "http://x/") as r:
        lines = [line for line in r.iter_lines() if line]
    assert [json.loads(line[6:])["text"] for line in lines[:-1]] == TEXTS
