"""What a KV receiver checks in a hello and in a DATA frame before it trusts or allocates
anything for it. Pure functions; any thread may call them."""

from __future__ import annotations

import json

from kv_transfer.header import MAX_KEY_BYTES, KVHeader
from kv_transfer.layout import KVLayout

MAX_PEER_ID_CHARS = 256


class FrameRefused(ValueError):
    """A hello or frame this receiver will not act on; the message says why."""


def check_hello(raw: bytes, max_bytes: int, num_indices: int) -> dict:
    """The hello as a dict whose `index` (an int below the number of indices handed out so
    far) and `peer_id` (a short str) can be used as they are; FrameRefused otherwise."""
    if len(raw) > max_bytes:
        raise FrameRefused(f"hello of {len(raw)} bytes (at most {max_bytes})")
    try:
        hello = json.loads(raw)
    except (ValueError, UnicodeDecodeError) as exc:
        raise FrameRefused(f"hello is not JSON: {exc}") from None
    if not isinstance(hello, dict):
        raise FrameRefused("hello is not a JSON object")
    index, peer_id = hello.get("index"), hello.get("peer_id")
    # An index nobody was handed (kv/peers counts from 1) would claim a future sender's slot.
    if not isinstance(index, int) or isinstance(index, bool) or not 1 <= index <= num_indices:
        raise FrameRefused(f"hello index {index!r} was never handed out (1..{num_indices})")
    if not isinstance(peer_id, str) or not 0 < len(peer_id) <= MAX_PEER_ID_CHARS:
        raise FrameRefused(f"hello peer_id must be a str of 1..{MAX_PEER_ID_CHARS} chars")
    return hello


def check_data_frame(header: KVHeader, layout: KVLayout, max_blocks: int | None) -> str | None:
    """Why a DATA frame cannot be anyone's KV, or None. The caller adds its own rules (the
    reservation the key names, the vocabulary) on top."""
    key = header.request_key
    if not key or len(key.encode("utf-8")) > MAX_KEY_BYTES:
        return f"request key of {len(key.encode('utf-8'))} bytes (1..{MAX_KEY_BYTES})"
    if header.num_tokens > header.num_blocks * layout.block_size:
        return (f"num_tokens={header.num_tokens} does not fit in num_blocks={header.num_blocks} "
                f"of {layout.block_size} tokens")
    if max_blocks is not None and header.num_blocks > max_blocks:
        return f"num_blocks={header.num_blocks}, more than the {max_blocks} this worker holds"
    return None
