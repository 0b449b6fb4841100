"""The Responses API's request body (POST /v1/responses) as pydantic models, parsed like
the others (api/protocol.py), and the chat completion request that serves it."""

from __future__ import annotations

from typing import Literal

from pydantic import JsonValue

from services.gateway.api.protocol import ChatCompletionRequest, Int, _Body, _doc
from services.gateway.errors import APIError


class ResponsesText(_Body):
    type: Literal["input_text", "output_text", "text"]
    text: str


class ResponsesMessage(_Body):
    """An input item of the Responses API: a message (earlier outputs echoed back included)."""

    type: Literal["message"] | None = None
    role: Literal["system", "developer", "user", "assistant"]
    content: str | list[ResponsesText]
    id: str | None = None
    status: str | None = None

    def text(self) -> str:
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content)


class ResponsesFunctionCall(_Body):
    """An earlier output echoed back: the model called a function."""

    type: Literal["function_call"]
    call_id: str
    name: str
    arguments: str
    id: str | None = None
    status: str | None = None


class ResponsesFunctionOutput(_Body):
    """The result of a call, for the model to read."""

    type: Literal["function_call_output"]
    call_id: str
    output: str
    id: str | None = None
    status: str | None = None


ResponsesItem = ResponsesMessage | ResponsesFunctionCall | ResponsesFunctionOutput

# Responses API fields whose absence (or these values) change nothing; any other value is
# refused by name (previous_response_id: nothing is stored here to continue from).
_RESPONSES_NO_OPS: dict[str, tuple] = {
    "previous_response_id": (None,), "reasoning": (None,), "include": (None, []),
    "prompt": (None,), "background": (None, False), "conversation": (None,),
    "truncation": (None, "disabled"), "top_logprobs": (None, 0),
}
_TEXT_FORMAT = {"format": {"type": "text"}}  # the default: free text


class ResponsesRequest(_Body):
    """POST /v1/responses: text in, one assistant message out, served as a chat completion
    of `instructions` (a system message) and `input`."""

    model: str
    input: str | list[ResponsesItem]
    instructions: str | None = None
    max_output_tokens: Int | None = _doc(minimum=1)
    temperature: float | None = _doc(minimum=0, maximum=2)
    top_p: float | None = _doc(exclusiveMinimum=0, maximum=1)
    stream: bool = False
    # Accepted and ignored: they change nothing generated.
    user: str | None = None
    metadata: JsonValue = None
    store: JsonValue = None
    service_tier: JsonValue = None
    parallel_tool_calls: bool | None = None  # false: at most one call, as in chat
    tools: JsonValue = None
    tool_choice: JsonValue = None
    previous_response_id: JsonValue = None
    reasoning: JsonValue = None
    include: JsonValue = None
    prompt: JsonValue = None
    background: JsonValue = None
    conversation: JsonValue = None
    truncation: JsonValue = None
    top_logprobs: JsonValue = None
    text: JsonValue = None

    @property
    def include_usage(self) -> bool:
        return False  # the usage is in the response object

    @property
    def n(self) -> int:
        return 1

    def as_chat(self) -> ChatCompletionRequest:
        """The chat completion that serves it; a 400 names a field it cannot honour."""
        for name, no_ops in _RESPONSES_NO_OPS.items():
            value = getattr(self, name)
            if not any(value == v and type(value) is type(v) for v in no_ops):
                raise APIError.invalid(
                    f"Unsupported parameter: '{name}' is not implemented by this server's "
                    "Responses API (text in, one message out); remove it, or use "
                    "/v1/chat/completions.", param=name, code="unsupported_parameter")
        items = ([ResponsesMessage(role="user", content=self.input)]
                 if isinstance(self.input, str) else self.input)
        if not items:
            raise APIError.invalid("input must not be empty", param="input")
        messages: list[dict] = ([{"role": "system", "content": self.instructions}]
                                if self.instructions else [])
        for item in items:
            if isinstance(item, ResponsesMessage):
                messages.append({"role": item.role, "content": item.text()})
                continue
            if isinstance(item, ResponsesFunctionOutput):
                messages.append({"role": "tool", "tool_call_id": item.call_id,
                                 "content": item.output})
                continue
            call = {"id": item.call_id, "type": "function",
                    "function": {"name": item.name, "arguments": item.arguments}}
            if messages and messages[-1]["role"] == "assistant" and "tool_calls" in messages[-1]:
                messages[-1]["tool_calls"].append(call)  # parallel calls: one turn
            else:
                messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
        return ChatCompletionRequest.model_validate({
            "model": self.model, "messages": messages, "stream": self.stream,
            "max_completion_tokens": self.max_output_tokens, "temperature": self.temperature,
            "top_p": self.top_p, "parallel_tool_calls": self.parallel_tool_calls,
            **_chat_tools(self.tools, self.tool_choice), **_chat_response_format(self.text)})

    def echo(self) -> dict:
        return {"instructions": self.instructions, "metadata": self.metadata,
                "max_output_tokens": self.max_output_tokens, "temperature": self.temperature,
                "top_p": self.top_p, "tools": self.tools, "tool_choice": self.tool_choice,
                "parallel_tool_calls": self.parallel_tool_calls,
                "text": self.text if self.text is not None else _TEXT_FORMAT}


def _chat_response_format(text: JsonValue) -> dict:
    """`text.format` (structured output: the OpenAI SDK's `client.responses.parse`) as chat
    completions' response_format, checked and compiled there: json_schema (name, schema,
    strict) or json_object; text is the default."""
    if text is None or text == _TEXT_FORMAT:
        return {}
    fmt = text.get("format") if isinstance(text, dict) else None
    extra = sorted(set(text) - {"format"}) if isinstance(text, dict) else []
    if not isinstance(fmt, dict) or extra:
        raise APIError.invalid(
            "text must be {\"format\": {...}} with format type text, json_object or "
            f"json_schema{'; unsupported: ' + ', '.join(extra) if extra else ''}",
            param="text", code="unsupported_parameter" if extra else None)
    kind = fmt.get("type")
    if kind == "text":
        return {}
    if kind == "json_object":
        return {"response_format": {"type": "json_object"}}
    if kind == "json_schema":
        return {"response_format": {"type": "json_schema", "json_schema": {
            k: fmt[k] for k in ("name", "schema", "strict", "description") if k in fmt}}}
    raise APIError.invalid(f"text.format type {kind!r} is not supported: text, json_object or "
                           "json_schema", param="text.format.type")


def _chat_tools(tools: JsonValue, tool_choice: JsonValue) -> dict:
    """The Responses API's function tools ({"type": "function", "name", ...}) and tool_choice
    in chat completions' shape (checked there, with the same messages)."""
    out: dict = {}
    if tools is not None:
        if not isinstance(tools, list):
            raise APIError.invalid("tools must be a list of function tools", param="tools")
        out["tools"] = []
        for i, tool in enumerate(tools):
            if not isinstance(tool, dict) or tool.get("type") != "function":
                kind = tool.get("type") if isinstance(tool, dict) else None
                raise APIError.invalid(
                    f"Unsupported parameter: tools of type {kind!r} are not implemented by this "
                    "server; function tools are", param=f"tools.{i}", code="unsupported_parameter")
            out["tools"].append({"type": "function", "function": {
                k: v for k, v in tool.items() if k in ("name", "description", "parameters",
                                                       "strict")}})
    if tool_choice is not None:
        if isinstance(tool_choice, dict) and tool_choice.get("type") == "function":
            tool_choice = {"type": "function", "function": {"name": tool_choice.get("name")}}
        out["tool_choice"] = tool_choice
    return out
