"""Worker RPCs whose request bytes do not parse: grpc would answer UNKNOWN ("Exception
deserializing request"); registered through `add_servicer`, such a request reaches the
servicer as a MalformedRequest, which it answers with INVALID_ARGUMENT naming the defect.

Pure registration-time code; the parse functions run on the gRPC event loop.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import grpc


@dataclass(frozen=True)
class MalformedRequest:
    """Stands in for a request message that did not parse."""

    error: str


async def refuse_malformed(request: object, context) -> None:
    """Servicers call this first: a MalformedRequest ends the call with INVALID_ARGUMENT."""
    if isinstance(request, MalformedRequest):
        await context.abort(grpc.StatusCode.INVALID_ARGUMENT, request.error)


def _lenient(parse: Callable[[bytes], object], method: str,
             max_bytes: int = 0) -> Callable[[bytes], object]:
    def parse_or_malformed(raw: bytes) -> object:
        if max_bytes and len(raw) > max_bytes:
            return MalformedRequest(f"{method}: the request message is {len(raw)} bytes; at "
                                    f"most {max_bytes} are taken (--max-body-bytes)")
        try:
            return parse(raw)
        except Exception as exc:  # protobuf's DecodeError, or anything a parser raises
            return MalformedRequest(f"{method}: the request message does not parse ({exc})")

    return parse_or_malformed


class _Recorder:
    """Stands in for the server while a generated add_*_to_server registers its handlers."""

    def __init__(self) -> None:
        self.services: list[tuple[str, dict]] = []

    def add_generic_rpc_handlers(self, handlers) -> None:
        pass  # rebuilt from the registered handlers below

    def add_registered_method_handlers(self, service: str, handlers: dict) -> None:
        self.services.append((service, handlers))


def add_servicer(add_to_server: Callable, servicer: object, server: grpc.aio.Server,
                 max_bytes: int = 0) -> None:
    """`add_to_server` (a generated `add_XServicer_to_server`) with lenient request parsing;
    a message over `max_bytes` (0: no bound here) is malformed too."""
    recorder = _Recorder()
    add_to_server(servicer, recorder)
    for service, handlers in recorder.services:
        lenient = {
            name: handler._replace(
                request_deserializer=_lenient(handler.request_deserializer, f"{service}/{name}",
                                              max_bytes))
            for name, handler in handlers.items()
        }
        server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(service, lenient),))
        server.add_registered_method_handlers(service, lenient)
