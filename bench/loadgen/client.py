"""One streaming request to an OpenAI-compatible server, timed chunk by chunk.

A target's *flavor* says how it is told to produce exactly the asked number of tokens:
  openai        "ignore_eos": true  (vLLM, SGLang, splitserve)
  transformers  "generation_config": '{"max_new_tokens": N, "eos_token_id": -1}'
                (`transformers serve` answers 422 to ignore_eos)
  plain         nothing: outputs may stop early at EOS (counted as inexact_outputs)
"""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass

import httpx

from bench.loadgen.metrics import RequestRecord
from bench.loadgen.prompts import Prompt
from bench.loadgen.sse import aiter_events
from bench.loadgen.workload import RequestSpec

FLAVORS = ("openai", "transformers", "plain")
ENDPOINTS = {"completions": "/v1/completions", "chat": "/v1/chat/completions"}


@dataclass(frozen=True)
class Target:
    url: str  # server root, e.g. http://127.0.0.1:8000 (a trailing /v1 is accepted)
    model: str
    endpoint: str = "completions"
    flavor: str = "openai"
    temperature: float = 0.0
    api_key: str = ""  # sent when a request has no tenant key of its own

    def __post_init__(self) -> None:
        if self.endpoint not in ENDPOINTS:
            raise ValueError(f"endpoint must be one of {', '.join(ENDPOINTS)}")
        if self.flavor not in FLAVORS:
            raise ValueError(f"flavor must be one of {', '.join(FLAVORS)}")

    @property
    def root(self) -> str:
        url = self.url.rstrip("/")
        return url[: -len("/v1")] if url.endswith("/v1") else url

    @property
    def endpoint_url(self) -> str:
        return self.root + ENDPOINTS[self.endpoint]

    @property
    def exact_lengths(self) -> bool:
        return self.flavor != "plain"

    def body(self, prompt: Prompt, output_len: int,
             sampling: tuple[tuple[str, float | int], ...] = ()) -> dict:
        body: dict = {"model": self.model, "stream": True, "max_tokens": output_len,
                      "temperature": self.temperature, **dict(sampling)}
        if self.endpoint == "chat" and "logprobs" in body:  # chat: a flag plus top_logprobs
            body["top_logprobs"], body["logprobs"] = body["logprobs"], True
        body["messages" if self.endpoint == "chat" else "prompt"] = prompt
        if self.flavor == "openai":
            body["ignore_eos"] = True
        if self.flavor == "transformers":
            # Replaces the model's generation config: greedy, no EOS, exactly N new tokens.
            body["generation_config"] = json.dumps({"max_new_tokens": output_len,
                                                    "eos_token_id": -1})
        else:
            body["stream_options"] = {"include_usage": True}
        return body

    def headers(self, api_key: str = "") -> dict[str, str]:
        key = api_key or self.api_key
        return {"Authorization": f"Bearer {key}"} if key else {}


def _content(event: dict, endpoint: str) -> tuple[str, str | None]:
    """(text, finish_reason) of a chunk's first choice."""
    choices = event.get("choices") or []
    if not choices:
        return "", None
    choice = choices[0]
    text = (choice.get("delta") or {}).get("content") if endpoint == "chat" else choice.get("text")
    return text or "", choice.get("finish_reason")


async def send(client: httpx.AsyncClient, target: Target, spec: RequestSpec, prompt: Prompt,
               run_start: float, deadline: float | None = None) -> RequestRecord:
    """Send one request and time its stream. Never raises for server or network trouble: the
    record's status says what happened. `deadline` (event-loop time) cuts it off as 'timeout'."""
    start = time.perf_counter()
    first: float | None = None
    last = 0.0
    gaps: list[float] = []
    chunks = 0
    usage: dict = {}
    finish: str | None = None
    status, error = "ok", ""
    try:
        async with asyncio.timeout_at(deadline), client.stream(
                "POST", target.endpoint_url, json=target.body(prompt, spec.output_len, spec.sampling),
                headers=target.headers(spec.api_key)) as response:
            if response.status_code != 200:
                detail = (await response.aread())[:300].decode(errors="replace")
                return _record(spec, start - run_start, f"http_{response.status_code}",
                               error=detail, e2e_s=time.perf_counter() - start,
                               retry_after_s=_retry_after(response.headers.get("retry-after")))
            async for data in aiter_events(response.aiter_lines()):
                now = time.perf_counter()
                event = json.loads(data)
                if event.get("error"):
                    status, error = "error", str(event["error"])[:300]
                    break
                usage = event.get("usage") or usage
                text, reason = _content(event, target.endpoint)
                finish = reason or finish
                if text:
                    if first is None:
                        first = now
                    else:
                        gaps.append(now - last)
                    last = now
                    chunks += 1
        if status == "ok" and finish == "error":
            status, error = "error", "finish_reason error"
        elif status == "ok" and finish is None:
            status, error = "error", "stream ended without a finish_reason"
    except TimeoutError:
        status, error = "timeout", "still running at the run's drain deadline"
    except (httpx.HTTPError, json.JSONDecodeError) as exc:
        status, error = "error", f"{type(exc).__name__}: {exc}"[:300]
    end = time.perf_counter()
    return _record(spec, start - run_start, status, error=error,
                   ttft_s=None if first is None else first - start, itl_s=tuple(gaps),
                   e2e_s=end - start, output_tokens=int(usage.get("completion_tokens", chunks)),
                   prompt_tokens_reported=usage.get("prompt_tokens"))


def _retry_after(value: str | None) -> float | None:
    """Retry-After in seconds (the delay form; an HTTP date is not sent by these servers)."""
    try:
        return max(float(value), 0.0) if value is not None else None
    except ValueError:
        return None


def _record(spec: RequestSpec, start_s: float, status: str, **fields) -> RequestRecord:
    return RequestRecord(index=spec.index, cls=spec.cls, tenant=spec.tenant,
                         prompt_len=spec.prompt_len, output_len=spec.output_len, start_s=start_s,
                         status=status, **fields)
