"""One chat choice's output with tool calls split out of its text: the `delta`s of a stream
(content, then per call a delta with index, id and name, then fragments of its arguments) and
the whole `message` of a response, both from the same incremental parser, so they agree."""

from __future__ import annotations

import uuid

from services.gateway.api.tool_parsers.base import ParsedCall, ParsedPiece
from services.gateway.api.tools import ToolPlan


def call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def finish_reason(reason: str | None, num_calls: int, plan: ToolPlan,
                  stop_reason: str | int | None = None) -> str | None:
    """A choice that made calls and stopped by itself asks for their results; except a call
    the request named (tool_choice {"function": ...}), which OpenAI and vLLM end with "stop"
    (it was "tool_calls" here until December 7), and a required call that a stop string or
    stop token of the request cut (`stop_reason`), which stays "stop": it said "tool_calls" over
    arguments that were not JSON (a tools audit)."""
    if plan.forced is not None or (stop_reason is not None and plan.constrained):
        return reason  # (under auto a cut call is text, not a call: whole calls ask for results)
    return "tool_calls" if reason == "stop" and num_calls else reason


class ToolCallStream:
    """Owned by the task writing one choice's SSE chunks."""

    def __init__(self, plan: ToolPlan) -> None:
        self._parser = plan.parser()
        self.num_calls = 0

    def deltas(self, text: str, final: bool) -> list[dict]:
        pieces = self._parser.push(text)
        if final:
            pieces += self._parser.finish()
        out: list[dict] = []
        for piece in pieces:
            if piece.text:
                out.append({"content": piece.text})
            for call in piece.calls:
                out += [self._start(call.name), self._arguments(call.arguments)]
            if piece.call_start is not None:
                out.append(self._start(piece.call_start))
            if piece.arguments:
                out.append(self._arguments(piece.arguments))
        return out

    def _start(self, name: str) -> dict:
        self.num_calls += 1
        return {"tool_calls": [{"index": self.num_calls - 1, "id": call_id(), "type": "function",
                                "function": {"name": name, "arguments": ""}}]}

    def _arguments(self, fragment: str) -> dict:
        return {"tool_calls": [{"index": self.num_calls - 1,
                                "function": {"arguments": fragment}}]}


def tool_message(plan: ToolPlan, text: str) -> dict:
    """The assistant message of a whole choice: content (None when there is only calls) and
    tool_calls."""
    parser = plan.parser()
    pieces: list[ParsedPiece] = parser.push(text) + parser.finish()
    content = "".join(p.text for p in pieces)
    calls: list[ParsedCall] = []
    for piece in pieces:
        calls += piece.calls
        if piece.call_start is not None:
            calls.append(ParsedCall(piece.call_start, ""))
        if piece.arguments:
            calls[-1] = ParsedCall(calls[-1].name, calls[-1].arguments + piece.arguments)
    message: dict = {"role": "assistant", "content": content if content or not calls else None}
    if calls:
        message["tool_calls"] = [{"id": call_id(), "type": "function",
                                  "function": {"name": c.name, "arguments": c.arguments}}
                                 for c in calls]
    return message
