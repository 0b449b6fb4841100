"""OpenAI tool calling at the gateway: `tools` and `tool_choice` checked into a ToolPlan (every
problem a 400 naming the field), and a conversation with tool calls and tool results turned into
the messages a chat template renders, natively or in the tool format's markup."""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

from services.gateway.api.structured import closed_objects
from services.gateway.api.tool_parsers.base import FirstCallOnly, ToolCallParser, ToolFormat
from services.gateway.errors import APIError

MAX_TOOLS = 128
_NAME = re.compile(r"^[A-Za-z0-9_-]{1,64}$")
_JSON_TYPES = frozenset({"object", "array", "string", "number", "integer", "boolean", "null"})

# The OpenAPI document's view of the two request fields (tool_plan checks them).
TOOLS_SCHEMA = {"anyOf": [{"type": "null"}, {"type": "array", "maxItems": MAX_TOOLS, "items": {
    "type": "object", "required": ["type", "function"], "properties": {
        "type": {"enum": ["function"]},
        "function": {"type": "object", "required": ["name"], "properties": {
            "name": {"type": "string", "pattern": _NAME.pattern},
            "description": {"type": "string"},
            "parameters": {"type": "object"},
            "strict": {"type": ["boolean", "null"]}}}}}}]}
TOOL_CHOICE_SCHEMA = {"anyOf": [{"type": "null"}, {"enum": ["none", "auto", "required"]}, {
    "type": "object", "required": ["type", "function"], "additionalProperties": False,
    "properties": {"type": {"enum": ["function"]}, "function": {
        "type": "object", "required": ["name"], "additionalProperties": False,
        "properties": {"name": {"type": "string"}}}}}]}


@dataclass(frozen=True)
class FunctionTool:
    name: str
    description: str | None
    parameters: dict | None  # a JSON schema of an object; None: no arguments (OpenAI's reading)
    # OpenAI's strict function: a forced call's arguments hold no keys the schema does not
    # name, as response_format's strict schemas (ignored until December 7: a strict
    # get_weather(city) was called with {"city": "Paris", "temperature": 25}).
    strict: bool = False

    def constrained(self) -> dict:
        """as_dict() as the forcing grammar takes it: a strict function's objects closed."""
        out = self.as_dict()
        if self.strict and self.parameters is not None:
            out["parameters"] = closed_objects(self.parameters)
        return out

    def as_dict(self) -> dict:
        out: dict[str, Any] = {"name": self.name}
        if self.description is not None:
            out["description"] = self.description
        if self.parameters is not None:
            out["parameters"] = self.parameters
        return out


@dataclass(frozen=True)
class ToolPlan:
    """One request's tools, shared read-only by its preprocessing and its response format.
    `choice`: "auto", "required" or "function" (then `forced` names it). `parallel` false:
    at most one call per choice (a forced call is one call anyway)."""

    tools: tuple[FunctionTool, ...]
    choice: str
    format: ToolFormat
    forced: str | None = None
    parallel: bool = True

    @property
    def constrained(self) -> bool:
        return self.choice != "auto"

    @property
    def names(self) -> frozenset[str]:
        return frozenset(t.name for t in self.tools)

    def openai_tools(self) -> list[dict]:
        return [{"type": "function", "function": t.as_dict()} for t in self.tools]

    def grammar(self, forced_only: bool = True) -> str:
        """The constraint of `required` (one call of any tool) or a named choice (of that one;
        of any tool with `forced_only` false)."""
        chosen = [t for t in self.tools if not forced_only or self.forced in (None, t.name)]
        return self.format.grammar([t.constrained() for t in chosen])

    def parser(self) -> ToolCallParser:
        # A forced call is well-formed by construction: its arguments stream as they come.
        parser = self.format.parser(self.names, stream_calls=self.constrained)
        return parser if self.parallel else FirstCallOnly(parser)


