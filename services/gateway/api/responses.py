"""OpenAI response bodies: chat.completion(.chunk) and text_completion, logprobs included.
Plain dicts built at the HTTP edge; everything before this module speaks TextDelta."""

from __future__ import annotations

import json
import time
import uuid
from dataclasses import dataclass, field

from engine.outputs import ComputeSeconds, Logprobs
from services.gateway.api.text_stream import TextDelta
from services.gateway.api.tokenizer import ModelTokenizer
from services.gateway.api.tool_output import ToolCallStream, finish_reason, tool_message
from services.gateway.api.tools import ToolPlan
from services.gateway.generation_spec import GenerationSpec

MIN_LOGPROB = -9999.0  # JSON has no -Infinity


# Characters JSON leaves raw that many line readers (Python's str.splitlines, and so httpx's
# aiter_lines) take for line breaks: a token that decodes to one would cut its SSE event in two.
# Escaped, they are the same JSON string.
_LINE_BREAKS_JSON_KEEPS = str.maketrans({"\x85": "\\u0085", "\u2028": "\\u2028",
                                         "\u2029": "\\u2029"})


def token_placeholder(token_id: int) -> str:
    """A logprob token named by its id (vLLM's return_tokens_as_token_ids)."""
    return f"token_id:{token_id}"


def encode_sse(payload: dict | str) -> bytes:
    data = payload if isinstance(payload, str) else json.dumps(
        payload, ensure_ascii=False, separators=(",", ":"), allow_nan=False,
    ).translate(_LINE_BREAKS_JSON_KEEPS)
    return f"data: {data}\n\n".encode()


@dataclass
class ChoiceResult:
    """A whole choice, accumulated from its deltas (non-streaming responses)."""

    index: int
    text: list[str] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[Logprobs] = field(default_factory=list)
    prompt_logprobs: tuple[Logprobs | None, ...] | None = None
    finish_reason: str | None = None
    stop_reason: str | int | None = None
    error: str | None = None
    error_code: str | None = None
    num_output_tokens: int = 0
    num_cached_tokens: int = 0
    compute: ComputeSeconds = ComputeSeconds()

    def add(self, delta: TextDelta) -> None:
        self.text.append(delta.text)
        self.token_ids.extend(delta.token_ids)
        self.logprobs.extend(delta.logprobs)
        if delta.prompt_logprobs is not None and self.prompt_logprobs is None:
            self.prompt_logprobs = delta.prompt_logprobs
        self.finish_reason = delta.finish_reason or self.finish_reason
        self.stop_reason = delta.stop_reason if delta.stop_reason is not None else self.stop_reason
        self.error = delta.error or self.error
        self.error_code = delta.error_code or self.error_code
        self.num_output_tokens = delta.num_output_tokens
        self.num_cached_tokens = max(self.num_cached_tokens, delta.num_cached_tokens)
        self.compute = delta.compute  # the choice's running total


def _likeliest(lp: Logprobs) -> list[tuple[int, float]]:
    """A position's top alternatives, likeliest first."""
    return sorted(lp.top.items(), key=lambda kv: -kv[1])


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int,
          compute: ComputeSeconds | None = None) -> dict:
    """OpenAI's usage object; `splitserve` is our extension: the engine seconds the workers
    charged to the request, by phase, and the prompt tokens served from the prefix cache."""
    c = compute or ComputeSeconds()
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "prompt_tokens_details": {"cached_tokens": cached_tokens},
        "splitserve": {
            "compute_seconds": {"prefill": round(c.prefill, 6), "decode": round(c.decode, 6),
                                "transfer": round(c.transfer, 6), "total": round(c.total, 6)},
            "cached_tokens": cached_tokens,
        },
    }


