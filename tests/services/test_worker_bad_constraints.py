"""A constraint the gateway refuses, sent straight to a worker (a peer that skipped the
gateway's check, or anyone who reaches the internal plane without TLS): the request fails or
ends, the worker lives on and serves the next one. Before, a GBNF grammar naming an undefined
rule, or a JSON schema nested past Python's recursion limit, escaped the grammar compiler on the
engine thread, and the worker process exited with every stream on it."""

from __future__ import annotations

import asyncio

import grpc
import pytest
from splitserve.v1 import common_pb2, prefill_pb2, prefill_pb2_grpc

from splitserve_cli.processes import start_worker
from tests.services.flows import aggregated, greedy

pytestmark = pytest.mark.timeout(180)

DEEP = 3000  # past Python's default recursion limit (1000)
BAD = {
    "undefined_gbnf_rule": common_pb2.StructuredOutput(grammar="root ::= a"),
    "deep_gbnf": common_pb2.StructuredOutput(
        grammar="root ::= " + "(" * DEEP + '"a"' + ")" * DEEP),
    "deep_schema_text": common_pb2.StructuredOutput(json_schema="[" * DEEP + "]" * DEEP),
    "schema_not_json": common_pb2.StructuredOutput(json_schema="{not json"),
}
PROMPT = list(range(10, 30))


@pytest.fixture(scope="module")
def workers(tiny_llama_dir):
    started = [start_worker(role, tiny_llama_dir) for role in ("both", "prefill")]
    try:
        yield started
    finally:
        for worker in started:
            worker.kill()


async def _generate(address: str, sampling) -> str:
    """What the decode stream did: 'ended' (it finished) or the status it failed with."""
    try:
        await aggregated(address, f"bad-{id(sampling)}", PROMPT, sampling)
        return "ended"
    except grpc.aio.AioRpcError as exc:
        return exc.code().name


async def _prefill(address: str, sampling) -> str:
    async with grpc.aio.insecure_channel(address) as channel:
        try:
            await prefill_pb2_grpc.PrefillStub(channel).Prefill(prefill_pb2.PrefillRequest(
                request_id=f"bad-{id(sampling)}", prompt_token_ids=PROMPT, sampling=sampling,
                decode_kv_endpoint=""), timeout=60)
            return "ended"
        except grpc.aio.AioRpcError as exc:
            return exc.code().name


@pytest.mark.parametrize("name", sorted(BAD))
def test_a_bad_constraint_fails_its_request_and_the_worker_lives_on(workers, name):
    both, prefill = workers
    sampling = greedy(4, structured_output=BAD[name])
    outcome = asyncio.run(_generate(both.address, sampling))
    assert outcome in ("ended", "INVALID_ARGUMENT"), outcome
    outcome = asyncio.run(_prefill(prefill.address, sampling))
    assert outcome != "INTERNAL", outcome  # INTERNAL: "engine failure", the loop crashed
    for worker in workers:
        assert worker.process.poll() is None, worker.role
        assert worker.health().status == common_pb2.HealthResponse.SERVING
    assert len(asyncio.run(aggregated(both.address, f"after-{name}", PROMPT, greedy(4)))) == 4
