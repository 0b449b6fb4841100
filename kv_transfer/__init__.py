"""kv_transfer: moves a request's KV cache from a prefill worker to a decode worker.

Pairwise torch.distributed channels (gloo on CPU, NCCL on CUDA) set up at run time through a
TCPStore hosted by the decode worker; a fixed-size header frames each contiguous payload.
"""

from kv_transfer.auth import KVAuthError
from kv_transfer.buffer_pool import KVBufferPool
from kv_transfer.channel import KVChannelError
from kv_transfer.header import (
    HEADER_NBYTES,
    HEADER_WORDS,
    MAX_KEY_BYTES,
    HeaderError,
    HeaderFlag,
    KVHeader,
    decode_header,
    encode_header,
    transfer_key,
)
from kv_transfer.layout import KV_LAYOUT_VERSION, KVLayout, LayoutMismatchError
from kv_transfer.receiver import KVReceiver
from kv_transfer.sender import KVQueueFullError, KVSender, TransferResult
from kv_transfer.sender_pool import KVSenderLimitError, KVSenderPool
from kv_transfer.stats import KVStats, KVStatsSnapshot

__all__ = [
    "HEADER_NBYTES",
    "HEADER_WORDS",
    "KV_LAYOUT_VERSION",
    "MAX_KEY_BYTES",
    "HeaderError",
    "HeaderFlag",
    "KVAuthError",
    "KVBufferPool",
    "KVChannelError",
    "KVHeader",
    "KVLayout",
    "KVQueueFullError",
    "KVReceiver",
    "KVSender",
    "KVSenderLimitError",
    "KVSenderPool",
    "KVStats",
    "KVStatsSnapshot",
    "LayoutMismatchError",
    "TransferResult",
    "decode_header",
    "encode_header",
    "transfer_key",
]