def tool_plan(tools: Any, tool_choice: Any, tool_format: ToolFormat | None,
              parallel: bool = True) -> ToolPlan | None:
    """None when the request asks for no tool calling (no tools, or tool_choice "none")."""
    choice, forced = _choice(tool_choice)
    if tools is None or tools == []:
        if choice in ("required", "function"):
            raise APIError.invalid(f"tool_choice {json.dumps(tool_choice)} needs `tools`",
                                   param="tool_choice")
        return None
    parsed = _tools(tools)
    if forced is not None and forced not in {t.name for t in parsed}:
        raise APIError.invalid(f"tool_choice names the function {forced!r}, which is not in "
                               "`tools`", param="tool_choice")
    if choice == "none":
        return None
    if tool_format is None:
        raise APIError.invalid("tool calling is off on this gateway (--tool-call-parser none)",
                               param="tools", code="unsupported_parameter")
    return ToolPlan(parsed, choice if choice != "default" else "auto", tool_format, forced,
                    parallel)


def template_messages(messages: list, tool_format: ToolFormat | None,
                      plan: ToolPlan | None, native: bool) -> list[dict]:
    """The conversation as chat-template messages. `native`: the template renders `tools`,
    `tool_calls` and tool messages itself; otherwise the tool format's markup carries them
    inside plain system / user / assistant turns (consecutive tool results: one user turn)."""
    out: list[dict] = []
    results: list[str] = []

    def flush_results() -> None:
        if results:
            out.append({"role": "user", "content": tool_format.render_results(results)})
            results.clear()

    for i, m in enumerate(messages):
        role = "system" if m.role == "developer" else m.role
        calls = _message_calls(m, i)
        _check_tool_call_id(m, i)
        if native:
            entry: dict[str, Any] = {"role": role, "content": m.text()}
            if calls:
                entry["tool_calls"] = [{"id": c["id"], "type": "function", "function": {
                    "name": c["name"], "arguments": c["arguments"]}} for c in calls]
            if role == "tool":
                entry["tool_call_id"] = m.tool_call_id
            out.append(entry)
            continue
        if tool_format is None and (calls or role == "tool"):
            raise APIError.invalid("tool calls in the conversation need a tool-call format; "
                                   "this gateway runs with --tool-call-parser none",
                                   param=f"messages.{i}")
        if role == "tool":
            results.append(m.text())
            continue
        flush_results()
        content = m.text()
        if calls:
            content = tool_format.render_calls(content, [
                {"name": c["name"], "arguments": c["arguments"]} for c in calls])
        out.append({"role": role, "content": content})
    flush_results()
    if plan is not None and not native:
        prompt = plan.format.system_prompt(plan.openai_tools())
        if out and out[0]["role"] == "system":
            out[0] = {**out[0], "content": out[0]["content"] + prompt}
        else:
            out.insert(0, {"role": "system", "content": prompt.lstrip()})
    return out


def _check_tool_call_id(message: Any, i: int) -> None:
    if message.role == "tool":
        if not isinstance(message.tool_call_id, str) or not message.tool_call_id:
            raise APIError.invalid("a tool message needs the tool_call_id it answers",
                                   param=f"messages.{i}.tool_call_id")
    elif message.tool_call_id is not None:
        raise APIError.invalid("only tool messages carry tool_call_id",
                               param=f"messages.{i}.tool_call_id")


def _choice(value: Any) -> tuple[str, str | None]:
    if value is None:
        return "default", None
    if value in ("none", "auto", "required") and isinstance(value, str):
        return value, None
    if isinstance(value, dict) and value.get("type") == "function" and set(value) <= {
            "type", "function"}:
        function = value.get("function")
        if isinstance(function, dict) and set(function) == {"name"} and isinstance(
                function["name"], str):
            return "function", function["name"]
    raise APIError.invalid('tool_choice must be "none", "auto", "required" or {"type": '
                           '"function", "function": {"name": ...}}', param="tool_choice")


