"""Tokenizing a huge prompt happens off the gateway's event loop: while a multi-megabyte
prompt is tokenized, another stream keeps receiving its chunks at its usual pace, instead of
pausing for as long as the tokenization takes."""

from __future__ import annotations

import threading
import time

import httpx
from fake_workers import FakeDecode, delta

from services.gateway.api.tokenizer import ModelTokenizer

TICK_S = 0.01  # the scripted worker's time per token
# ~2 MiB: under --max-body-bytes (8 MiB), and seconds of tokenizing on a small machine.
BIG_PROMPT = "Our team builds two paper boats near the station. " * 40_000


def ticking(request, context, fake):
    """A token every TICK_S until the caller cancels."""
    index = 0
    while context.is_active():
        yield delta([40 + index % 50], index)
        index += 1
        time.sleep(TICK_S)
    fake.cancelled.set()


def test_a_huge_prompt_does_not_stall_other_streams(servers, gateway_factory, tiny_llama_dir):
    # What tokenizing the prompt costs in one go, as it would on the loop (measured now, on
    # this machine under its current load).
    tokenizer = ModelTokenizer(tiny_llama_dir)
    started = time.perf_counter()
    tokenizer.backend.encode(BIG_PROMPT)
    tokenize_s = time.perf_counter() - started
    assert tokenize_s > 0.3, f"the prompt tokenizes in {tokenize_s:.3f}s: too fast to tell"

    worker = servers(FakeDecode(ticking, role="both"))
    gateway = gateway_factory("--worker", worker.address)
    url = f"http://{gateway.address}/v1/completions"
    model = tiny_llama_dir.name
    arrivals: list[float] = []
    big: dict = {}
    big_done = threading.Event()

    def post_big() -> None:
        big["start"] = time.monotonic()
        # Truncation keeps the prompt's end, so all of it is tokenized (without it, a prompt
        # this long is refused by its length before any tokenizing: the next test); then
        # max_tokens does not fit the context.
        response = httpx.post(url, timeout=120, json={
            "model": model, "prompt": BIG_PROMPT, "truncate_prompt_tokens": 8,
            "max_tokens": 100_000})
        big["end"] = time.monotonic()
        big["status"], big["error"] = response.status_code, response.json().get("error")
        big_done.set()

    poster = threading.Thread(target=post_big)
    with httpx.stream("POST", url, timeout=60, json={
            "model": model, "prompt": "hi", "max_tokens": 400, "stream": True}) as stream:
        assert stream.status_code == 200
        for line in stream.iter_lines():
            if not line.startswith("data: "):
                continue
            arrivals.append(time.monotonic())
            if len(arrivals) == 10:
                poster.start()
            if big_done.is_set() and arrivals[-1] > big["end"] + 0.2:
                break
            assert len(arrivals) < 5000, "the big request never finished"
    poster.join()
    # Over the context length with max_tokens: refused, after it was tokenized.
    assert big["status"] == 400 and big["error"]["code"] == "context_length_exceeded", big
    during = [t for t in arrivals if big["start"] <= t <= big["end"] + 0.2]
    gaps = [b - a for a, b in zip(during, during[1:], strict=False)]
    assert len(gaps) > 3, "the stream did not run while the big prompt was served"
    # On the loop, one gap would be about the whole tokenization; off it, gaps stay short.
    assert max(gaps) < tokenize_s / 3, (
        f"a stream paused {max(gaps):.3f}s while a prompt that takes {tokenize_s:.3f}s "
        f"to tokenize was served ({big['end'] - big['start']:.3f}s)")


def test_a_prompt_too_long_by_its_length_alone_is_refused_before_tokenizing(
        disagg_stack, tiny_llama_dir):
    """A text with more characters than the context's tokens could hold (at the vocabulary's
    longest token) is refused at once, over HTTP (completions and chat) and gRPC: 7.8 MB
    prompts took a tokenizer thread 20-30 s each only to be refused for their length, and a
    caller's cancellation could not stop that (a gRPC audit: two such calls delayed a normal
    prompt from 4 to 22 s)."""
    import grpc
    from splitserve.v1 import gateway_pb2, gateway_pb2_grpc

    tokenizer = ModelTokenizer(tiny_llama_dir)
    started = time.perf_counter()
    tokenizer.backend.encode(BIG_PROMPT)
    tokenize_s = time.perf_counter() - started
    url = disagg_stack.url
    model = tiny_llama_dir.name
    for path, body, param in (
            ("/v1/completions", {"prompt": BIG_PROMPT}, "prompt"),
            ("/v1/completions", {"prompt": ["hi", BIG_PROMPT]}, "prompt"),
            ("/v1/chat/completions", {"messages": [{"role": "user", "content": BIG_PROMPT}]},
             "messages")):
        started = time.perf_counter()
        response = httpx.post(f"{url}{path}", timeout=120, json={"model": model, **body})
        took = time.perf_counter() - started
        error = response.json()["error"]
        assert response.status_code == 400 and error["code"] == "context_length_exceeded", error
        assert error["param"] == param and " characters, at least " in error["message"]
        assert took < tokenize_s / 3, (path, took, tokenize_s)
    with grpc.insecure_channel(disagg_stack.grpc_address) as channel:
        started = time.perf_counter()
        try:
            list(gateway_pb2_grpc.GatewayStub(channel).Generate(
                gateway_pb2.GenerateTextRequest(text=BIG_PROMPT), timeout=120))
            raise AssertionError("served")
        except grpc.RpcError as exc:
            assert exc.code() == grpc.StatusCode.INVALID_ARGUMENT, exc
            assert "context length" in exc.details()
        assert time.perf_counter() - started < tokenize_s / 3


def test_the_length_bound_never_refuses_a_text_the_context_holds(tiny_llama_dir, smollm2_dir):
    """The bound is the vocabulary's longest token in characters: no text has fewer tokens
    than its length over that (texts of the kind that pack most characters per token)."""
    for folder in (tiny_llama_dir, smollm2_dir):
        tokenizer = ModelTokenizer(folder)
        longest = tokenizer.max_chars_per_token
        for text in ("#" * 5000, " " * 5000, "\n" + " " * 4999, "the " * 2000, "é" * 3000,
                     BIG_PROMPT[:20_000], "".join(chr(0x4E00 + i) for i in range(3000))):
            ids = tokenizer.encode(text)
            assert len(ids) >= len(text) / longest, (folder.name, text[:20], len(ids))
            assert tokenizer.encode(text, max_tokens=len(ids)) == ids  # at its count: taken
