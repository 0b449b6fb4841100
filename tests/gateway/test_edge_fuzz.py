"""schemathesis against the gateway's own OpenAPI document (served on its admin port), at a
real gateway process over a scripted worker (fake_workers: a real gRPC server that streams
three tokens to any request, so generated bodies that pass validation go all the way through
tokenizing, admission, routing, detokenizing and SSE). No response may be a server error (5xx
other than the designed 503 overloaded + Retry-After, or a server_error event mid-stream), none
may hang, and the gateway serves a normal request afterwards. Bounded here (SPLITSERVE_FUZZ_EXAMPLES per operation and mode, default 30);
`make fuzz` runs it longer."""

from __future__ import annotations

import copy
import json
import os
from collections import Counter

import httpx
import pytest
import schemathesis
from fake_workers import FakeDecode, streams
from hypothesis import HealthCheck, given, settings
from schemathesis import GenerationMode

EXAMPLES = int(os.environ.get("SPLITSERVE_FUZZ_EXAMPLES", "30"))
CALL_TIMEOUT_S = 15.0  # a response that takes longer counts as a hung connection
POSITIVE, NEGATIVE = GenerationMode.POSITIVE, GenerationMode.NEGATIVE
# A string path parameter and no inputs at all have no invalid values to generate.
OPERATIONS = [("/v1/completions", "POST", (POSITIVE, NEGATIVE)),
              ("/v1/chat/completions", "POST", (POSITIVE, NEGATIVE)),
              ("/v1/models/{model_id}", "GET", (POSITIVE,)),
              ("/v1/models", "GET", (POSITIVE,)), ("/health", "GET", (POSITIVE,))]


@pytest.fixture
def fuzzed_gateway(servers, gateway_factory):
    worker = servers(FakeDecode(streams([40, 41, 42], start_index=0), role="both"))
    gateway = gateway_factory("--worker", worker.address)
    return f"http://{gateway.address}", f"http://{gateway.admin_address}", gateway


def _document(admin_url: str, model: str) -> dict:
    """The served document, with `model` also offered as the served name, so that most
    generated bodies get past the model check into the rest of the path."""
    document = copy.deepcopy(httpx.get(f"{admin_url}/openapi.json", timeout=10).json())
    for name in ("CompletionRequest", "ChatCompletionRequest"):
        properties = document["components"]["schemas"][name]["properties"]
        properties["model"] = {"type": "string", "enum": [model]}
    return document


def _json(case) -> str:
    """The generated body, replayable (ASCII-escaped, as sent)."""
    try:
        return json.dumps(case.body)
    except (TypeError, ValueError):
        return repr(case.body)


def _overloaded(response) -> bool:
    """The designed capacity answer (503, code overloaded, Retry-After), not a server error: a
    generated request may ask for more KV blocks (prompts x n) than the scripted worker has."""
    try:
        code = response.json()["error"]["code"]
    except (ValueError, KeyError, TypeError):
        return False
    return response.status_code == 503 and code == "overloaded" and bool(
        response.headers.get("retry-after"))


def _problems(response) -> list[str]:
    problems = []
    if response.status_code >= 500 and not _overloaded(response):
        problems.append(f"{response.status_code}: {response.text[:300]}")
    elif "text/event-stream" in str(response.headers.get("content-type")):
        if '"server_error"' in response.text or not response.text.rstrip().endswith("[DONE]"):
            problems.append(f"stream: {response.text[-300:]}")
    return problems


def _fuzz(operation, mode: GenerationMode, public: str, failures: list[str],
          statuses: Counter) -> None:
    """EXAMPLES generated calls of one operation in one mode."""
    label = f"{operation.method.upper()} {operation.path} {mode.value}"

    @given(case=operation.as_strategy(generation_mode=mode))
    @settings(max_examples=EXAMPLES, deadline=None, database=None,
              suppress_health_check=list(HealthCheck))
    def run(case) -> None:
        try:
            response = case.call(base_url=public, timeout=CALL_TIMEOUT_S)
        except Exception as exc:  # a timeout, a reset connection
            failures.append(f"{label}: {exc!r} for {_json(case)}")
            return
        statuses[f"{label} {response.status_code}"] += 1
        failures.extend(f"{label}: {p} for {_json(case)}" for p in _problems(response))

    run()


def test_generated_requests_never_get_a_server_error_or_hang(fuzzed_gateway):
    public, admin, gateway = fuzzed_gateway
    model = httpx.get(f"{public}/v1/models", timeout=10).json()["data"][0]["id"]
    schema = schemathesis.openapi.from_dict(_document(admin, model))
    failures: list[str] = []
    statuses: Counter[str] = Counter()  # printed: what the generated calls reached
    for path, method, modes in OPERATIONS:
        for mode in modes:
            _fuzz(schema[path][method], mode, public, failures, statuses)
    print("\n".join(f"{n:5d} {k}" for k, n in sorted(statuses.items())))
    assert gateway.alive()
    errors = [line for line in gateway.lines if '"error"' in line or "Traceback" in line]
    calls = sum(statuses.values()) + len(failures)
    assert not failures, (f"{len(failures)} problems in {calls} calls:\n" + "\n".join(failures[:10])
                          + "\ngateway log:\n" + "".join(errors[-10:]))
    assert calls >= len(OPERATIONS)
    good = httpx.post(f"{public}/v1/completions", timeout=30, json={
        "model": model, "prompt": "hi", "max_tokens": 3})
    assert good.status_code == 200 and good.json()["choices"][0]["text"]


# What the fuzzer found, kept as plain regression tests.

def test_a_top_k_beyond_the_vocabulary_is_served_as_off(servers, gateway_factory):
    """It once overflowed the workers' int32 field: a 500."""
    worker = servers(FakeDecode(streams([40, 41], start_index=0), role="both"))
    gateway = gateway_factory("--worker", worker.address)
    url = f"http://{gateway.address}"
    model = httpx.get(f"{url}/v1/models", timeout=10).json()["data"][0]["id"]
    for path, body in (("/v1/completions", {"prompt": "hi"}),
                       ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]})):
        response = httpx.post(url + path, timeout=30,
                              json={"model": model, "top_k": 2897316001199, **body})
        assert response.status_code == 200, response.text
        assert worker.servicer.calls[-1].sampling.top_k == 0


@pytest.mark.parametrize("field", ["temperature", "repetition_penalty"])
def test_a_float_the_workers_cannot_carry_is_refused(servers, gateway_factory, field):
    """float32 on the wire: 1e39 would reach a worker as infinity."""
    worker = servers(FakeDecode(streams([40], start_index=0), role="both"))
    gateway = gateway_factory("--worker", worker.address)
    url = f"http://{gateway.address}"
    model = httpx.get(f"{url}/v1/models", timeout=10).json()["data"][0]["id"]
    response = httpx.post(f"{url}/v1/completions", timeout=30,
                          json={"model": model, "prompt": "hi", field: 1e39})
    assert response.status_code == 400 and response.json()["error"]["param"] == field
    assert not worker.servicer.calls
