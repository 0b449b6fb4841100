"""KVHeader wire format: exact round trips and refusal of every malformed frame."""

from __future__ import annotations

import pytest
import torch
from kv_raw_peer import forged_frame

from kv_transfer import HEADER_NBYTES, HEADER_WORDS, HeaderError, HeaderFlag, KVHeader, KVLayout
from kv_transfer.header import decode_header, encode_header, header_from_bytes, header_to_bytes

LAYOUT = KVLayout(num_layers=28, num_kv_heads=8, head_dim=128, block_size=16, dtype="bfloat16")


def header(**overrides) -> KVHeader:
    fields = dict(
        request_key="chatcmpl-42",
        num_tokens=1000,
        num_blocks=63,
        first_token=128_000,
        layout=LAYOUT,
        seq=7,
    )
    return KVHeader(**{**fields, **overrides})


def test_header_is_a_fixed_size_int64_tensor_that_round_trips_every_field():
    original = header()
    frame = encode_header(original)
    assert frame.dtype == torch.int64 and frame.shape == (HEADER_WORDS,)
    assert decode_header(frame) == original
    assert len(header_to_bytes(original)) == HEADER_NBYTES
    assert header_from_bytes(header_to_bytes(original)) == original


@pytest.mark.parametrize("key", ["", "a", "é" * 32, "🦙" * 16, "x" * 64])
def test_keys_up_to_64_utf8_bytes_round_trip_exactly(key):
    h = header(request_key=key, flags=HeaderFlag.HEARTBEAT, num_blocks=0, num_tokens=0)
    assert decode_header(encode_header(h)).request_key == key


@pytest.mark.parametrize("key", ["x" * 65, "é" * 33])
def test_key_longer_than_64_utf8_bytes_is_refused(key):
    with pytest.raises(HeaderError, match="at most 64"):
        encode_header(header(request_key=key))


def test_control_frames_round_trip_and_carry_no_payload():
    for flag in (HeaderFlag.ABORT, HeaderFlag.HEARTBEAT, HeaderFlag.CLOSE):
        h = header(flags=flag, num_blocks=0, num_tokens=0, first_token=-1)
        assert decode_header(encode_header(h)) == h
        assert h.payload_nbytes == 0
    with pytest.raises(HeaderError, match="num_blocks must be 0"):
        encode_header(header(flags=HeaderFlag.ABORT))


@pytest.mark.parametrize(
    "overrides, message",
    [
        ({"request_key": ""}, "non-empty request_key"),
        ({"num_blocks": -1}, ">= 0"),
        ({"num_tokens": 63 * 16 + 1}, "does not fit"),
    ],
)
def test_invalid_fields_are_refused_when_encoding(overrides, message):
    with pytest.raises(HeaderError, match=message):
        encode_header(header(**overrides))


def test_any_corrupted_word_is_caught_by_the_checksum():
    frame = encode_header(header())
    for word in range(1, HEADER_WORDS):
        damaged = frame.clone()
        damaged[word] += 1
        with pytest.raises(HeaderError):
            decode_header(damaged)


def test_frames_from_something_else_are_refused():
    frame = encode_header(header())
    not_ours = frame.clone()
    not_ours[0] = 0
    with pytest.raises(HeaderError, match="magic"):
        decode_header(not_ours)
    with pytest.raises(HeaderError, match="32 int64 words"):
        decode_header(frame[:16])
    with pytest.raises(HeaderError, match="int64"):
        decode_header(frame.to(torch.float64))
    with pytest.raises(HeaderError, match="bytes"):
        header_from_bytes(b"\0" * 100)


@pytest.mark.parametrize("flags", [3, 5, 8, 1 << 40, -1])
def test_a_frame_is_exactly_one_kind_unknown_or_combined_flags_are_refused(flags):
    frame = forged_frame(header(num_blocks=0, num_tokens=0), flags=flags)
    with pytest.raises(HeaderError, match="unknown header flags"):
        header_from_bytes(frame)
