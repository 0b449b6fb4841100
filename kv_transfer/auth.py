"""KV channel authentication: a mutual HMAC-SHA256 challenge over the store before any tensor
moves, and a per-channel tag on every doorbell frame so a store client cannot inject one.

Pure functions of bytes and strings (and the error they raise); any thread may call them.
"""

from __future__ import annotations

import hashlib
import hmac
import secrets

from kv_transfer.channel import KVChannelError

NONCE_HEX_CHARS = 64  # 32 random bytes, hex-encoded in the JSON hello and verdict
TAG_NBYTES = 32  # HMAC-SHA256 of a frame, appended to its header bytes on an authenticated channel

# Domain separation: a proof made for one role or purpose never verifies as another.
_RECEIVER_PROOF = b"splitserve-kv-receiver-proof-v1"
_SENDER_PROOF = b"splitserve-kv-sender-proof-v1"
_SESSION_KEY = b"splitserve-kv-session-key-v1"


class KVAuthError(KVChannelError):
    """The peer did not prove it holds the cluster secret (or asked for one this end lacks)."""


def new_nonce() -> str:
    return secrets.token_hex(NONCE_HEX_CHARS // 2)


def is_nonce(value: object) -> bool:
    if not isinstance(value, str) or len(value) != NONCE_HEX_CHARS:
        return False
    try:
        bytes.fromhex(value)
    except ValueError:
        return False
    return True


def _mac(secret: bytes, domain: bytes, *parts: str | int) -> str:
    message = domain + b"".join(b"\n" + str(part).encode() for part in parts)
    return hmac.new(secret, message, hashlib.sha256).hexdigest()


def receiver_proof(secret: bytes, index: int, sender_nonce: str, receiver_nonce: str) -> str:
    """What the decode end shows the prefill end: it holds the secret, for this very hello."""
    return _mac(secret, _RECEIVER_PROOF, index, sender_nonce, receiver_nonce)


def sender_proof(secret: bytes, index: int, sender_nonce: str, receiver_nonce: str,
                 peer_id: str) -> str:
    return _mac(secret, _SENDER_PROOF, index, sender_nonce, receiver_nonce, peer_id)


def proof_ok(expected: str, given: object) -> bool:
    """Constant-time; anything but a string is simply wrong."""
    return isinstance(given, str) and hmac.compare_digest(expected, given)


def session_key(secret: bytes, index: int, sender_nonce: str, receiver_nonce: str) -> bytes:
    """The key that tags this channel's frames; fresh per channel, so a frame recorded on one
    channel never verifies on another."""
    return bytes.fromhex(_mac(secret, _SESSION_KEY, index, sender_nonce, receiver_nonce))


def tag_frame(key: bytes, frame: bytes) -> bytes:
    """The frame as it goes on the doorbell: header bytes followed by their tag. The header's
    sequence number is inside the tagged bytes, so a replayed frame is caught as out of order."""
    return frame + hmac.new(key, frame, hashlib.sha256).digest()


def untag_frame(key: bytes, tagged: bytes, frame_nbytes: int) -> bytes | None:
    """The header bytes of a tagged frame, or None when its length or tag is wrong."""
    if len(tagged) != frame_nbytes + TAG_NBYTES:
        return None
    frame, tag = tagged[:frame_nbytes], tagged[frame_nbytes:]
    if not hmac.compare_digest(hmac.new(key, frame, hashlib.sha256).digest(), tag):
        return None
    return frame
