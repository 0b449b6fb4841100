"""What every tool-call format provides: the prompt text that teaches a model the tools (for
chat templates without tool support), the constraint that forces a call, and a streaming
parser that splits model output into content and calls."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol


@dataclass(frozen=True)
class ParsedCall:
    """One call found in the output; `arguments` is a JSON object as a string."""

    name: str
    arguments: str


@dataclass(frozen=True)
class ParsedPiece:
    """What one push released: content text, then the calls completed after it. A call whose
    shape a grammar guarantees (a forced call) is instead streamed as it is generated: a piece
    with `call_start` (its name), then pieces with fragments of its `arguments` JSON text."""

    text: str = ""
    calls: tuple[ParsedCall, ...] = ()
    call_start: str | None = None
    arguments: str = ""


class ToolCallParser(Protocol):
    """Incremental: the result does not depend on how the text is split between pushes.
    Owned by the task streaming one choice."""

    def push(self, text: str) -> list[ParsedPiece]: ...

    def finish(self) -> list[ParsedPiece]: ...


class FirstCallOnly:
    """`parallel_tool_calls: false`: at most one call per choice, as OpenAI promises (agents
    that run one call a turn rely on it). Content passes through; later calls are dropped."""

    def __init__(self, inner: ToolCallParser) -> None:
        self._inner = inner
        self._calls = 0
        self._streaming = False  # the open streamed call is the one kept

    def push(self, text: str) -> list[ParsedPiece]:
        return self._keep(self._inner.push(text))

    def finish(self) -> list[ParsedPiece]:
        return self._keep(self._inner.finish())

    def _keep(self, pieces: list[ParsedPiece]) -> list[ParsedPiece]:
        out = []
        for piece in pieces:
            calls = piece.calls[:max(0, 1 - self._calls)]
            self._calls += len(calls)
            start = piece.call_start
            if start is not None:
                self._streaming = self._calls == 0
                self._calls += 1
                start = start if self._streaming else None
            kept = ParsedPiece(piece.text, calls, start,
                               piece.arguments if self._streaming else "")
            if kept != ParsedPiece():
                out.append(kept)
        return out


class ToolFormat(Protocol):
    """One model family's tool-call markup."""

    name: str

    def system_prompt(self, tools: list[dict]) -> str:
        """Text appended to the system message that describes `tools` (OpenAI tool dicts)."""

    def render_calls(self, content: str, calls: list[dict]) -> str:
        """An assistant turn that made `calls` ({"name", "arguments": parsed JSON})."""

    def render_results(self, results: list[str]) -> str:
        """One user turn carrying consecutive tool results."""

    def grammar(self, tools: list[dict]) -> str:
        """A grammar whose every sentence is exactly one well-formed call of one of `tools`,
        its arguments valid against that tool's parameters schema."""

    def parser(self, tool_names: frozenset[str], stream_calls: bool) -> ToolCallParser:
        """`stream_calls`: the output is constrained to well-formed calls, so their arguments
        may be released as they come (otherwise a call is released once it is complete)."""


def embed_parameters(parameters: list[dict]) -> tuple[list[dict], dict]:
    """Tools' `parameters` schemas placed inside one larger schema (a call's `arguments`):
    each becomes a root definition, `$defs` entry `tool<i>`, its own `$defs` / `definitions`
    hoisted beside it as `tool<i>.<name>`, and every local `$ref` ("#", "#/$defs/X",
    "#/definitions/X", "#/properties/...") rewritten to point there. Left where they were,
    such references pointed at the larger schema's root, and a tool whose parameters use them
    (pydantic's nested models: `openai.pydantic_function_tool`) was refused.
    Returns each tool's `arguments` schema and the definitions to put at the root."""
    arguments: list[dict] = []
    definitions: dict = {}
    for i, schema in enumerate(parameters):
        root = f"tool{i}"
        local = {key: schema.get(key) or {} for key in _DEFINITION_KEYS}
        for defs in local.values():
            for name, sub in defs.items():
                definitions[f"{root}.{name}"] = _rewrite_refs(sub, root)
        definitions[root] = _rewrite_refs(
            {k: v for k, v in schema.items() if k not in _DEFINITION_KEYS}, root)
        arguments.append({"$ref": f"#/$defs/{root}"})
    return arguments, definitions


_DEFINITION_KEYS = ("$defs", "definitions")


def _moved_ref(ref: str, root: str) -> str:
    """A local reference of the schema now at `#/$defs/{root}` (its definitions beside it)."""
    if ref == "#":
        return f"#/$defs/{root}"
    for key in _DEFINITION_KEYS:
        prefix = f"#/{key}/"
        if ref.startswith(prefix):
            name, _, rest = ref[len(prefix):].partition("/")
            return f"#/$defs/{root}.{name}" + (f"/{rest}" if rest else "")
    return f"#/$defs/{root}{ref[1:]}" if ref.startswith("#/") else ref


def _rewrite_refs(node, root: str):
    if isinstance(node, dict):
        return {k: (_moved_ref(v, root) if k == "$ref" and isinstance(v, str)
                    else _rewrite_refs(v, root)) for k, v in node.items()}
    if isinstance(node, list):
        return [_rewrite_refs(v, root) for v in node]
    return node
