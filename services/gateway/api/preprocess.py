"""Turns a validated request body into GenerationSpecs: tokenized prompts, checked limits and
sampling parameters with a seed, before any worker is touched. Every problem is a 400; the
size limits (request_limits) are checked before the prompt is tokenized."""

from __future__ import annotations

import dataclasses
import functools
import secrets
from collections.abc import Sequence

from engine.sampling_params import SamplingParams, StructuredOutput
from services.gateway.api.logit_processing import logit_processing
from services.gateway.api.prompt_length import ModelLimits, text_too_long, truncated
from services.gateway.api.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    TokenizeChatRequest,
    _SamplingFields,
)
from services.gateway.api.request_limits import MAX_CACHE_SALT_CHARS, RequestLimits
from services.gateway.api.structured import StructuredOutputChecker, structured_output_field
from services.gateway.api.tokenizer import ChatTemplateError, ModelTokenizer, TextTooLong
from services.gateway.api.tool_parsers.base import ToolFormat
from services.gateway.api.tools import ToolPlan, template_messages, tool_plan
from services.gateway.errors import APIError
from services.gateway.generation_spec import GenerationSpec

COMPLETIONS_DEFAULT_MAX_TOKENS = 16  # OpenAI's default for /v1/completions
# Seeds are 64-bit: the API takes vLLM's range (a signed 64-bit integer), the workers an
# unsigned one (the proto's uint64); a negative seed maps to its two's complement, so every
# seed of the range keeps a stream of its own (engine/sampling_draw.uniform_for). Until
# December 7 seeds were taken modulo 2^63, with any integer accepted: 2^64 drew seed 0's text.
SEED_MODULUS = 1 << 64
MIN_SEED, MAX_SEED = -(1 << 63), (1 << 63) - 1
# The workers' protobuf carries these as float32: anything larger would arrive as infinity.
FLOAT32_MAX = 3.4028234663852886e38
_FLOAT32_FIELDS = ("temperature", "top_p", "min_p", "repetition_penalty", "presence_penalty",
                   "frequency_penalty")


