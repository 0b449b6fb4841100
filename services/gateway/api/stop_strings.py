"""Stop strings over streamed text: a match may span token boundaries, and no part of a stop
string ever reaches the client (text that could be the start of one is held back)."""

from __future__ import annotations

from collections.abc import Sequence


class StopStringMatcher:
    """Owned by the task streaming one request's output."""

    def __init__(self, stop: Sequence[str], include_stop: bool = False) -> None:
        """`include_stop`: the matched stop string is released too, ending the output."""
        self.stop = tuple(s for s in stop if s)
        self.include_stop = include_stop
        self._held = ""  # text not yet released; never contains a whole stop string
        self.matched: str | None = None  # the stop string that ended the output

    @property
    def stopped(self) -> bool:
        return self.matched is not None

    def push(self, text: str) -> str:
        """Add text; return what may be released now. Sets `stopped` on a match, after which
        the text before the match is the last thing released."""
        if self.stopped:
            return ""
        if not self.stop:
            return text
        buffer = self._held + text
        match = self._earliest_match(buffer)
        if match is not None:
            self.matched = buffer[match[0]:match[1]]
            self._held = ""
            return buffer[:match[1] if self.include_stop else match[0]]
        hold = self._longest_partial_suffix(buffer)
        self._held = buffer[len(buffer) - hold:] if hold else ""
        return buffer[:len(buffer) - hold]

    def pass_through(self, text: str) -> str:
        """Text that no stop string may end (the first `min_tokens` tokens' text): released
        whole, with anything held before it."""
        if self.stopped:
            return ""
        held, self._held = self._held, ""
        return held + text

    def flush(self) -> str:
        """The output ended without a match: release what was held back."""
        held, self._held = self._held, ""
        return "" if self.stopped else held

    def _earliest_match(self, buffer: str) -> tuple[int, int] | None:
        """(start, end) of the stop string that is complete first, as if the text came one
        character at a time (of two complete at once, the longer), so the result does not
        depend on where token boundaries fall. The output ends before it (or after it, with
        include_stop). Released text never ends in a stop string's prefix, so a match starts
        inside buffer."""
        found = [(i + len(s), i) for s in self.stop if (i := buffer.find(s)) >= 0]
        if not found:
            return None
        end, start = min(found)
        return start, end

    def _longest_partial_suffix(self, buffer: str) -> int:
        """Length of the longest suffix of buffer that is a proper prefix of a stop string."""
        best = 0
        for s in self.stop:
            for k in range(min(len(s) - 1, len(buffer)), best, -1):
                if buffer.endswith(s[:k]):
                    best = k
                    break
        return best