class BodyFormat:
    """Shared header fields; one instance per HTTP request (it keeps per-choice state)."""

    object_name = ""
    chunk_object_name = ""
    id_prefix = ""

    def __init__(self, model: str, tokenizer: ModelTokenizer, specs: list[GenerationSpec],
                 include_usage: bool = False, continuous_usage: bool = False,
                 system_fingerprint: str | None = None) -> None:
        """`continuous_usage`: vLLM's continuous_usage_stats, the usage on every chunk;
        `system_fingerprint`: Gateway.system_fingerprint."""
        self.id = f"{self.id_prefix}-{uuid.uuid4().hex}"
        self.created = int(time.time())
        self.model = model
        self.tokenizer = tokenizer
        self.specs = {spec.index: spec for spec in specs}
        self.include_usage = include_usage
        self.continuous_usage = continuous_usage
        self.system_fingerprint = system_fingerprint

    def _envelope(self, choices: list[dict], chunk: bool) -> dict:
        body = {"id": self.id, "object": self.chunk_object_name if chunk else self.object_name,
                "created": self.created, "model": self.model,
                "system_fingerprint": self.system_fingerprint, "choices": choices}
        if chunk and self.include_usage:
            body["usage"] = None
        return body

    def chunks(self, delta: TextDelta) -> list[dict]:
        chunk = self.chunk(delta)
        return [] if chunk is None else [chunk]

    # -- the SSE stream around the chunks (api/streaming.py) ------------------------------

    def opening(self, indexes: list[int], usage: dict | None = None) -> list[bytes]:
        """Events before the first chunk; `usage`: the usage so far, for a stream that
        carries it on every chunk (continuous_usage)."""
        return []

    def encode(self, chunk: dict) -> bytes:
        return encode_sse(chunk)

    def error_event(self, error) -> bytes:
        """A choice failed after tokens were sent (an APIError)."""
        return encode_sse(error.body())

    def closing(self, usage_body: dict) -> list[bytes]:
        """Events after the last chunk: the usage chunk when asked for, then [DONE]."""
        return [*([encode_sse(self.usage_chunk(usage_body))] if self.include_usage else []),
                encode_sse("[DONE]")]

    def usage_chunk(self, usage_body: dict) -> dict:
        body = self._envelope([], chunk=True)
        body["usage"] = usage_body
        return body

    def _lp(self, value: float) -> float:
        return max(value, MIN_LOGPROB)

    def _ids(self, index: int, token_ids) -> dict:
        """vLLM's return_token_ids: the choice's output token ids (a chunk's: its delta)."""
        return {"token_ids": list(token_ids)} if self.specs[index].return_token_ids else {}

    def _wants_ids(self, delta: TextDelta) -> bool:
        """A chunk carrying no text still goes out when it carries asked-for token ids."""
        return bool(delta.token_ids) and self.specs[delta.index].return_token_ids

    @staticmethod
    def _stop_reason(delta: TextDelta) -> dict:
        """vLLM's stop_reason, on a stream's finishing chunk (with its finish_reason)."""
        return {"stop_reason": delta.stop_reason} if delta.finish_reason is not None else {}

    def _prompt_ids(self, index: int) -> dict:
        spec = self.specs[index]
        return {"prompt_token_ids": list(spec.prompt_token_ids)} if spec.return_token_ids else {}

    def _prompt_logprobs(self, index: int, logprobs: tuple[Logprobs | None, ...] | None) -> dict:
        """vLLM's prompt_logprobs: per prompt token (the first has none), its id -> logprob,
        rank and text, then the same for the likeliest tokens in its place. Empty unless
        asked for; a migrated request's resumed attempt computes none (null entries)."""
        spec = self.specs[index]
        if not spec.return_prompt_logprobs:
            return {}
        prompt = spec.prompt_token_ids
        logprobs = logprobs or (None,) * len(prompt)
        out: list[dict | None] = []
        for token_id, lp in zip(prompt, logprobs, strict=False):
            if lp is None:
                out.append(None)
                continue
            entry = {str(token_id): self._ranked(token_id, lp.logprob, lp.rank)}
            for rank, (other, value) in enumerate(_likeliest(lp), start=1):
                entry.setdefault(str(other), self._ranked(other, value, rank))
            out.append(entry)
        return {"prompt_logprobs": out}

    def _ranked(self, token_id: int, logprob: float, rank: int) -> dict:
        return {"logprob": self._lp(logprob), "rank": rank,
                "decoded_token": self.tokenizer.token_text(token_id)}