class Preprocessor:
    """Stateless apart from the read-only tokenizer and limits (and a cache of tool grammars
    that compiled); runs in the gateway's tokenizer threads (Gateway.off_loop), so a huge
    prompt never blocks the event loop."""

    def __init__(self, tokenizer: ModelTokenizer, request_limits: RequestLimits,
                 tool_format: ToolFormat | None = None) -> None:
        self.tokenizer = tokenizer
        self.request_limits = request_limits
        self.tool_format = tool_format  # --tool-call-parser; None: tool calling off
        # Clients send the same tools with every turn: a grammar that compiled once is not
        # compiled again (1-3 ms each). lru_cache is thread-safe; a failure is not cached.
        self._check_tools = functools.lru_cache(maxsize=256)(
            lambda so, vocab_size: self.structured.check(so, vocab_size, param="tools"))
        self.structured = StructuredOutputChecker(tokenizer)

    def tokenize(self, req, limits: ModelLimits) -> dict:
        """vLLM's /tokenize: a prompt's tokens (the chat template's for messages), as the
        generation endpoints would send them (truncation included)."""
        if isinstance(req, TokenizeChatRequest):
            ids, _ = self.chat_prompt(req, limits)
            if req.add_special_tokens:  # off by default: the template writes its own
                ids = [*self.tokenizer.encode("", add_special_tokens=True), *ids]
        else:
            ids = truncated(self.tokenizer.encode(req.prompt,
                                                   add_special_tokens=req.add_special_tokens),
                             req.truncate_prompt_tokens, limits)
        return {"count": len(ids), "max_model_len": limits.max_model_len, "tokens": ids,
                # The vocabulary's own strings ("\u0120world"), as vLLM's convert_ids_to_tokens
                # gives them (they were the tokens' decoded text).
                "token_strs": ([self.tokenizer.backend.id_to_token(t) for t in ids]
                               if req.return_token_strs else None)}

    def detokenize(self, req, limits: ModelLimits) -> dict:
        bad = next((t for t in req.tokens if not 0 <= t < limits.vocab_size), None)
        if bad is not None:
            raise APIError.invalid(f"token id {bad} is outside the vocabulary "
                                   f"[0, {limits.vocab_size})", param="tokens")
        # Special tokens kept, as vLLM's /detokenize does: /tokenize's ids of a rendered chat
        # come back as that chat, markers and all.
        return {"prompt": self.tokenizer.decode(req.tokens, skip_special_tokens=False)}

    def completion(self, request_id: str, req: CompletionRequest, limits: ModelLimits) -> list[GenerationSpec]:
        self.request_limits.check_batch(_num_prompts(req.prompt), req.n)
        self.request_limits.check_stop(_stop_list(req.stop), req.stop_token_ids or ())
        prompts = self._completion_prompts(req.prompt, limits,
                                           truncating=req.truncate_prompt_tokens is not None)
        if req.logprobs is not None and not 0 <= req.logprobs <= SamplingParams.MAX_LOGPROBS:
            raise APIError.invalid(
                f"logprobs must be in [0, {SamplingParams.MAX_LOGPROBS}], got {req.logprobs}",
                param="logprobs")
        specs = []
        for p, prompt_ids in enumerate(prompts):
            prompt_ids = truncated(prompt_ids, req.truncate_prompt_tokens, limits)
            self._check_prompt(prompt_ids, limits)
            max_tokens = req.max_tokens if req.max_tokens is not None else COMPLETIONS_DEFAULT_MAX_TOKENS
            # echo with max_tokens 0 scores the prompt, as vLLM takes it: the worker generates
            # one token (prompt logprobs come with a step), which the answer leaves out.
            score_only = req.echo and max_tokens == 0
            params = self._params(req, 1 if score_only else max_tokens, len(prompt_ids), limits,
                                  logprobs=req.logprobs,
                                  prompt_logprobs=_prompt_logprobs(req))
            # The prompt as it was given, special tokens included (as vLLM echoes it): the
            # logprobs' text_offset count their text. Left out, the offsets ran past the text.
            echo = (self.tokenizer.decode(prompt_ids, skip_special_tokens=False) if req.echo
                    else None)
            specs += [dataclasses.replace(s, score_only=True) if score_only else s
                      for s in self._choices(request_id, p, prompt_ids, params, req, echo)]
        return specs

    def chat_prompt(self, req, limits: ModelLimits) -> tuple[list[int], ToolPlan | None]:
        """The chat request's prompt (the template over its messages and tools, with its
        template options and truncation) and its tool plan. `req`: a ChatCompletionRequest or
        a TokenizeChatRequest (the same fields)."""
        if not req.messages:
            raise APIError.invalid("messages must contain at least one message", param="messages")
        plan = tool_plan(req.tools, req.tool_choice, self.tool_format,
                         parallel=req.parallel_tool_calls is not False)
        native = self.tokenizer.template_renders_tools
        messages = template_messages(req.messages, self.tool_format, plan, native)
        if req.continue_final_message and req.add_generation_prompt is not False:
            raise APIError.invalid("continue_final_message needs add_generation_prompt set to "
                                   "false (the prompt ends inside the last message, not after "
                                   "a new turn's header)", param="continue_final_message")
        if req.continue_final_message and not req.messages[-1].text().strip():
            raise APIError.invalid("continue_final_message needs a last message with text to "
                                   "continue", param="continue_final_message")
        try:
            prompt_ids = self.tokenizer.encode_chat(
                messages, tools=plan.openai_tools() if plan is not None and native else None,
                add_generation_prompt=req.add_generation_prompt is not False,
                continue_final_message=req.continue_final_message,
                template_kwargs=req.chat_template_kwargs,
                max_tokens=(None if req.truncate_prompt_tokens is not None
                            else limits.max_model_len - 1))
        except TextTooLong as exc:
            raise text_too_long(exc, limits, "messages") from None
        except ChatTemplateError as exc:
            param = ("chat_template_kwargs" if "chat_template_kwargs" in str(exc)
                     else "messages")
            raise APIError.invalid(str(exc), param=param) from None
        prompt_ids = truncated(prompt_ids, req.truncate_prompt_tokens, limits)
        return prompt_ids, plan

    def chat(self, request_id: str, req: ChatCompletionRequest, limits: ModelLimits) -> list[GenerationSpec]:
        return self.chat_with_tools(request_id, req, limits)[0]

    def chat_with_tools(self, request_id: str, req: ChatCompletionRequest, limits: ModelLimits,
                        ) -> tuple[list[GenerationSpec], ToolPlan | None]:
        """chat(), and the request's tools for parsing the output (None: no tool calling)."""
        self.request_limits.check_batch(1, req.n)
        self.request_limits.check_stop(_stop_list(req.stop), req.stop_token_ids or ())
        prompt_ids, plan = self.chat_prompt(req, limits)
        self._check_prompt(prompt_ids, limits, param="messages")
        if req.top_logprobs is not None and not req.logprobs:
            raise APIError.invalid("top_logprobs needs logprobs set to true", param="top_logprobs")
        top = req.top_logprobs or 0
        if not 0 <= top <= SamplingParams.MAX_LOGPROBS:
            raise APIError.invalid(f"top_logprobs must be in [0, {SamplingParams.MAX_LOGPROBS}]",
                                   param="top_logprobs")
        max_tokens = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
        if max_tokens is None:
            max_tokens = max(1, limits.max_model_len - len(prompt_ids))
        params = self._params(req, max_tokens, len(prompt_ids), limits,
                              logprobs=top if req.logprobs else None,
                              prompt_logprobs=req.prompt_logprobs)
        if plan is not None:
            params = self._tool_constraint(plan, params, limits)
        return self._choices(request_id, 0, prompt_ids, params, req, None), plan

    def _tool_constraint(self, plan: ToolPlan, params: SamplingParams,
                         limits: ModelLimits) -> SamplingParams:
        """Every tool's schema must compile (a 400 otherwise, whatever tool_choice says);
        required / named choices constrain the output to one well-formed call."""
        any_call = StructuredOutput(grammar=plan.grammar(forced_only=False))
        self._check_tools(any_call, limits.vocab_size)
        if not plan.constrained:
            return params
        if params.structured_output is not None:
            raise APIError.invalid("tool_choice forces a tool call, which a structured output "
                                   "constraint would contradict; send one of them",
                                   param="tool_choice")
        forced = StructuredOutput(grammar=plan.grammar()) if plan.forced else any_call
        self._check_tools(forced, limits.vocab_size)
        return dataclasses.replace(params, structured_output=forced)

    def token_prompt(self, request_id: str, prompt_ids: list[int], params: SamplingParams,
                     stop: Sequence[str], limits: ModelLimits) -> GenerationSpec:
        """The gRPC front door: parameters already typed, prompt already tokenized."""
        self.request_limits.check_stop(stop, params.stop_token_ids)
        self._check_prompt(prompt_ids, limits)
        self._check_length(len(prompt_ids), params.max_tokens, limits)
        params = dataclasses.replace(params, seed=_seed(params.seed, 0),
                                     top_k=_top_k(params.top_k, limits, "sampling.top_k"),
                                     # as HTTP's: a list four times the vocabulary went on
                                     allowed_token_ids=tuple(dict.fromkeys(
                                         params.allowed_token_ids)))
        _validate(params, limits)
        if params.structured_output is not None:
            self.structured.check(params.structured_output, limits.vocab_size,
                                  param="sampling.structured_output")
        return GenerationSpec(request_id, 0, tuple(prompt_ids), params, tuple(stop))

    # -- pieces ---------------------------------------------------------------------------

    def _completion_prompts(self, prompt, limits: ModelLimits,
                            truncating: bool) -> list[list[int]]:
        if isinstance(prompt, str):
            return [self.encode_text(prompt, limits, truncating=truncating)]
        if not prompt:
            raise APIError.invalid("prompt must not be an empty list", param="prompt")
        if all(isinstance(p, int) for p in prompt):
            return [list(prompt)]
        if all(isinstance(p, str) for p in prompt):
            return [self.encode_text(p, limits, truncating=truncating) for p in prompt]
        return [list(p) for p in prompt]

    def encode_text(self, text: str, limits: ModelLimits, param: str = "prompt",
                    truncating: bool = False) -> list[int]:
        """A text prompt's tokens; one too long for the context by its length alone is
        refused before it is encoded (unless truncation keeps its end: that needs it all)."""
        try:
            return self.tokenizer.encode(
                text, max_tokens=None if truncating else limits.max_model_len - 1)
        except TextTooLong as exc:
            raise text_too_long(exc, limits, param) from None

    def _check_prompt(self, prompt_ids: Sequence[int], limits: ModelLimits,
                      param: str = "prompt") -> None:
        if not prompt_ids:
            raise APIError.invalid("the prompt is empty; send at least one token", param=param)
        # The length first: it is O(1), the vocabulary scan is not.
        if len(prompt_ids) >= limits.max_model_len:
            raise APIError.invalid(
                f"This model's maximum context length is {limits.max_model_len} tokens; the "
                f"prompt has {len(prompt_ids)} tokens and at least one must be generated.",
                param=param, code="context_length_exceeded", prompt_tokens=len(prompt_ids))
        bad = next((t for t in prompt_ids if not 0 <= t < limits.vocab_size), None)
        if bad is not None:
            raise APIError.invalid(
                f"prompt token id {bad} is outside the vocabulary [0, {limits.vocab_size})",
                param=param)

    def _check_length(self, num_prompt: int, max_tokens: int, limits: ModelLimits,
                      param: str = "max_tokens") -> None:
        """`param`: the field the limit came from (chat's max_completion_tokens, when set)."""
        if max_tokens < 1:
            raise APIError.invalid(f"{param} must be at least 1, got {max_tokens}",
                                   param=param)
        if num_prompt + max_tokens > limits.max_model_len:
            raise APIError.invalid(
                f"This model's maximum context length is {limits.max_model_len} tokens. However, "
                f"you requested {num_prompt + max_tokens} tokens ({num_prompt} in the prompt, "
                f"{max_tokens} for the completion).",
                param=param, code="context_length_exceeded", prompt_tokens=num_prompt)

    def _params(self, req: _SamplingFields, max_tokens: int, num_prompt: int, limits: ModelLimits,
                logprobs: int | None, prompt_logprobs: int | None) -> SamplingParams:
        self._check_length(num_prompt, max_tokens, limits,
                           "max_completion_tokens" if getattr(req, "max_completion_tokens", None)
                           is not None else "max_tokens")
        top_k = _top_k(req.top_k if req.top_k is not None else 0, limits, "top_k")
        if req.seed is not None and not MIN_SEED <= req.seed <= MAX_SEED:
            raise APIError.invalid(f"seed must be a 64-bit signed integer, in [{MIN_SEED}, "
                                   f"{MAX_SEED}], got {req.seed}", param="seed")
        for name in _FLOAT32_FIELDS:
            value = getattr(req, name)
            if value is not None and abs(value) > FLOAT32_MAX:
                raise APIError.invalid(f"{name} must be at most {FLOAT32_MAX:.6g} in magnitude, "
                                       f"got {value:g}", param=name)
        params = SamplingParams(
            max_tokens=max_tokens,
            temperature=_or(req.temperature, 1.0),
            top_p=_or(req.top_p, 1.0),
            top_k=max(top_k, 0),
            min_p=_or(req.min_p, 0.0),
            seed=req.seed,
            repetition_penalty=_or(req.repetition_penalty, 1.0),
            presence_penalty=_or(req.presence_penalty, 0.0),
            frequency_penalty=_or(req.frequency_penalty, 0.0),
            stop_token_ids=tuple(req.stop_token_ids or ()),
            ignore_eos=req.ignore_eos,
            disable_speculation=req.disable_speculation,
            logprobs=logprobs,
            prompt_logprobs=prompt_logprobs,
            **logit_processing(req, self.tokenizer),
        )
        _validate(params, limits)
        constraint = structured_output_field(req)
        if constraint is not None:
            param, so = constraint
            self.structured.check(so, limits.vocab_size, param=param)
            params = dataclasses.replace(params, structured_output=so)
        return params

    def _choices(self, request_id, prompt_index, prompt_ids, params, req, echo) -> list[GenerationSpec]:
        stop = _stop_list(req.stop)
        base_seed = _seed(req.seed, 0)
        return [
            GenerationSpec(
                request_id=f"{request_id}-{prompt_index * req.n + i}",
                index=prompt_index * req.n + i,
                prompt_token_ids=tuple(prompt_ids),
                # Choice i samples with seed+i: reproducible, and different between choices.
                params=dataclasses.replace(params, seed=(base_seed + i) % SEED_MODULUS),
                stop=tuple(stop),
                echo_text=echo,
                include_stop_str=req.include_stop_str_in_output,
                skip_special_tokens=req.skip_special_tokens,
                spaces_between_special_tokens=req.spaces_between_special_tokens,
                return_token_ids=req.return_token_ids,
                tokens_as_ids=req.return_tokens_as_token_ids,
                return_prompt_logprobs=req.prompt_logprobs is not None,
                client_cache_salt=_client_cache_salt(req.cache_salt),
            )
            for i in range(req.n)
        ]


