"""KVHeader: the fixed-size frame (32 little-endian int64 words) that precedes every payload.

It travels as an int64 tensor's bytes; a checksum word catches a desynchronised or torn frame.
"""

from __future__ import annotations

import enum
import hashlib
from dataclasses import dataclass

import torch

from kv_transfer.layout import DTYPE_NAMES, KVLayout

HEADER_WORDS = 32
HEADER_NBYTES = HEADER_WORDS * 8
MAX_KEY_BYTES = 64
# "SSKVHDR1" read as a little-endian int64: recognisable in a hex dump, positive as int64.
MAGIC = int.from_bytes(b"SSKVHDR1", "little")
HEADER_FORMAT = 1

# A request id the header cannot hold verbatim travels as this prefix plus a SHA-256 digest of
# the id. No verbatim key starts with the prefix, so a digest key never names another request.
DIGEST_KEY_PREFIX = "~sha256:"

_MASK64 = (1 << 64) - 1
_KEY_WORDS = MAX_KEY_BYTES // 8
# Word offsets. Append new fields in the reserved range; never move existing ones.
_W_MAGIC, _W_FORMAT, _W_FLAGS, _W_SEQ = 0, 1, 2, 3
_W_NUM_TOKENS, _W_NUM_BLOCKS, _W_FIRST_TOKEN = 4, 5, 6
_W_LAYOUT_VERSION, _W_LAYERS, _W_HEADS, _W_HEAD_DIM, _W_BLOCK_SIZE, _W_DTYPE = 7, 8, 9, 10, 11, 12
_W_KEY_LEN, _W_KEY = 13, 14
_W_RESERVED = _W_KEY + _KEY_WORDS  # 22..30 must be zero
_W_CHECKSUM = HEADER_WORDS - 1


class HeaderError(ValueError):
    """A frame that cannot be a valid header (bad magic, checksum, field or key)."""


class HeaderFlag(enum.IntFlag):
    """Kind of frame. DATA frames carry a payload; the others carry none."""

    DATA = 0
    ABORT = 1  # prefill gave up on this request: decode should free its blocks now
    HEARTBEAT = 2  # idle sender is alive (channel control, never shown to callbacks)
    CLOSE = 4  # sender is closing the channel on purpose: not an error


@dataclass(frozen=True)
class KVHeader:
    """What the receiver learns before the payload: enough to allocate, check and route it."""

    request_key: str
    num_tokens: int
    num_blocks: int
    first_token: int
    layout: KVLayout
    flags: HeaderFlag = HeaderFlag.DATA
    seq: int = 0  # per-channel frame counter; a gap means the channel lost sync

    @property
    def is_data(self) -> bool:
        return self.flags == HeaderFlag.DATA

    @property
    def payload_nbytes(self) -> int:
        return self.layout.payload_nbytes(self.num_blocks) if self.is_data else 0


_FRAME_KINDS = frozenset(int(flag) for flag in HeaderFlag.__members__.values())


def _checksum(words: list[int]) -> int:
    # FNV-1a over whole words: order-sensitive, so swapped or shifted words are caught too.
    h = 0xCBF29CE484222325
    for w in words:
        h = ((h ^ (w & _MASK64)) * 0x100000001B3) & _MASK64
    return h - (1 << 64) if h >= 1 << 63 else h  # store as signed int64


def transfer_key(request_id: str) -> str:
    """The request key a KV transfer carries for `request_id`, for any id: the id itself when
    it fits the header (1..MAX_KEY_BYTES bytes of UTF-8), else a fixed-length key derived from
    its SHA-256 digest. Sender and receiver both call this; the receiver maps the key back to
    the request it reserved blocks for."""
    if not isinstance(request_id, str):
        raise HeaderError(f"request id must be str, got {type(request_id).__name__}")
    raw = request_id.encode("utf-8", "surrogatepass")
    if 0 < len(raw) <= MAX_KEY_BYTES and not request_id.startswith(DIGEST_KEY_PREFIX):
        return request_id
    digest = hashlib.sha256(raw).hexdigest()
    return DIGEST_KEY_PREFIX + digest[: MAX_KEY_BYTES - len(DIGEST_KEY_PREFIX)]


def _encode_key(key: str) -> bytes:
    if not isinstance(key, str):
        raise HeaderError(f"request_key must be str, got {type(key).__name__}")
    raw = key.encode("utf-8")
    if len(raw) > MAX_KEY_BYTES:
        raise HeaderError(
            f"request_key is {len(raw)} bytes of UTF-8; the header holds at most {MAX_KEY_BYTES}"
        )
    return raw


