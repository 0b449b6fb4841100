"""OpenAI request bodies as pydantic models. Parsed in strict mode, so a wrong JSON type is a
400 rather than a silent coercion; unknown fields are ignored, as OpenAI does, except the ones
that would change what is generated (unsupported_fields): those are declared and refused."""

from __future__ import annotations

from typing import Annotated, Any, Literal, TypeVar

from pydantic import (
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    JsonValue,
    ValidationError,
    model_validator,
)

from engine.sampling_params import SamplingParams
from services.gateway.api.request_limits import MAX_CACHE_SALT_CHARS, MAX_N
from services.gateway.api.tools import TOOL_CHOICE_SCHEMA, TOOLS_SCHEMA
from services.gateway.api.unsupported_fields import refuse_unsupported
from services.gateway.errors import APIError


class _Body(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)

    @model_validator(mode="before")
    @classmethod
    def _null_is_the_default(cls, data: Any) -> Any:
        """An explicit null for an optional field means its default, as OpenAI's reference
        ("boolean or null") and vLLM read it: typed clients write every field, `"stream":
        null` included. A required field's null is still a 400."""
        if not isinstance(data, dict):
            return data
        fields = cls.model_fields
        return {key: value for key, value in data.items()
                if value is not None or key not in fields or fields[key].is_required()}


def _whole_number(value: Any) -> Any:
    """2.0 is the integer 2 (JavaScript clients and Python callers that compute a budget send
    whole floats, and vLLM takes them); 2.5 stays a float and is refused."""
    return int(value) if isinstance(value, float) and value.is_integer() else value


Int = Annotated[int, BeforeValidator(_whole_number)]


def _logprobs_flag(value: Any) -> Any:
    """Completions' logprobs as chat's flag, which clients switching endpoints send: true is
    1 (vLLM reads it so), false is none (vLLM's 0 would return logprobs to a caller who said
    false)."""
    if value is True:
        return 1
    return None if value is False else _whole_number(value)


class StreamOptions(_Body):
    include_usage: bool = False
    # vLLM's: with include_usage, every chunk carries the usage so far.
    continuous_usage_stats: bool = False


def _doc(**schema) -> dict:
    """Documented ranges: the OpenAPI document says them; preprocess and SamplingParams check
    them (with their own messages), so parsing stays as it was."""
    return Field(default=None, json_schema_extra=schema)


MAX_LOGPROBS_DOC = SamplingParams.MAX_LOGPROBS
_TOKEN_IDS = {"items": {"minimum": 0}}


