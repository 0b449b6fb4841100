"""Scripted prefill/decode workers: real gRPC servers in the test process whose answers a
test chooses, for failure paths real workers cannot be made to hit on cue (a worker full,
failing before or after its first token, recomputing a prompt, hanging until cancelled)."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from concurrent import futures

import grpc
from splitserve.v1 import common_pb2, decode_pb2, decode_pb2_grpc, prefill_pb2, prefill_pb2_grpc

FIRST_TOKEN = 300  # what the fake prefill samples
DecodeScript = Callable[[decode_pb2.GenerateRequest, grpc.ServicerContext], Iterator]


def _health(role: str, kv_blocks_free: int) -> common_pb2.HealthResponse:
    return common_pb2.HealthResponse(
        status=common_pb2.HealthResponse.SERVING, role=role, model="tiny",
        stats=common_pb2.WorkerStats(kv_blocks_total=1000, kv_blocks_free=kv_blocks_free),
        kv_endpoint="127.0.0.1:1" if role != "prefill" else "", block_size=16, max_model_len=512,
        worker_id=f"fake-{role}")


def reserved() -> decode_pb2.GenerateResponse:
    return decode_pb2.GenerateResponse(reserved=decode_pb2.Reserved(kv_endpoint="127.0.0.1:1",
                                                                    num_blocks=1))


def delta(token_ids, output_index: int, finish: int = 0) -> decode_pb2.GenerateResponse:
    d = decode_pb2.TokenDelta(token_ids=token_ids, output_index=output_index, finish_reason=finish)
    d.logprobs.extend(common_pb2.TokenLogprob(token_id=t, logprob=-0.5, rank=1) for t in token_ids)
    if finish:
        d.usage.CopyFrom(common_pb2.Usage(completion_tokens=output_index + len(token_ids)))
    return decode_pb2.GenerateResponse(delta=d)


class Recorder:
    """What happened to the calls a fake received; written by gRPC server threads."""

    def __init__(self) -> None:
        self.calls: list = []
        self.ended = threading.Event()  # some call terminated (finished or cancelled)
        self.cancelled = threading.Event()  # some call was cancelled by the caller

    def track(self, request, context) -> None:
        self.calls.append(request)
        context.add_callback(self.ended.set)

    def wait_cancelled(self, context) -> None:
        """Block the calling handler until its caller goes away: the RPC turns inactive, or
        its termination callback runs (whichever gRPC's server threads report first)."""
        gone = threading.Event()
        context.add_callback(gone.set)
        while context.is_active() and not gone.is_set():
            time.sleep(0.005)
        self.cancelled.set()


class FakeDecode(decode_pb2_grpc.DecodeServicer, Recorder):
    def __init__(self, script: DecodeScript, kv_blocks_free: int = 500, role: str = "decode") -> None:
        Recorder.__init__(self)
        self.script = script
        self.health = _health(role, kv_blocks_free)

    def Generate(self, request, context):
        self.track(request, context)
        yield from self.script(request, context, self)

    def Health(self, request, context):
        return self.health


class FakePrefill(prefill_pb2_grpc.PrefillServicer, Recorder):
    def __init__(self, behaviour: str = "ok") -> None:
        Recorder.__init__(self)
        self.behaviour = behaviour  # "ok", "unavailable" or "hang"

    def Prefill(self, request, context):
        self.track(request, context)
        if self.behaviour == "unavailable":
            context.abort(grpc.StatusCode.UNAVAILABLE, "fake prefill failure")
        if self.behaviour == "hang":
            self.wait_cancelled(context)
            return prefill_pb2.PrefillResponse()
        return prefill_pb2.PrefillResponse(
            request_id=request.request_id, num_prompt_tokens=len(request.prompt_token_ids),
            first_token=common_pb2.TokenLogprob(token_id=FIRST_TOKEN, logprob=-0.25, rank=1))

    def Health(self, request, context):
        return _health("prefill", 0)


class FakeServer:
    """One gRPC server on a free port hosting one fake worker."""

    def __init__(self, servicer, address: str = "127.0.0.1:0") -> None:
        """`address`: where to listen (default any free port; a stopped server's address
        starts it again where it was)."""
        self.servicer = servicer
        self.server = grpc.server(futures.ThreadPoolExecutor(max_workers=8))
        if isinstance(servicer, FakeDecode):
            decode_pb2_grpc.add_DecodeServicer_to_server(servicer, self.server)
        else:
            prefill_pb2_grpc.add_PrefillServicer_to_server(servicer, self.server)
        self.address = f"127.0.0.1:{self.server.add_insecure_port(address)}"
        self.server.start()

    def stop(self) -> None:
        self.server.stop(grace=None)


# -- decode scripts ------------------------------------------------------------------------

def streams(token_ids, start_index: int = 1, remote: bool | None = None) -> DecodeScript:
    """Reserve when asked to, then stream `token_ids` from output index `start_index`."""

    def script(request, context, fake):
        if request.remote_prefill:
            yield reserved()
        for i, token in enumerate(token_ids):
            last = i == len(token_ids) - 1
            yield delta([token], start_index + i, common_pb2.FINISH_REASON_LENGTH if last else 0)
    return script


def exhausted() -> DecodeScript:
    def script(request, context, fake):
        context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, "KV cache full: fake")
        yield  # pragma: no cover
    return script


def rejects() -> DecodeScript:
    def script(request, context, fake):
        context.abort(grpc.StatusCode.INVALID_ARGUMENT, "fake: bad sampling parameters")
        yield  # pragma: no cover
    return script


def fails_after(token_ids, start_index: int = 1) -> DecodeScript:
    """Stream some tokens, then die the way a crashed worker's stream does."""

    def script(request, context, fake):
        if request.remote_prefill:
            yield reserved()
        for i, token in enumerate(token_ids):
            yield delta([token], start_index + i)
        time.sleep(0.05)
        context.abort(grpc.StatusCode.UNAVAILABLE, "fake: worker crashed")
    return script


def hangs(after_tokens=(), start_index: int = 1) -> DecodeScript:
    """Reserve (when remote), stream some tokens, then wait until the caller cancels."""

    def script(request, context, fake):
        # This call ends only when its caller goes away. A cancel that comes while gRPC holds
        # the last token sent, before it resumes this generator, never reaches
        # wait_cancelled below (gRPC stops iterating), so the call's end itself counts (the
        # clean-clone CI once saw the call end and no cancel in 15 s).
        context.add_callback(fake.cancelled.set)
        if request.remote_prefill:
            yield reserved()
        for i, token in enumerate(after_tokens):
            yield delta([token], start_index + i)
        fake.wait_cancelled(context)
    return script
