"""OpenAI's Responses API body (`POST /v1/responses`): the response object and its typed
stream events, built from the same TextDeltas as chat (api/responses.py's BodyFormat)."""

from __future__ import annotations

import uuid

from services.gateway.api.responses import BodyFormat, ChoiceResult, encode_sse
from services.gateway.api.text_stream import TextDelta
from services.gateway.api.tool_output import tool_message
from services.gateway.api.tools import ToolPlan


class ResponsesFormat(BodyFormat):
    """OpenAI's Responses API (`POST /v1/responses`): one assistant message as the output, and
    streamed as its typed events (response.created ... response.output_text.delta ...
    response.completed), each `event: <type>` with a JSON `data` line and a sequence number;
    no [DONE]. `echo`: the request's settings the response object repeats. With a ToolPlan,
    calls are parsed out of the text into function_call items (api/tool_output); streamed,
    the items then come whole at the end (text and calls from one parse)."""

    object_name = "response"
    id_prefix = "resp"

    def __init__(self, *args, echo: dict | None = None, tools: ToolPlan | None = None,
                 **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.tools = tools
        self.id = f"resp_{uuid.uuid4().hex}"
        self.message_id = f"msg_{uuid.uuid4().hex}"
        self.echo = echo or {}
        self._sequence = 0
        self._text: list[str] = []
        self._finish: str | None = None
        self._error: dict | None = None  # the error event's, when the stream failed

    def _object(self, status: str, output: list[dict], usage_body: dict | None) -> dict:
        return {
            "id": self.id, "object": "response", "created_at": self.created, "status": status,
            "model": self.model, "output": output, "error": self._error,
            "incomplete_details": ({"reason": "max_output_tokens"} if status == "incomplete"
                                   else None),
            "instructions": self.echo.get("instructions"), "metadata": self.echo.get("metadata"),
            "max_output_tokens": self.echo.get("max_output_tokens"),
            "temperature": self.echo.get("temperature"), "top_p": self.echo.get("top_p"),
            "parallel_tool_calls": (self.tools is not None
                                    and self.echo.get("parallel_tool_calls") is not False),
            "tool_choice": self.echo.get("tool_choice") or "auto",
            "tools": self.echo.get("tools") or [],
            "text": self.echo.get("text") or {"format": {"type": "text"}},
            "truncation": "disabled",
            "usage": None if usage_body is None else _responses_usage(usage_body),
        }

    def _message(self, text: str, status: str) -> dict:
        content = [{"type": "output_text", "text": text, "annotations": []}] if status else []
        return {"id": self.message_id, "type": "message", "role": "assistant",
                "status": status or "in_progress", "content": content}

    def _items(self, text: str, status: str) -> list[dict]:
        """The output items of the whole text, the message and any calls: "completed", or
        "incomplete" where the output was cut short (a call's arguments then may not be
        whole JSON; they said "completed" until December 7, a tools audit)."""
        if self.tools is None:
            return [self._message(text, status)]
        message = tool_message(self.tools, text)
        items = ([self._message(message["content"], status)] if message["content"]
                 else [])
        return items + [{"id": f"fc_{uuid.uuid4().hex}", "type": "function_call",
                         "status": status, "call_id": call["id"],
                         "name": call["function"]["name"],
                         "arguments": call["function"]["arguments"]}
                        for call in message.get("tool_calls", ())]

    def response(self, choices: list[ChoiceResult], usage_body: dict) -> dict:
        [choice] = choices
        status = "incomplete" if choice.finish_reason == "length" else "completed"
        return self._object(status, self._items("".join(choice.text), status), usage_body)

    # -- streaming ------------------------------------------------------------------------

    def _event(self, kind: str, **fields) -> dict:
        self._sequence += 1
        return {"type": kind, "sequence_number": self._sequence - 1, **fields}

    def encode(self, event: dict) -> bytes:
        data = encode_sse(event).decode()
        return f"event: {event['type']}\n{data}".encode()

    def opening(self, indexes: list[int], usage: dict | None = None) -> list[bytes]:
        events = [
            self._event("response.created", response=self._object("in_progress", [], None)),
            self._event("response.in_progress", response=self._object("in_progress", [], None))]
        if self.tools is None:
            events += self._message_opening(0)
        return [self.encode(e) for e in events]

    def _message_opening(self, index: int) -> list[dict]:
        part = {"type": "output_text", "text": "", "annotations": []}
        return [self._event("response.output_item.added", output_index=index,
                            item=self._message("", "")),
                self._event("response.content_part.added", item_id=self.message_id,
                            output_index=index, content_index=0, part=part)]

    def _text_delta(self, index: int, text: str) -> dict:
        return self._event("response.output_text.delta", item_id=self.message_id,
                           output_index=index, content_index=0, delta=text, logprobs=[])

    def chunks(self, delta: TextDelta) -> list[dict]:
        self._finish = delta.finish_reason or self._finish
        if not delta.text:
            return []
        self._text.append(delta.text)
        return [self._text_delta(0, delta.text)] if self.tools is None else []

    def error_event(self, error) -> bytes:
        body = error.body()["error"]
        self._error = {"code": body.get("code") or "server_error", "message": body.get("message")}
        return self.encode(self._event("error", code=body.get("code"),
                                       message=body.get("message"), param=body.get("param")))

    def closing(self, usage_body: dict) -> list[bytes]:
        """The items, then response.completed, .incomplete (cut at max_output_tokens) or
        .failed (after an error event: a constraint that could not be met, a worker lost; it
        said "completed" with the partial text until December 7, a tools audit)."""
        status = ("failed" if self._finish == "error" else
                  "incomplete" if self._finish == "length" else "completed")
        items = self._items("".join(self._text), "completed" if status == "completed"
                            else "incomplete")
        events: list[dict] = []
        for index, item in enumerate(items):
            if item["type"] == "message":
                text = item["content"][0]["text"]
                if self.tools is not None:  # not streamed as it came: all of it now
                    events += [*self._message_opening(index), self._text_delta(index, text)]
                events += [
                    self._event("response.output_text.done", item_id=self.message_id,
                                output_index=index, content_index=0, text=text, logprobs=[]),
                    self._event("response.content_part.done", item_id=self.message_id,
                                output_index=index, content_index=0,
                                part=item["content"][0])]
            else:
                events += [
                    self._event("response.output_item.added", output_index=index,
                                item={**item, "status": "in_progress", "arguments": ""}),
                    self._event("response.function_call_arguments.delta", item_id=item["id"],
                                output_index=index, delta=item["arguments"]),
                    self._event("response.function_call_arguments.done", item_id=item["id"],
                                output_index=index, name=item["name"],
                                arguments=item["arguments"])]
            events.append(self._event("response.output_item.done", output_index=index,
                                      item=item))
        events.append(self._event(f"response.{status}",
                                  response=self._object(status, items, usage_body)))
        return [self.encode(e) for e in events]


def _responses_usage(usage_body: dict) -> dict:
    """The chat usage object in the Responses API's names (our `splitserve` extension kept)."""
    return {"input_tokens": usage_body["prompt_tokens"],
            "input_tokens_details": usage_body["prompt_tokens_details"],
            "output_tokens": usage_body["completion_tokens"],
            "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": usage_body["total_tokens"],
            "splitserve": usage_body["splitserve"]}