class ChatFormat(BodyFormat):
    """With a ToolPlan, tool calls are parsed out of each choice's text (api/tool_output)."""

    object_name = "chat.completion"
    chunk_object_name = "chat.completion.chunk"
    id_prefix = "chatcmpl"

    def __init__(self, *args, tools: ToolPlan | None = None, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.tools = tools
        self._tool_streams: dict[int, ToolCallStream] = {}  # per choice
        self._prompt_logprobs_sent = False  # one prompt for every choice: sent once

    def chunks(self, delta: TextDelta) -> list[dict]:
        out = self._tool_chunks(delta) if self.tools is not None else super().chunks(delta)
        if self._prompt_logprobs_sent or delta.prompt_logprobs is None:
            return out
        prompt = self._prompt_logprobs(delta.index, delta.prompt_logprobs)
        if prompt:
            self._prompt_logprobs_sent = True
            if not out:  # a first token without text still carries the prompt's logprobs
                out = [self._envelope([{"index": delta.index, "delta": {}, "logprobs": None,
                                        "finish_reason": None}], chunk=True)]
            out[0].update(prompt)
        return out

    def _tool_chunks(self, delta: TextDelta) -> list[dict]:
        stream = self._tool_streams.setdefault(delta.index, ToolCallStream(self.tools))
        deltas = stream.deltas(delta.text, final=delta.finish_reason is not None)
        finish = finish_reason(delta.finish_reason, stream.num_calls, self.tools,
                               delta.stop_reason)
        if not deltas and not delta.logprobs and finish is None and not self._wants_ids(delta):
            return []
        if not deltas:
            deltas = [{} if finish is not None else {"content": ""}]
        logprobs = self._logprobs(delta.token_ids, delta.logprobs, delta.index)
        ids = self._ids(delta.index, delta.token_ids)
        return [self._envelope([{"index": delta.index, "delta": d,
                                 "logprobs": logprobs if k == 0 else None,
                                 "finish_reason": finish if k == len(deltas) - 1 else None,
                                 **(self._stop_reason(delta) if k == len(deltas) - 1 else {}),
                                 **(ids if k == 0 else {})}],
                               chunk=True)
                for k, d in enumerate(deltas)]

    def role_chunk(self, index: int, usage: dict | None = None) -> dict:
        chunk = {**self._envelope([{"index": index, "delta": {"role": "assistant", "content": ""},
                                    "logprobs": None, "finish_reason": None}], chunk=True),
                 **self._prompt_ids(index)}
        if usage is not None:  # continuous usage: on this chunk too, as vLLM sends it
            chunk["usage"] = usage
        return chunk

    def opening(self, indexes: list[int], usage: dict | None = None) -> list[bytes]:
        return [encode_sse(self.role_chunk(index, usage)) for index in indexes]

    def chunk(self, delta: TextDelta) -> dict | None:
        if (not delta.text and not delta.logprobs and delta.finish_reason is None
                and not self._wants_ids(delta)):
            return None
        content = {"content": delta.text} if delta.text or delta.finish_reason is None else {}
        choice = {"index": delta.index, "delta": content,
                  "logprobs": self._logprobs(delta.token_ids, delta.logprobs, delta.index),
                  "finish_reason": delta.finish_reason, **self._stop_reason(delta),
                  **self._ids(delta.index, delta.token_ids)}
        return self._envelope([choice], chunk=True)

    def response(self, choices: list[ChoiceResult], usage_body: dict) -> dict:
        body = self._envelope([self._choice(c) for c in choices], chunk=False)
        body.update(self._prompt_ids(choices[0].index))  # one prompt for every choice
        body.update(self._prompt_logprobs(choices[0].index, choices[0].prompt_logprobs))
        body["usage"] = usage_body
        return body

    def _choice(self, c: ChoiceResult) -> dict:
        text = "".join(c.text)
        if self.tools is None:
            message, finish = {"role": "assistant", "content": text}, c.finish_reason
        else:
            message = tool_message(self.tools, text)
            finish = finish_reason(c.finish_reason, len(message.get("tool_calls", ())),
                                   self.tools, c.stop_reason)
        return {"index": c.index, "message": message,
                "logprobs": self._logprobs(c.token_ids, c.logprobs, c.index),
                "finish_reason": finish, "stop_reason": c.stop_reason,
                **self._ids(c.index, c.token_ids)}

    def _logprobs(self, token_ids, logprobs, index: int) -> dict | None:
        spec = self.specs[index]
        if spec.logprobs is None:
            return None
        return {"content": [self._entry(t, lp, spec.tokens_as_ids)
                            for t, lp in zip(token_ids, logprobs, strict=False)]}

    def _entry(self, token_id: int, lp: Logprobs, as_ids: bool) -> dict:
        entry = self._top(token_id, lp.logprob, as_ids)
        if as_ids:  # the chosen token's bytes stay its text's (as vLLM sends them)
            entry["bytes"] = list(self.tokenizer.token_bytes(token_id))
        entry["top_logprobs"] = [self._top(t, v, as_ids) for t, v in _likeliest(lp)]
        return entry

    def _top(self, token_id: int, logprob: float, as_ids: bool) -> dict:
        if as_ids:  # vLLM's return_tokens_as_token_ids: the bytes are the placeholder's
            token = token_placeholder(token_id)
            return {"token": token, "logprob": self._lp(logprob), "bytes": list(token.encode())}
        return {"token": self.tokenizer.token_text(token_id), "logprob": self._lp(logprob),
                "bytes": list(self.tokenizer.token_bytes(token_id))}


class CompletionFormat(BodyFormat):
    object_name = "text_completion"
    chunk_object_name = "text_completion"
    id_prefix = "cmpl"

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self._text_offset: dict[int, int] = {}  # per choice: characters streamed so far
        self._started: set[int] = set()

    def chunk(self, delta: TextDelta) -> dict | None:
        spec = self.specs[delta.index]
        text, token_ids, logprobs, prompt_part = delta.text, delta.token_ids, delta.logprobs, None
        first = delta.index not in self._started
        if first:
            self._started.add(delta.index)
            if spec.echo_text is not None:
                text = spec.echo_text + text
                prompt_part = (spec.prompt_token_ids, delta.prompt_logprobs)
        prompt = self._prompt_logprobs(delta.index, delta.prompt_logprobs) if first else {}
        if (not text and not logprobs and delta.finish_reason is None
                and not self._wants_ids(delta) and not prompt):
            return None
        choice = {"index": delta.index, "text": text,
                  "logprobs": self._logprobs(spec, token_ids, logprobs, prompt_part),
                  "finish_reason": delta.finish_reason, **self._stop_reason(delta),
                  **self._ids(delta.index, token_ids),
                  **(self._prompt_ids(delta.index) if first else {}), **prompt}
        return self._envelope([choice], chunk=True)

    def response(self, choices: list[ChoiceResult], usage_body: dict) -> dict:
        out = []
        for c in choices:
            spec = self.specs[c.index]
            prompt_part = None
            text = "".join(c.text)
            if spec.echo_text is not None:
                text = spec.echo_text + text
                prompt_part = (spec.prompt_token_ids, c.prompt_logprobs)
            out.append({"index": c.index, "text": text,
                        "logprobs": self._logprobs(spec, c.token_ids, c.logprobs, prompt_part),
                        "finish_reason": c.finish_reason, "stop_reason": c.stop_reason,
                        **self._ids(c.index, c.token_ids), **self._prompt_ids(c.index),
                        **self._prompt_logprobs(c.index, c.prompt_logprobs)})
        body = self._envelope(out, chunk=False)
        body["usage"] = usage_body
        return body

    def _top_logprobs(self, token_id: int, lp: Logprobs, name) -> dict[str, float]:
        """OpenAI's legacy completions (and vLLM): the chosen token, then the `logprobs`
        likeliest, so up to logprobs + 1 entries (logprobs=0: the chosen one alone). Keyed by
        `name` (text, or the id placeholder): a likelier token with the chosen one's text does
        not replace it."""
        top = {name(token_id): self._lp(lp.logprob)}
        for other, value in _likeliest(lp):
            top.setdefault(name(other), self._lp(value))
        return top

    def _logprobs(self, spec, token_ids, logprobs, prompt_part) -> dict | None:
        if spec.logprobs is None:
            return None
        tokens, token_logprobs, tops, offsets = [], [], [], []
        offset = self._text_offset.get(spec.index, 0)
        entries: list[tuple[int, Logprobs | None]] = []
        if prompt_part is not None:
            prompt_ids, prompt_lps = prompt_part
            prompt_lps = prompt_lps or (None,) * len(prompt_ids)
            entries += list(zip(prompt_ids, prompt_lps, strict=False))
        entries += list(zip(token_ids, logprobs, strict=False))
        name = token_placeholder if spec.tokens_as_ids else self.tokenizer.token_text
        for token_id, lp in entries:
            tokens.append(name(token_id))
            offsets.append(offset)  # into the text, whatever the tokens are named
            offset += len(self.tokenizer.token_text(token_id))
            token_logprobs.append(None if lp is None else self._lp(lp.logprob))
            tops.append(None if lp is None else self._top_logprobs(token_id, lp, name))
        self._text_offset[spec.index] = offset
        return {"tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": tops,
                "text_offset": offsets}