def encode_header(header: KVHeader) -> torch.Tensor:
    """Return the header as a CPU int64 tensor of HEADER_WORDS words."""
    key = _encode_key(header.request_key)
    if header.is_data and not key:
        raise HeaderError("a DATA header needs a non-empty request_key")
    if header.num_blocks < 0 or header.num_tokens < 0:
        raise HeaderError(
            f"num_blocks and num_tokens must be >= 0, got {header.num_blocks}, {header.num_tokens}"
        )
    if not header.is_data and header.num_blocks != 0:
        raise HeaderError(f"a {header.flags!r} header carries no payload; num_blocks must be 0")
    if header.num_tokens > header.num_blocks * header.layout.block_size and header.is_data:
        raise HeaderError(
            f"num_tokens={header.num_tokens} does not fit in num_blocks={header.num_blocks} "
            f"of block_size={header.layout.block_size}"
        )
    layout = header.layout
    words = [0] * HEADER_WORDS
    words[_W_MAGIC] = MAGIC
    words[_W_FORMAT] = HEADER_FORMAT
    words[_W_FLAGS] = int(header.flags)
    words[_W_SEQ] = header.seq
    words[_W_NUM_TOKENS] = header.num_tokens
    words[_W_NUM_BLOCKS] = header.num_blocks
    words[_W_FIRST_TOKEN] = header.first_token
    words[_W_LAYOUT_VERSION] = layout.version
    words[_W_LAYERS] = layout.num_layers
    words[_W_HEADS] = layout.num_kv_heads
    words[_W_HEAD_DIM] = layout.head_dim
    words[_W_BLOCK_SIZE] = layout.block_size
    words[_W_DTYPE] = layout.dtype_code
    words[_W_KEY_LEN] = len(key)
    padded = key.ljust(MAX_KEY_BYTES, b"\0")
    for i in range(_KEY_WORDS):
        words[_W_KEY + i] = int.from_bytes(padded[8 * i : 8 * i + 8], "little", signed=True)
    words[_W_CHECKSUM] = _checksum(words[:_W_CHECKSUM])
    return torch.tensor(words, dtype=torch.int64)


def decode_header(frame: torch.Tensor) -> KVHeader:
    """Parse and validate a header tensor (any device); raise HeaderError on any defect."""
    if frame.dtype != torch.int64 or frame.numel() != HEADER_WORDS:
        raise HeaderError(
            f"header must be {HEADER_WORDS} int64 words, got {frame.numel()} of {frame.dtype}"
        )
    words = [int(w) for w in frame.reshape(-1).tolist()]
    if words[_W_MAGIC] != MAGIC:
        raise HeaderError(
            f"bad header magic {words[_W_MAGIC]:#x}: peer is not speaking kv_transfer"
        )
    if words[_W_CHECKSUM] != _checksum(words[:_W_CHECKSUM]):
        raise HeaderError("header checksum mismatch: frame is corrupt or the channel lost sync")
    if words[_W_FORMAT] != HEADER_FORMAT:
        raise HeaderError(f"header format {words[_W_FORMAT]} unsupported (want {HEADER_FORMAT})")
    if any(words[_W_RESERVED:_W_CHECKSUM]):
        raise HeaderError("reserved header words are non-zero: written by a newer peer?")
    # IntFlag would accept any int (unknown bits, combinations): a frame is exactly one kind.
    if words[_W_FLAGS] not in _FRAME_KINDS:
        raise HeaderError(f"unknown header flags {words[_W_FLAGS]:#x}")
    flags = HeaderFlag(words[_W_FLAGS])
    key_len = words[_W_KEY_LEN]
    if not 0 <= key_len <= MAX_KEY_BYTES:
        raise HeaderError(f"header key length {key_len} out of range 0..{MAX_KEY_BYTES}")
    key_bytes = b"".join(
        (w & _MASK64).to_bytes(8, "little") for w in words[_W_KEY : _W_KEY + _KEY_WORDS]
    )
    try:
        key = key_bytes[:key_len].decode("utf-8")
    except UnicodeDecodeError as exc:
        raise HeaderError("header request key is not valid UTF-8") from exc
    dtype_name = DTYPE_NAMES.get(words[_W_DTYPE])
    if dtype_name is None:
        raise HeaderError(f"unknown dtype code {words[_W_DTYPE]} in header")
    try:
        layout = KVLayout(
            num_layers=words[_W_LAYERS],
            num_kv_heads=words[_W_HEADS],
            head_dim=words[_W_HEAD_DIM],
            block_size=words[_W_BLOCK_SIZE],
            dtype=dtype_name,
            version=words[_W_LAYOUT_VERSION],
        )
    except ValueError as exc:
        raise HeaderError(f"header carries an invalid layout: {exc}") from exc
    header = KVHeader(
        request_key=key,
        num_tokens=words[_W_NUM_TOKENS],
        num_blocks=words[_W_NUM_BLOCKS],
        first_token=words[_W_FIRST_TOKEN],
        layout=layout,
        flags=flags,
        seq=words[_W_SEQ],
    )
    if header.num_blocks < 0 or header.num_tokens < 0:
        raise HeaderError(f"negative num_blocks/num_tokens in header: {header}")
    if not header.is_data and header.num_blocks:
        raise HeaderError(f"{flags!r} header must not announce a payload")
    return header


def header_to_bytes(header: KVHeader) -> bytes:
    """The header's HEADER_NBYTES wire bytes (little-endian int64 words)."""
    return encode_header(header).numpy().tobytes()


def header_from_bytes(raw: bytes) -> KVHeader:
    if len(raw) != HEADER_NBYTES:
        raise HeaderError(f"header frame is {len(raw)} bytes, want {HEADER_NBYTES}")
    return decode_header(torch.frombuffer(bytearray(raw), dtype=torch.int64))