def _tools(tools: Any) -> tuple[FunctionTool, ...]:
    if not isinstance(tools, list):
        raise APIError.invalid("tools must be a list of {\"type\": \"function\", \"function\": "
                               "{...}}", param="tools")
    if len(tools) > MAX_TOOLS:
        raise APIError.invalid(f"at most {MAX_TOOLS} tools, got {len(tools)}", param="tools")
    parsed: list[FunctionTool] = []
    for i, tool in enumerate(tools):
        param = f"tools.{i}"
        if not isinstance(tool, dict) or tool.get("type") != "function" or not isinstance(
                tool.get("function"), dict):
            raise APIError.invalid('a tool must be {"type": "function", "function": {...}}',
                                   param=param)
        function = tool["function"]
        name = function.get("name")
        if not isinstance(name, str) or not _NAME.match(name):
            raise APIError.invalid("a function name is 1 to 64 letters, digits, _ or -",
                                   param=f"{param}.function.name")
        if name in {t.name for t in parsed}:
            raise APIError.invalid(f"two tools are named {name!r}", param=f"{param}.function.name")
        description = function.get("description")
        if description is not None and not isinstance(description, str):
            raise APIError.invalid("a function description is a string",
                                   param=f"{param}.function.description")
        if function.get("strict") is not None and not isinstance(function["strict"], bool):
            raise APIError.invalid("strict is true or false", param=f"{param}.function.strict")
        parameters = function.get("parameters")
        if parameters is not None:
            _check_parameters(parameters, f"{param}.function.parameters")
        parsed.append(FunctionTool(name, description, parameters,
                                   strict=function.get("strict") is True))
    return tuple(parsed)


def _check_parameters(schema: Any, param: str) -> None:
    """The shape OpenAI asks of `parameters`: a JSON schema of an object. Whether a constraint
    engine can compile it is checked where one is needed (required / named choices)."""
    if not isinstance(schema, dict):
        raise APIError.invalid("function parameters must be a JSON schema (an object)",
                               param=param)
    kind = schema.get("type", "object")
    if kind != "object":
        raise APIError.invalid(f'function parameters must be a schema of "type": "object", '
                               f"got {json.dumps(kind)}", param=param)
    properties = schema.get("properties", {})
    if not isinstance(properties, dict) or not all(isinstance(p, dict | bool)
                                                    for p in properties.values()):
        raise APIError.invalid("properties must map each argument name to a schema",
                               param=f"{param}.properties")
    for name, prop in properties.items():
        types = prop.get("type") if isinstance(prop, dict) else None
        types = [types] if isinstance(types, str) else types
        if types is not None and (not isinstance(types, list)
                                  or not all(t in _JSON_TYPES for t in types)):
            raise APIError.invalid(f"argument {name!r} has an unknown type "
                                   f"{json.dumps(prop.get('type'))}",
                                   param=f"{param}.properties.{name}.type")
    required = schema.get("required", [])
    if not isinstance(required, list) or not all(isinstance(r, str) for r in required):
        raise APIError.invalid("required must be a list of argument names",
                               param=f"{param}.required")


def _message_calls(message: Any, i: int) -> list[dict]:
    """An assistant message's tool_calls as {"id", "name", "arguments": parsed object}."""
    raw = message.tool_calls
    if raw is None or raw == []:
        return []
    param = f"messages.{i}.tool_calls"
    if message.role != "assistant":
        raise APIError.invalid("only assistant messages carry tool_calls", param=param)
    if not isinstance(raw, list):
        raise APIError.invalid("tool_calls must be a list", param=param)
    calls = []
    for j, call in enumerate(raw):
        where = f"{param}.{j}"
        function = call.get("function") if isinstance(call, dict) else None
        if (not isinstance(function, dict) or call.get("type", "function") != "function"
                or not isinstance(call.get("id"), str) or not isinstance(function.get("name"), str)
                or not isinstance(function.get("arguments"), str)):
            raise APIError.invalid('a tool call is {"id": str, "type": "function", "function": '
                                   '{"name": str, "arguments": str}}', param=where)
        try:
            arguments = json.loads(function["arguments"])
        except ValueError:
            arguments = None
        if not isinstance(arguments, dict):
            raise APIError.invalid("function.arguments must be a JSON object as a string",
                                   param=f"{where}.function.arguments")
        calls.append({"id": call["id"], "name": function["name"], "arguments": arguments})
    return calls