class _SamplingFields(_Body):
    # As in vLLM: optional, the served model when left out (scripts for a one-model server
    # often leave it out; the OpenAI SDK always sends it).
    model: str | None = None
    max_tokens: Int | None = _doc(minimum=1)
    temperature: float | None = _doc(minimum=0, maximum=2)
    top_p: float | None = _doc(exclusiveMinimum=0, maximum=1)
    top_k: Int | None = _doc(minimum=-1)
    min_p: float | None = _doc(minimum=0, maximum=1)
    seed: Int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = _doc(**_TOKEN_IDS)
    stream: bool = False
    stream_options: StreamOptions | None = None
    presence_penalty: float | None = _doc(minimum=-2, maximum=2)
    frequency_penalty: float | None = _doc(minimum=-2, maximum=2)
    repetition_penalty: float | None = _doc(minimum=SamplingParams.MIN_REPETITION_PENALTY)
    ignore_eos: bool = False
    # splitserve extension: opt this request out of speculative decoding (same output
    # distribution, only the speed changes)
    disable_speculation: bool = False
    n: Int = Field(default=1, json_schema_extra={"minimum": 1, "maximum": MAX_N})
    # Accepted and ignored: they change nothing generated.
    user: str | None = None
    metadata: JsonValue = None
    store: JsonValue = None
    service_tier: JsonValue = None
    # Structured outputs: read and checked by api/structured.py (a 400 names what is wrong).
    response_format: JsonValue = None
    guided_json: JsonValue = None
    guided_regex: JsonValue = None
    guided_choice: JsonValue = None
    guided_grammar: JsonValue = None
    structured_outputs: JsonValue = None
    # Logit processing (engine/sampler.py LogitProcessing), read by preprocess.
    logit_bias: JsonValue = Field(default=None, json_schema_extra={
        "type": "object", "description": "token id (as a string) -> bias added to its logit",
        "additionalProperties": {"type": "number", "minimum": -100, "maximum": 100}})
    allowed_token_ids: JsonValue = Field(default=None, json_schema_extra={
        "type": "array", "minItems": 1, "items": {"type": "integer", "minimum": 0},
        "description": "only these tokens may be generated"})
    min_tokens: JsonValue = Field(default=None, json_schema_extra={
        "type": "integer", "minimum": 0,
        "description": "EOS, stop_token_ids and stop strings do not end the output before "
                       "this many tokens"})
    # vLLM's: a matched stop string stays at the end of the text; special tokens' text kept.
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    # vLLM's: False puts nothing between adjacent added tokens' texts (with special tokens kept).
    spaces_between_special_tokens: bool = True
    # vLLM's: token ids beside the text (the prompt's once, each choice's output).
    return_token_ids: bool = False
    # vLLM's: logprob tokens written as "token_id:N" (a token whose text is not valid UTF-8,
    # or that several ids share, is then still told apart).
    return_tokens_as_token_ids: bool = False
    # vLLM's: a salt of the caller's own for the prefix cache, within its tenant's cache.
    cache_salt: str | None = Field(default=None, json_schema_extra={
        "minLength": 1, "maxLength": MAX_CACHE_SALT_CHARS,
        "description": "only requests with the same salt (and tenant) share cached prompt "
                       "blocks"})
    # vLLM's: each prompt token's logprob, rank and the k likeliest tokens in its place
    # (`prompt_logprobs` beside the choice; a chat's once, beside the choices).
    prompt_logprobs: Int | None = _doc(minimum=0, maximum=MAX_LOGPROBS_DOC)
    # vLLM's: keep only the prompt's last k tokens (-1: as many as the context holds).
    truncate_prompt_tokens: Int | None = _doc(minimum=-1)
    bad_words: JsonValue = Field(default=None, json_schema_extra={
        "type": "array", "items": {"type": "string", "minLength": 1},
        "description": "words the output must not contain (each word's last token is banned "
                       "where the output so far ends with its other tokens)"})
    # Refused unless their value changes nothing (unsupported_fields.REFUSED).
    use_beam_search: JsonValue = None
    length_penalty: JsonValue = None
    logits_processors: JsonValue = None

    @property
    def include_usage(self) -> bool:
        return bool(self.stream and self.stream_options and self.stream_options.include_usage)

    @property
    def continuous_usage(self) -> bool:
        return self.include_usage and self.stream_options.continuous_usage_stats


class CompletionRequest(_SamplingFields):
    prompt: str | list[str] | list[int] | list[list[int]]
    logprobs: Annotated[int | None, BeforeValidator(_logprobs_flag)] = _doc(
        minimum=0, maximum=MAX_LOGPROBS_DOC)
    echo: bool = False
    best_of: JsonValue = None  # refused unless equal to n
    prompt_embeds: JsonValue = None  # refused
    suffix: JsonValue = None  # refused unless empty


class TextPart(_Body):
    type: Literal["text"]
    text: str


class RefusalPart(_Body):
    """An assistant's refusal, as OpenAI's answers carry it and a replayed history sends it
    back: text to the model."""

    type: Literal["refusal"]
    refusal: str

    @property
    def text(self) -> str:
        return self.refusal


class ChatMessage(_Body):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart | RefusalPart] | None = None
    name: str | None = None
    # Checked by api/tools.py: an assistant's calls, and the call a tool message answers.
    tool_calls: JsonValue = None
    tool_call_id: str | None = None
    # Refused unless empty (unsupported_fields.REFUSED_IN_MESSAGES).
    function_call: JsonValue = None
    audio: JsonValue = None

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "\n".join(part.text for part in self.content)


class ChatCompletionRequest(_SamplingFields):
    messages: list[ChatMessage] = Field(json_schema_extra={"minItems": 1})
    max_completion_tokens: Int | None = _doc(minimum=1)
    logprobs: bool = False
    top_logprobs: Int | None = _doc(minimum=0, maximum=MAX_LOGPROBS_DOC)
    parallel_tool_calls: bool | None = None  # false: at most one call per choice
    prediction: JsonValue = None  # accepted: a latency hint, the output is the same
    # Checked by api/tools.py (a 400 names what is wrong).
    tools: JsonValue = Field(default=None, json_schema_extra=TOOLS_SCHEMA)
    tool_choice: JsonValue = Field(default=None, json_schema_extra=TOOL_CHOICE_SCHEMA)
    # vLLM's chat template options: no new assistant turn's header; or the prompt ends inside
    # the last message (an answer begun by the caller; needs add_generation_prompt false).
    add_generation_prompt: bool | None = None  # None: true
    continue_final_message: bool = False
    # vLLM's: more variables for the chat template (e.g. enable_thinking).
    chat_template_kwargs: dict[str, JsonValue] | None = None
    # Refused unless their value changes nothing (unsupported_fields.REFUSED).
    functions: JsonValue = None
    function_call: JsonValue = None
    reasoning_effort: JsonValue = None
    web_search_options: JsonValue = None
    audio: JsonValue = None
    modalities: JsonValue = None
    chat_template: JsonValue = None
    documents: JsonValue = None
    echo: JsonValue = None  # vLLM's chat echo (the last message before the answer): refused


