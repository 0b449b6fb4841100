"""One choice's output as text: worker tokens through the incremental detokenizer and the
stop-string matcher. A stop-string match ends the stream and cancels the worker request."""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from contextlib import aclosing
from dataclasses import dataclass

from engine.outputs import ComputeSeconds, Logprobs
from services.gateway.api.detokenizer import IncrementalDetokenizer
from services.gateway.api.stop_strings import StopStringMatcher
from services.gateway.api.tokenizer import ModelTokenizer
from services.gateway.generation_spec import GenerationSpec
from services.gateway.routing.dispatcher import Dispatcher


@dataclass(frozen=True)
class TextDelta:
    """What one step adds to a choice. `text` may be empty (held back) while tokens advance."""

    index: int
    text: str
    token_ids: tuple[int, ...]
    logprobs: tuple[Logprobs, ...]
    num_output_tokens: int  # so far, this delta included
    finish_reason: str | None = None
    error: str | None = None
    # With finish_reason "error": OpenAI-style code of what ended it (None: a worker failed).
    error_code: str | None = None
    prompt_logprobs: tuple[Logprobs | None, ...] | None = None
    # vLLM's stop_reason, with finish_reason "stop": the stop string or stop token id that
    # ended the output; None for EOS (and for every other finish).
    stop_reason: str | int | None = None
    num_cached_tokens: int = 0
    # Engine time charged to this choice so far, all its workers and attempts together.
    compute: ComputeSeconds = ComputeSeconds()


async def stream_text(
    spec: GenerationSpec, dispatcher: Dispatcher, tokenizer: ModelTokenizer,
    incomplete: Callable[[list[int]], str | None] | None = None,
) -> AsyncIterator[TextDelta]:
    """Raises APIError if the request fails before its first token (nothing was sent).
    `incomplete`: for a constrained request, why its output tokens (ended at EOS) do not
    complete the constraint (StructuredOutputChecker.incomplete); such an end is an error,
    not a stop."""
    detokenizer = IncrementalDetokenizer(tokenizer, spec.prompt_token_ids,
                                         skip_special_tokens=spec.skip_special_tokens,
                                         spaces_between_special_tokens=(
                                             spec.spaces_between_special_tokens))
    matcher = StopStringMatcher(spec.stop, include_stop=spec.include_stop_str)
    events = dispatcher.generate(spec.request_id, list(spec.prompt_token_ids), spec.sampling_pb(),
                                 cache_salt=spec.cache_salt)
    if spec.score_only:
        async with aclosing(events):
            async for delta in _scored(spec, events):
                yield delta
        return
    num_output = 0
    min_tokens = spec.params.min_tokens  # stop strings end nothing before this many tokens
    num_cached = 0
    compute = ComputeSeconds()
    outputs: list[int] = []  # kept only to judge a constrained output's end
    try:
        async for event in events:
            if incomplete is not None:
                outputs += event.token_ids
            num_cached = max(num_cached, event.num_cached_tokens)
            if event.compute is not None:
                compute = compute + event.compute
            text: list[str] = []
            taken = 0
            # The token that stopped the output (EOS, a stop_token_id) keeps its text out of
            # it, as vLLM does, unless the request asks for its stop in the output.
            last_stops = event.finish_reason == "stop" and not spec.include_stop_str
            for k, token_id in enumerate(event.token_ids):
                taken += 1
                if last_stops and k == len(event.token_ids) - 1:
                    break
                piece = detokenizer.push(token_id)
                text.append(matcher.pass_through(piece) if num_output + taken <= min_tokens
                            else matcher.push(piece))
                if matcher.stopped:
                    break
            num_output += taken
            finish = "stop" if matcher.stopped else event.finish_reason
            if finish is not None and not matcher.stopped:
                text.append(matcher.push(detokenizer.flush()))
                finish = "stop" if matcher.stopped else finish
                text.append(matcher.flush())
            stop_reason = _stop_reason(spec, matcher, finish, event.token_ids)
            error, error_code = ((event.error, event.error_code) if finish == "error"
                                 else (None, None))
            if (finish == "stop" and incomplete is not None and stop_reason is None
                    and (why := incomplete(outputs[:-1])) is not None):  # ended at EOS
                finish, error, error_code = "error", why, "invalid_structured_output"
            yield TextDelta(
                index=spec.index,
                text="".join(text),
                token_ids=event.token_ids[:taken],
                logprobs=event.logprobs[:taken],
                num_output_tokens=num_output,
                finish_reason=finish,
                error=error,
                error_code=error_code,
                prompt_logprobs=event.prompt_logprobs,
                stop_reason=stop_reason,
                num_cached_tokens=num_cached,
                compute=compute,
            )
            if finish is not None:
                return
    finally:
        await events.aclose()  # cancels the worker RPCs if they are still open


async def _scored(spec: GenerationSpec, events) -> AsyncIterator[TextDelta]:
    """The one delta of a score-only choice: the prompt's logprobs, no output tokens."""
    prompt_logprobs, num_cached, compute = None, 0, ComputeSeconds()
    async for event in events:
        prompt_logprobs = prompt_logprobs or event.prompt_logprobs
        num_cached = max(num_cached, event.num_cached_tokens)
        if event.compute is not None:
            compute = compute + event.compute
        if event.finish_reason is not None:
            failed = event.finish_reason == "error"
            yield TextDelta(index=spec.index, text="", token_ids=(), logprobs=(),
                            num_output_tokens=0, finish_reason="error" if failed else "length",
                            error=event.error if failed else None,
                            prompt_logprobs=prompt_logprobs, num_cached_tokens=num_cached,
                            compute=compute)
            return


def _stop_reason(spec: GenerationSpec, matcher: StopStringMatcher, finish: str | None,
                 token_ids) -> str | int | None:
    if finish != "stop":
        return None
    if matcher.stopped:
        return matcher.matched
    last = token_ids[-1] if token_ids else None
    return last if last in spec.params.stop_token_ids else None  # else EOS