def _client_cache_salt(salt: str | None) -> str:
    if salt is None:
        return ""
    if not 1 <= len(salt) <= MAX_CACHE_SALT_CHARS:
        raise APIError.invalid(
            f"cache_salt must be a string of 1 to {MAX_CACHE_SALT_CHARS} characters, "
            f"got {len(salt)}", param="cache_salt")
    return salt


def _prompt_logprobs(req) -> int | None:
    """The top logprobs of each prompt token: `prompt_logprobs` when given, else echo's
    `logprobs`, as vLLM takes them (echo's entries for the prompt then follow prompt_logprobs
    too). Computed with the larger of the two, the `prompt_logprobs` field carried echo's
    count: 3 entries a token for `prompt_logprobs: 1, logprobs: 2`, where vLLM gives 1-2."""
    if req.prompt_logprobs is not None:
        return req.prompt_logprobs
    return req.logprobs if req.echo else None


def _num_prompts(prompt) -> int:
    """A string or one token list is one prompt; a list of strings or token lists is many."""
    if isinstance(prompt, str) or not prompt or isinstance(prompt[0], int):
        return 1
    return len(prompt)


def _stop_list(stop: str | list[str] | None) -> list[str]:
    return [stop] if isinstance(stop, str) else list(stop or [])


def _or(value, default):
    return default if value is None else value


def _top_k(top_k: int, limits: ModelLimits, param: str) -> int:
    """-1 and 0 are off; at or over the vocabulary it keeps every token, so off too (and it
    fits the workers' int32)."""
    if top_k < -1:
        raise APIError.invalid(f"top_k must be -1 (off), 0 (off) or positive, got {top_k}",
                               param=param)
    return 0 if top_k >= limits.vocab_size else top_k


def _seed(seed: int | None, offset: int) -> int:
    """The user's seed, or a random one: the gateway always sends a seed, so the prefill
    worker's first token and the decode worker's continuation (or a recompute) agree. -1
    asks for a random one, as in vLLM."""
    if seed is None or seed == -1:
        return secrets.randbits(62)
    return (seed + offset) % SEED_MODULUS


def _validate(params: SamplingParams, limits: ModelLimits) -> None:
    try:
        params.validate(limits.vocab_size)
    except ValueError as exc:
        message = str(exc)
        raise APIError.invalid(message, param=message.split(" ", 1)[0]) from None
    if params.min_tokens > params.max_tokens:
        raise APIError.invalid(f"min_tokens must be at most max_tokens={params.max_tokens}, got "
                               f"{params.min_tokens}", param="min_tokens")
