"""--served-model-name: the name clients send as "model", as vLLM's flag of that name, on real
processes (a disaggregated pair and its gateway, each given the same name). The workers keep
their folder's name as their identity, by which the gateway pairs prefill and decode workers of
one model version (docs/rolling-update.md)."""

from __future__ import annotations

import grpc
import httpx
import pytest
from gateway_processes import start_gateway, start_worker
from splitserve.v1 import common_pb2, decode_pb2_grpc, prefill_pb2_grpc

NAME = "acme/tiny-chat-v2"


@pytest.fixture(scope="module")
def named_stack(tiny_llama_dir):
    prefill = start_worker(tiny_llama_dir, "prefill", "--served-model-name", NAME)
    decode = start_worker(tiny_llama_dir, "decode", "--served-model-name", NAME)
    gateway = None
    try:
        prefill.wait_ready()
        decode.wait_ready()
        gateway = start_gateway(tiny_llama_dir, "--prefill", prefill.address, "--decode",
                                decode.address, "--served-model-name", NAME)
        yield gateway, prefill, decode
    finally:
        for process in (gateway, prefill, decode):
            if process is not None:
                process.stop()


def _health_model(address: str, stub_class) -> str:
    with grpc.insecure_channel(address) as channel:
        return stub_class(channel).Health(common_pb2.HealthRequest(), timeout=5).model


def test_clients_send_the_served_name_and_the_folders_is_not_found(named_stack, tiny_llama_dir):
    gateway, _, _ = named_stack
    url = f"http://{gateway.address}"
    assert [m["id"] for m in httpx.get(f"{url}/v1/models").json()["data"]] == [NAME]
    answer = httpx.post(f"{url}/v1/completions", timeout=60, json={
        "model": NAME, "prompt": "hello", "max_tokens": 4, "temperature": 0})
    assert answer.status_code == 200, answer.text
    assert answer.json()["model"] == NAME
    refused = httpx.post(f"{url}/v1/completions", timeout=60, json={
        "model": tiny_llama_dir.name, "prompt": "hello", "max_tokens": 4})
    assert refused.status_code == 404 and NAME in refused.json()["error"]["message"]


def test_workers_label_metrics_with_it_and_keep_their_folder_as_identity(named_stack,
                                                                         tiny_llama_dir):
    _, prefill, decode = named_stack
    # A model update keeps the served name and changes the folder: Health's model is what
    # pairs versions, so it stays the folder's name.
    assert _health_model(prefill.address, prefill_pb2_grpc.PrefillStub) == tiny_llama_dir.name
    assert _health_model(decode.address, decode_pb2_grpc.DecodeStub) == tiny_llama_dir.name
    metrics = httpx.get(f"http://{decode.field('metrics')}/metrics", timeout=10).text
    assert f'model_name="{NAME}"' in metrics  # the vllm:* series' label
    assert f'model="{NAME}"' in metrics  # splitserve's own series'
    assert f'model="{tiny_llama_dir.name}"' not in metrics
