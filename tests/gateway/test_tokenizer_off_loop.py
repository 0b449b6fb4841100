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
        response = httpx.post(url, timeout=120, json={"model": model, "prompt": BIG_PROMPT})
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
    # Over the context length: refused, after it was tokenized.
    assert big["status"] == 400 and big["error"]["code"] == "context_length_exceeded", big
    during = [t for t in arrivals if big["start"] <= t <= big["end"] + 0.2]
    gaps = [b - a for a, b in zip(during, during[1:], strict=False)]
    assert len(gaps) > 3, "the stream did not run while the big prompt was served"
    # On the loop, one gap would be about the whole tokenization; off it, gaps stay short.
    assert max(gaps) < tokenize_s / 3, (
        f"a stream paused {max(gaps):.3f}s while a prompt that takes {tokenize_s:.3f}s "
        f"to tokenize was served ({big['end'] - big['start']:.3f}s)")
