"""Greedy output through the gateway (HTTP and gRPC, both deployments) equals the engine's own
greedy output for the same prompt: token ids and text."""

from __future__ import annotations

import grpc
import pytest
from gateway_processes import openai_client
from splitserve.v1 import common_pb2, gateway_pb2, gateway_pb2_grpc

PROMPTS = [
    "The engineer reads a long letter",
    "Café au lait, naïve façade 🙂 東京",
    "  leading spaces and\ttabs",
]
MAX_TOKENS = 24


@pytest.fixture(scope="module")
def engine_greedy(engine):
    from engine.sampling_params import SamplingParams

    return engine.generate(PROMPTS, SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS))


def _grpc_tokens(address: str, prompt: str) -> list[int]:
    with grpc.insecure_channel(address) as channel:
        stub = gateway_pb2_grpc.GatewayStub(channel)
        request = gateway_pb2.GenerateTextRequest(
            text=prompt, sampling=common_pb2.SamplingParams(
                max_tokens=MAX_TOKENS, temperature=0.0, has_temperature=True))
        return [t for response in stub.Generate(request, timeout=60) for t in response.token_ids]


def test_completions_equal_engine_greedy(stack, engine_greedy, tiny_llama_dir):
    client = openai_client(stack.url)
    for prompt, expected in zip(PROMPTS, engine_greedy, strict=True):
        response = client.completions.create(model=tiny_llama_dir.name, prompt=prompt,
                                             max_tokens=MAX_TOKENS, temperature=0)
        assert response.choices[0].text == expected.text, prompt
        assert response.usage.completion_tokens == len(expected.token_ids)
        assert _grpc_tokens(stack.grpc_address, prompt) == expected.token_ids, prompt


def test_chat_equals_engine_greedy_on_the_templated_prompt(stack, engine, tiny_llama_dir):
    from transformers import AutoTokenizer

    from engine.sampling_params import SamplingParams

    messages = [{"role": "system", "content": "Be brief."},
                {"role": "user", "content": "What is the capital of France?"}]
    hf = AutoTokenizer.from_pretrained(str(tiny_llama_dir))
    text = hf.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    prompt_ids = hf.encode(text, add_special_tokens=False)
    [expected] = engine.generate([prompt_ids], SamplingParams(temperature=0.0, max_tokens=16))
    response = openai_client(stack.url).chat.completions.create(
        model=tiny_llama_dir.name, messages=messages, max_tokens=16, temperature=0)
    assert response.usage.prompt_tokens == len(prompt_ids)
    assert response.choices[0].message.content == hf.decode(expected.token_ids,
                                                            skip_special_tokens=True)
