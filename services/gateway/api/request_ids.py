"""Request ids at the edge: the caller's id (x-request-id, gRPC request_id) is checked against
the length limit (400 over it), made unique, and bounded again for the workers, whose KV
transfer header holds a request key of at most 64 bytes."""

from __future__ import annotations

import hashlib
import uuid

from services.gateway.errors import APIError

# kv_transfer.header.MAX_KEY_BYTES (not imported: kv_transfer imports torch, the gateway must
# not); tests/gateway/test_edge_limits.py checks that the two agree.
KV_KEY_BYTES = 64
# What the gateway appends to a worker request id: the choice index ("-9999", see
# request_limits.MAX_CHOICES_CEILING) and the dispatcher's retry suffix ("-retry1").
WORKER_ID_SUFFIX_ROOM = len("-99999") + len("-retry9")
MAX_WORKER_ID_PREFIX = KV_KEY_BYTES - WORKER_ID_SUFFIX_ROOM
_HASH_CHARS = 16


def gateway_request_id(supplied: str | None, max_length: int, param: str) -> str:
    """The id a request is logged and answered under: the caller's, made unique (a client may
    reuse its ids), or a fresh one. An id over `max_length` characters, or not printable
    ASCII, is a 400: silently replacing it would break the caller's correlation."""
    if not supplied:
        return uuid.uuid4().hex
    if len(supplied) > max_length:
        raise APIError.invalid(
            f"The request id ({param}) has {len(supplied)} characters; this gateway accepts at "
            f"most {max_length} (--max-request-id-length).",
            param=param, code="string_above_max_length")
    if not (supplied.isascii() and supplied.isprintable()):
        raise APIError.invalid(f"The request id ({param}) must be printable ASCII.",
                               param=param, code="invalid_request_id")
    return f"{supplied}-{uuid.uuid4().hex[:8]}"


def worker_request_id(request_id: str) -> str:
    """`request_id` bounded so that it, with the suffixes the gateway adds, fits the KV
    header's key: kept when short enough, else its head plus a hash of the whole (so two long
    ids that share a head still differ, and logs still show where the id came from)."""
    if len(request_id) <= MAX_WORKER_ID_PREFIX:
        return request_id
    digest = hashlib.blake2b(request_id.encode(), digest_size=_HASH_CHARS // 2).hexdigest()
    return f"{request_id[:MAX_WORKER_ID_PREFIX - _HASH_CHARS - 1]}~{digest}"
