"""A request's body as the API routes read it: JSON only, uncompressed, framed one way, at most
--max-body-bytes, all in within --request-read-timeout-s, and within --max-buffered-body-bytes
of every body this gateway is receiving at the time."""

from __future__ import annotations

import asyncio
import dataclasses

from starlette.requests import ClientDisconnect, Request

from services.gateway.api.streaming import ClientDisconnected
from services.gateway.errors import APIError


class BodiesInFlight:
    """Bytes of the request bodies being received, all requests together (event loop only)."""

    def __init__(self) -> None:
        self.bytes = 0


async def read_body(request: Request, config, bodies: BodiesInFlight) -> bytes:
    """The body; APIError (413, 408, 415, 400, or 503 past the shared budget) otherwise, and
    ClientDisconnected for a client that left mid-upload. `config`: the GatewayConfig."""
    check_body_headers(request.headers)
    limit = config.max_body_bytes
    length = request.headers.get("content-length", "")
    if length.isdigit() and int(length) > limit:
        raise APIError.too_large(limit)
    chunks, size = [], 0
    try:
        async with asyncio.timeout(config.request_read_timeout_s or None):
            async for chunk in request.stream():
                size += len(chunk)
                if size > limit:
                    raise APIError.too_large(limit)
                if bodies.bytes + len(chunk) > config.max_buffered_body_bytes:
                    raise dataclasses.replace(APIError.overloaded(
                        "This gateway is receiving too many request bodies at once; retry."),
                        close=True)
                bodies.bytes += len(chunk)
                chunks.append(chunk)
    except TimeoutError:
        raise APIError.body_timeout(config.request_read_timeout_s) from None
    except ClientDisconnect:
        raise ClientDisconnected() from None
    finally:
        bodies.bytes -= sum(map(len, chunks))
    return b"".join(chunks)


def check_body_headers(headers) -> None:
    """JSON only, uncompressed (as vLLM's routes take it). A form or text/plain body is what a
    web page may have a browser send cross-origin without asking first: refused here, it never
    runs a generation on a gateway without API keys. A body framed both by Transfer-Encoding
    and Content-Length is the request-smuggling pattern (a proxy in front may have read it the
    other way): refused, and the connection closed, as RFC 9112 asks."""
    if "transfer-encoding" in headers and "content-length" in headers:
        raise dataclasses.replace(APIError.invalid(
            "A request may not carry both Transfer-Encoding and Content-Length.",
            code="ambiguous_body_length"), close=True)
    encoding = headers.get("content-encoding", "").strip().lower()
    if encoding not in ("", "identity"):
        raise APIError.unsupported_media(
            f"Content-Encoding {encoding!r} is not supported: send the body uncompressed.")
    media = headers.get("content-type", "").split(";")[0].strip().lower()
    if media and media != "application/json" and not media.endswith("+json"):
        raise APIError.unsupported_media(
            f"Content-Type must be application/json, got {media!r} (with curl: "
            "-H 'Content-Type: application/json').")