class TokenizeRequest(_Body):
    """vLLM's /tokenize for a prompt."""

    model: str | None = None
    prompt: str
    add_special_tokens: bool = True
    return_token_strs: bool = False
    truncate_prompt_tokens: Int | None = _doc(minimum=-1)


class TokenizeChatRequest(_Body):
    """vLLM's /tokenize for a conversation: the chat template's prompt, as chat completions
    builds it (the same template options)."""

    model: str | None = None
    messages: list[ChatMessage]
    tools: JsonValue = Field(default=None, json_schema_extra=TOOLS_SCHEMA)
    tool_choice: JsonValue = Field(default=None, json_schema_extra=TOOL_CHOICE_SCHEMA)
    parallel_tool_calls: bool | None = None  # changes no prompt: accepted as chat takes it
    add_generation_prompt: bool | None = None
    continue_final_message: bool = False
    chat_template_kwargs: dict[str, JsonValue] | None = None
    add_special_tokens: bool = False
    return_token_strs: bool = False
    truncate_prompt_tokens: Int | None = _doc(minimum=-1)


class DetokenizeRequest(_Body):
    model: str | None = None
    tokens: list[int]


Body = TypeVar("Body", bound=BaseModel)


def parse_body(model: type[Body], body: bytes) -> Body:
    try:
        parsed = model.model_validate_json(body, strict=True)
    except ValidationError as exc:
        raise _as_api_error(exc) from None
    if isinstance(parsed, _SamplingFields):
        refuse_unsupported(parsed, chat=isinstance(parsed, ChatCompletionRequest))
        if parsed.stream_options is not None and not parsed.stream:
            # As OpenAI and vLLM answer it: a client that sends it unstreamed would break there.
            raise APIError.invalid("stream_options can only be set when stream is true.",
                                   param="stream_options")
    return parsed


def _as_api_error(exc: ValidationError) -> APIError:
    errors = exc.errors(include_url=False)
    part = _unsupported_content_part(errors)
    if part is not None:
        return part
    error = errors[0]
    if error["type"] == "json_invalid":
        return APIError.invalid(f"The body is not valid JSON: {error.get('msg')}", code="invalid_json")
    if error["type"] in ("model_type", "model_attributes_type") and not error["loc"]:
        return APIError.invalid("The body must be a JSON object.", code="invalid_json")
    param = _param(error)
    if error["type"] == "missing":
        return APIError.invalid(f"Missing required parameter: '{param}'.", param=param,
                                code="missing_required_parameter")
    detail = error.get("msg", "invalid value")
    return APIError.invalid(f"Invalid value for '{param}': {detail}.", param=param,
                            code="invalid_type")


def _param(error: dict) -> str | None:
    # For unions pydantic reports a path through the member it tried, e.g.
    # ('prompt', 'list[int]', 0) or ('input', 0, 'ResponsesMessage', 'content'); keep the
    # real field names (lower case) and indices.
    loc = [part for part in error["loc"] if isinstance(part, int)
           or ("[" not in part and part not in ("str", "int") and not part[:1].isupper())]
    return ".".join(str(part) for part in loc) or None


def _unsupported_content_part(errors: list[dict]) -> APIError | None:
    """An image, audio or file part in a message: pydantic would report that the content is
    not a string (the union's first member); say instead which part this text-only server
    cannot take."""
    for error in errors:
        loc = error["loc"]
        if (error["type"] == "literal_error" and "content" in loc and loc[-1] == "type"
                and isinstance(error.get("input"), str)):
            param = _param(error)
            return APIError.invalid(
                f"Content parts of type '{error['input']}' are not supported: the served model "
                f"reads text only (at '{param}').",
                param=param, code="unsupported_content_type")
    return None
