"""Server-Sent Events as OpenAI-compatible servers send them: `data: {json}` events separated by
blank lines, ending with `data: [DONE]` or (some servers) just with the end of the body."""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterable

DONE = "[DONE]"


class SSEDecoder:
    """Turns lines into event data strings. Multi-line data is joined with newlines; comments
    (`:`) and fields other than `data` are skipped."""

    def __init__(self) -> None:
        self._data: list[str] = []

    def feed(self, line: str) -> str | None:
        """One line without its terminator; returns an event's data when the line ends one."""
        if line.endswith("\r"):
            line = line[:-1]
        if not line:
            return self.flush()
        if line.startswith(":"):
            return None
        field, _, value = line.partition(":")
        if field == "data":
            self._data.append(value[1:] if value.startswith(" ") else value)
        return None

    def flush(self) -> str | None:
        """The pending event, if any (the blank line that ends an event, or the end of input)."""
        if not self._data:
            return None
        data = "\n".join(self._data)
        self._data = []
        return data


def parse_events(lines: Iterable[str]) -> list[str]:
    """All event data in `lines`, stopping at [DONE]."""
    decoder, events = SSEDecoder(), []
    for line in [*lines, ""]:
        data = decoder.feed(line)
        if data == DONE:
            break
        if data is not None:
            events.append(data)
    return events


async def aiter_events(lines: AsyncIterator[str]) -> AsyncIterator[str]:
    """Event data from an async line stream (e.g. httpx `Response.aiter_lines()`), each yielded
    as soon as its event is complete; stops at [DONE] or the end of the stream."""
    decoder = SSEDecoder()
    async for line in lines:
        data = decoder.feed(line)
        if data == DONE:
            return
        if data is not None:
            yield data
    data = decoder.flush()
    if data is not None and data != DONE:
        yield data
