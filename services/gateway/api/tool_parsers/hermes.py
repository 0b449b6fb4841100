"""The Hermes / Qwen tool-call format: tools listed as JSON inside <tools></tools> in the
system prompt, each call a JSON object {"name", "arguments"} inside <tool_call></tool_call>,
results returned inside <tool_response></tool_response>."""

from __future__ import annotations

import json
import re

from services.gateway.api.tool_parsers.base import ParsedCall, ParsedPiece, embed_parameters

OPEN, CLOSE = "<tool_call>", "</tool_call>"
# The start of a call as the forcing grammar writes it; the arguments follow.
_STREAMED_HEAD = re.compile(r'\s*\{\s*"name"\s*:\s*"([A-Za-z0-9_-]{1,64})"\s*,\s*'
                            r'"arguments"\s*:\s*(?=\S)')
# OpenAI: omitting `parameters` "defines a function with an empty parameter list"; `{}` is
# read the same way (left open, a forced call of `now()` got invented arguments).
_NO_ARGUMENTS = {"type": "object", "properties": {}, "additionalProperties": False}


class HermesFormat:
    name = "hermes"

    def system_prompt(self, tools: list[dict]) -> str:
        listing = "\n".join(json.dumps(tool, ensure_ascii=False) for tool in tools)
        return ("\n\n# Tools\n\nThese functions are available; call one when it helps answer. "
                f"Their signatures, one JSON object per line:\n<tools>\n{listing}\n</tools>\n\n"
                "To call a function, write its name and a JSON object of arguments inside "
                "tool_call tags, one call per block:\n"
                f'{OPEN}\n{{"name": "function-name", "arguments": {{"argument": "value"}}}}\n{CLOSE}')

    def render_calls(self, content: str, calls: list[dict]) -> str:
        blocks = [f"{OPEN}\n{json.dumps(call, ensure_ascii=False)}\n{CLOSE}" for call in calls]
        return "\n".join(([content] if content else []) + blocks)

    def render_results(self, results: list[str]) -> str:
        return "\n".join(f"<tool_response>\n{r}\n</tool_response>" for r in results)

    def grammar(self, tools: list[dict]) -> str:
        """A Lark grammar (llguidance syntax) for one call of one of `tools`."""
        arguments, definitions = embed_parameters(
            [t.get("parameters") or _NO_ARGUMENTS for t in tools])
        calls = [{"type": "object", "additionalProperties": False,
                  "required": ["name", "arguments"],
                  "properties": {"name": {"const": t["name"]}, "arguments": args}}
                 for t, args in zip(tools, arguments, strict=True)]
        schema = calls[0] if len(calls) == 1 else {"anyOf": calls}
        schema = {**schema, "$defs": definitions}
        # json.dumps's separators and no other whitespace: what a parser and a reader expect,
        # and a small model cannot spend its tokens on blank lines. Keywords the grammar engine
        # does not implement (uniqueItems, not, unknown formats: common in MCP tool schemas,
        # which OpenAI's non-strict functions and vLLM take) are left unenforced, not refused.
        schema = {**schema, "x-guidance": {"whitespace_flexible": False, "item_separator": ", ",
                                           "key_separator": ": ", "lenient": True,
                                           "coerce_one_of": True}}
        return (f"start: {json.dumps(OPEN)} \"\\n\" call \"\\n\" {json.dumps(CLOSE)}\n"
                f"call: %json {json.dumps(schema, ensure_ascii=False)}\n")

    def parser(self, tool_names: frozenset[str], stream_calls: bool = False) -> HermesParser:
        return HermesParser(tool_names, stream_calls)


