"""Fixtures for the gateway tests: a disaggregated stack (prefill + decode + gateway), an
aggregated one (role-both worker + gateway), both session-wide, and extra gateways on demand.
The tiny random model keeps every process cheap."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from fake_workers import FakeServer
from gateway_processes import ServiceProcess, Stack, start_gateway, start_worker
from registry_cluster import Cluster


@pytest.fixture(scope="session")
def disagg_workers(tiny_llama_dir: Path) -> Iterator[tuple[ServiceProcess, ServiceProcess]]:
    prefill = start_worker(tiny_llama_dir, "prefill")
    decode = start_worker(tiny_llama_dir, "decode")
    try:
        prefill.wait_ready()
        decode.wait_ready()
        yield prefill, decode
    finally:
        prefill.stop()
        decode.stop()


@pytest.fixture(scope="session")
def disagg_stack(tiny_llama_dir, disagg_workers) -> Iterator[Stack]:
    prefill, decode = disagg_workers
    gateway = start_gateway(tiny_llama_dir, "--prefill", prefill.address, "--decode", decode.address)
    try:
        yield Stack(gateway, decode, prefill)
    finally:
        gateway.stop()


@pytest.fixture(scope="session")
def agg_stack(tiny_llama_dir: Path) -> Iterator[Stack]:
    worker = start_worker(tiny_llama_dir, "both")
    try:
        worker.wait_ready()
        gateway = start_gateway(tiny_llama_dir, "--worker", worker.address)
        try:
            yield Stack(gateway, worker)
        finally:
            gateway.stop()
    finally:
        worker.stop()


@pytest.fixture(params=["disagg", "agg"])
def stack(request) -> Stack:
    """Runs a test against both deployments."""
    return request.getfixturevalue(f"{request.param}_stack")


@pytest.fixture
def gateway_factory(tiny_llama_dir: Path) -> Iterator:
    """Extra gateways with their own flags (over any workers); stopped after the test."""
    started: list[ServiceProcess] = []

    def start(*args: str) -> ServiceProcess:
        gateway = start_gateway(tiny_llama_dir, *args)
        started.append(gateway)
        return gateway

    yield start
    for gateway in started:
        gateway.stop()


@pytest.fixture
def servers():
    """start(servicer) -> a scripted gRPC worker (fake_workers.FakeServer), stopped after the test."""
    started: list[FakeServer] = []

    def start(servicer) -> FakeServer:
        server = FakeServer(servicer)
        started.append(server)
        return server

    yield start
    for server in started:
        server.stop()


@pytest.fixture
def cluster(tiny_llama_dir, redis_server):
    """Workers and gateways discovering each other through a real Redis (registry_cluster)."""
    cluster = Cluster(tiny_llama_dir, redis_server, ("--num-kv-blocks", "256"))
    try:
        yield cluster
    finally:
        cluster.close()


@pytest.fixture(scope="module")
def engine(tiny_llama_dir):
    """The tiny model in this process (float32): what the stacks' answers are held to."""
    from engine.config import EngineConfig
    from engine.llm_engine import LLMEngine

    return LLMEngine(EngineConfig(model=str(tiny_llama_dir), dtype="float32", num_kv_blocks=64,
                                  num_threads=1))
