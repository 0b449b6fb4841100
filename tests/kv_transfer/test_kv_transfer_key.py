"""transfer_key: any request id becomes a key the KV header can hold, the same on both ends."""

from __future__ import annotations

import pytest

from kv_transfer import MAX_KEY_BYTES, HeaderError, KVHeader, KVLayout, transfer_key
from kv_transfer.header import DIGEST_KEY_PREFIX, decode_header, encode_header

LAYOUT = KVLayout(num_layers=28, num_kv_heads=8, head_dim=128, block_size=16, dtype="bfloat16")


def header(request_key: str) -> KVHeader:
    return KVHeader(request_key=request_key, num_tokens=10, num_blocks=1, first_token=3,
                    layout=LAYOUT)


@pytest.mark.parametrize("rid", ["a", "chatcmpl-42", "é" * 32, "x" * 64])
def test_ids_that_fit_the_header_travel_verbatim(rid):
    assert transfer_key(rid) == rid


@pytest.mark.parametrize("rid", ["x" * 65, "é" * 33, "🦙" * 17, "r" * 10_000, "",
                                 DIGEST_KEY_PREFIX + "short"])
def test_other_ids_travel_as_a_fixed_length_digest_key(rid):
    key = transfer_key(rid)
    assert key.startswith(DIGEST_KEY_PREFIX) and len(key.encode()) == MAX_KEY_BYTES
    assert transfer_key(rid) == key  # sender and receiver derive the same key
    h = header(request_key=key)
    assert decode_header(encode_header(h)).request_key == key


def test_long_ids_sharing_their_first_64_bytes_get_different_keys():
    base = "gw-" + "0" * 61  # 64 bytes, then the gateway's suffixes
    keys = {transfer_key(base + suffix) for suffix in ("-p0", "-p1", "-retry1", "-n0")}
    assert len(keys) == 4


def test_a_verbatim_id_never_equals_a_digest_key():
    long_id = "y" * 100
    # Whoever sends the digest key itself as an id is hashed again, not confused with long_id.
    assert transfer_key(transfer_key(long_id)) != transfer_key(long_id)


def test_a_request_id_must_be_text():
    with pytest.raises(HeaderError, match="must be str"):
        transfer_key(b"bytes-id")