class HermesParser:
    """Content passes through as it comes, except what may be the start of a call tag and
    trailing whitespace (dropped before a call, released before more content). A block that is
    not a JSON call of a known tool passes through as text, tags and all. With `stream_calls`
    a call that starts `{"name": "f", "arguments": ` streams its arguments' text as it comes
    (all but a last `}`, which may close the call, and the whitespace before it)."""

    def __init__(self, tool_names: frozenset[str], stream_calls: bool = False) -> None:
        self.tool_names = tool_names
        self.stream_calls = stream_calls
        self._args_start: int | None = None  # streaming a call: where its arguments begin
        self._args_sent = 0  # characters of them released
        self._held = ""  # text mode: unreleased tail; call mode: the call body so far
        self._in_call = False
        self._gap = ""  # whitespace dropped before the current call (kept if it is not one)
        self.num_calls = 0

    def push(self, text: str) -> list[ParsedPiece]:
        buffer = self._held + text
        out: list[ParsedPiece] = []
        while True:
            if self._in_call:
                end = buffer.find(CLOSE)
                if self.stream_calls:
                    out += self._stream_arguments(buffer if end < 0 else buffer[:end],
                                                  final=end >= 0, closed=True)
                if end < 0:
                    self._held = buffer
                    return out
                if self._args_start is None:
                    out.append(self._end_call(buffer[:end], closed=True))
                else:
                    self._end_streamed_call()
                buffer = buffer[end + len(CLOSE):]
                continue
            start = buffer.find(OPEN)
            if start < 0:
                self._held = buffer[len(buffer) - _held_tail(buffer):]
                released = buffer[:len(buffer) - len(self._held)]
                if released:
                    out.append(ParsedPiece(text=released))
                return out
            before = buffer[:start]
            content = before.rstrip()
            if content:
                out.append(ParsedPiece(text=content))
            self._gap = before[len(content):]
            self._in_call = True
            buffer = buffer[start + len(OPEN):]

    def finish(self) -> list[ParsedPiece]:
        held, self._held = self._held, ""
        if self._in_call and self._args_start is not None:  # cut short (max_tokens, stop)
            out = self._stream_arguments(held, final=True, closed=False)
            self._end_streamed_call()
            return out
        if self.stream_calls and (self._in_call or (held and self.num_calls == 0)):
            # A forced call cut before its arguments began (max_tokens): everything the
            # grammar let out is its markup, not content; it went out as content before.
            self._in_call = False
            return []
        if self._in_call:
            return [self._end_call(held, closed=False)]
        # Whitespace after a call ends nothing; before any call it is content.
        if held and (self.num_calls == 0 or held.strip()):
            return [ParsedPiece(text=held)]
        return []

    def _end_call(self, body: str, closed: bool) -> ParsedPiece:
        self._in_call = False
        self._held = ""
        calls = self._parse_calls(body)
        if not calls:
            return ParsedPiece(text=self._gap + OPEN + body + (CLOSE if closed else ""))
        self.num_calls += len(calls)
        return ParsedPiece(calls=calls)

    def _stream_arguments(self, body: str, final: bool, closed: bool) -> list[ParsedPiece]:
        out: list[ParsedPiece] = []
        if self._args_start is None:
            head = _STREAMED_HEAD.match(body)
            if head is None or head.group(1) not in self.tool_names:
                return out  # not (yet) that shape: parsed whole when it ends
            self._args_start, self._args_sent = head.end(), 0
            out.append(ParsedPiece(call_start=head.group(1)))
        region = body[self._args_start:]
        if final and not closed:
            arguments = _cut_arguments(region)
        else:  # the last "}" may be the one that closes the call
            brace = region.rfind("}")
            arguments = (region[:brace] if brace >= 0 else region).rstrip()
        if len(arguments) > self._args_sent:
            out.append(ParsedPiece(arguments=arguments[self._args_sent:]))
            self._args_sent = len(arguments)
        return out

    def _end_streamed_call(self) -> None:
        self._in_call = False
        self._held = ""
        self._args_start = None
        self.num_calls += 1

    def _parse_calls(self, body: str) -> tuple[ParsedCall, ...]:
        """One call, or a JSON list of them (SmolLM2's own way); all or nothing."""
        try:
            value = json.loads(body)
        except ValueError:
            return ()
        calls = [self._parse_call(v) for v in (value if isinstance(value, list) else [value])]
        return tuple(calls) if calls and None not in calls else ()

    def _parse_call(self, value: object) -> ParsedCall | None:
        if not isinstance(value, dict) or value.get("name") not in self.tool_names:
            return None
        arguments = value.get("arguments", value.get("parameters", {}))
        if isinstance(arguments, str):  # some models write the arguments as a JSON string
            try:
                arguments = json.loads(arguments)
            except ValueError:
                return None
        if not isinstance(arguments, dict):
            return None
        return ParsedCall(value["name"], json.dumps(arguments, ensure_ascii=False))


def _cut_arguments(region: str) -> str:
    """The arguments of a call that ended without its closing tag: their JSON where it is
    whole, else all there is."""
    try:
        _, end = json.JSONDecoder().raw_decode(region)
    except ValueError:
        return region.rstrip()
    return region[:end]


def _held_tail(buffer: str) -> int:
    """Characters at the end of `buffer` that cannot be released yet: a proper prefix of the
    opening tag, and the whitespace before it (or at the very end)."""
    hold = 0
    for k in range(min(len(OPEN) - 1, len(buffer)), 0, -1):
        if buffer.endswith(OPEN[:k]):
            hold = k
            break
    rest = buffer[:len(buffer) - hold]
    return hold + len(rest) - len(rest.rstrip())
