"""Physical KV blocks: reference counts, the free queue (LRU) and the prefix-cache index.

Imports no torch. Owned by the engine thread; nothing here is thread-safe.
"""

from __future__ import annotations

import functools
import hashlib
import sys
from array import array
from collections import OrderedDict, deque
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

# Block hashes are 16-byte BLAKE2b digests, held as ints (and written as decimal ints in the
# Redis prefix events). Each block's digest covers its parent's digest and its token ids as
# little-endian uint32, so equal hashes mean equal whole prefixes (up to a 2^-128 accident),
# in every process and on every host: a gateway computes the same chain as the workers.
HASH_BYTES = 16
MAX_CACHE_SALT_BYTES = 256
_ROOT_DOMAIN = b"splitserve prefix cache v1\x00"


@functools.lru_cache(maxsize=1024)
def root_hash(cache_salt: str = "") -> int:
    """Parent hash of the first block of a request with this salt. Requests with different
    salts (tenants) share no block hash, so none can hit another's cached blocks."""
    salt = cache_salt.encode()
    if len(salt) > MAX_CACHE_SALT_BYTES:
        raise ValueError(f"cache salt of {len(salt)} bytes; at most {MAX_CACHE_SALT_BYTES}")
    return int.from_bytes(hashlib.blake2b(_ROOT_DOMAIN + salt, digest_size=HASH_BYTES).digest(),
                          "big")


# The unsalted root: requests without a tenant (no API keys configured) all share it.
ROOT_HASH = root_hash("")


def chain_block_hashes(parent_hash: int, token_ids: Sequence[int], block_size: int) -> list[int]:
    """Hashes of every full block of `token_ids` (a trailing partial block gets none), each
    chained from the one before, the first from `parent_hash`. Token ids must lie in
    [0, 2^32); anything else is a ValueError."""
    if block_size < 1:
        raise ValueError(f"block size must be >= 1, got {block_size}")
    num_full = len(token_ids) // block_size
    if num_full == 0:
        return []
    if not 0 <= parent_hash < 1 << (8 * HASH_BYTES):
        raise ValueError(f"parent hash {parent_hash} is not a {HASH_BYTES}-byte digest")
    try:
        # One conversion for the whole prompt; each block hashes a slice of its bytes.
        tokens = array("I", token_ids[: num_full * block_size])
    except (OverflowError, TypeError) as exc:
        raise ValueError(f"token ids must be integers in [0, 2^32) to be hashed: {exc}") from None
    if sys.byteorder == "big":
        tokens.byteswap()
    data = memoryview(tokens).cast("B")
    step = block_size * tokens.itemsize
    blake2b = hashlib.blake2b
    parent = parent_hash.to_bytes(HASH_BYTES, "big")
    hashes: list[int] = []
    for offset in range(0, num_full * step, step):
        digest = blake2b(parent, digest_size=HASH_BYTES)
        digest.update(data[offset : offset + step])
        parent = digest.digest()
        hashes.append(int.from_bytes(parent, "big"))
    return hashes


def hash_block_tokens(parent_hash: int, token_ids: Sequence[int]) -> int:
    """Chained block hash: two blocks match only if all tokens up to and including them match."""
    if not token_ids:
        raise ValueError("a block holds at least one token")
    return chain_block_hashes(parent_hash, token_ids, len(token_ids))[0]


def hash_prompt_blocks(token_ids: Sequence[int], block_size: int, cache_salt: str = "") -> list[int]:
    """Hashes of every full block of `token_ids`, in order, from the salt's root (used by
    routers too)."""
    return chain_block_hashes(root_hash(cache_salt), token_ids, block_size)


@dataclass(eq=False)
class KVCacheBlock:
    block_id: int
    ref_cnt: int = 0
    # Set once the block is full and registered in the prefix cache.
    block_hash: int | None = None
    token_ids: tuple[int, ...] | None = field(default=None, repr=False)


class BlockPool:
    """Invariants: a block is in the free queue iff its ref_cnt is 0; a cached block stays
    findable by hash while free until it is evicted by allocation (oldest-freed first)."""

    def __init__(self, num_blocks: int, enable_caching: bool = True) -> None:
        if num_blocks < 1:
            raise ValueError(f"need at least one KV block, got {num_blocks}")
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self.blocks = [KVCacheBlock(i) for i in range(num_blocks)]
        # Front = next to be reused. OrderedDict gives O(1) removal from the middle on a hit.
        self._free: OrderedDict[int, None] = OrderedDict((i, None) for i in range(num_blocks))
        self._cached: dict[int, KVCacheBlock] = {}
        # (kind, block_hash) events for routers following this worker's prefix cache. A deque:
        # the engine thread appends, a publisher thread pops from the left.
        self.events: deque[tuple[str, int]] = deque(maxlen=1 << 16)
        self.record_events = False
        # Blocks [0, high_water) have been handed out at least once; the free queue starts in
        # id order, so never-used blocks go out lowest id first (engine/kv_prefault.py).
        self.high_water = 0

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    @property
    def num_cached_blocks(self) -> int:
        return len(self._cached)

    def get_cached_block(self, block_hash: int, token_ids: tuple[int, ...]) -> KVCacheBlock | None:
        """A hit requires equal tokens too, so a hash collision can never return wrong KV."""
        block = self._cached.get(block_hash)
        if block is None or block.token_ids != token_ids:
            return None
        return block

    def touch(self, blocks: Iterable[KVCacheBlock]) -> None:
        """Take a reference on (possibly free) cached blocks found by a prefix hit."""
        for block in blocks:
            if block.ref_cnt == 0:
                del self._free[block.block_id]
            block.ref_cnt += 1

    def allocate(self, num_blocks: int) -> list[KVCacheBlock]:
        if num_blocks > len(self._free):
            raise RuntimeError(f"asked for {num_blocks} blocks, {len(self._free)} free")
        blocks = []
        for _ in range(num_blocks):
            block_id, _ = self._free.popitem(last=False)
            block = self.blocks[block_id]
            self.high_water = max(self.high_water, block_id + 1)
            self._evict(block)
            block.ref_cnt = 1
            blocks.append(block)
        return blocks

    def free(self, blocks: Iterable[KVCacheBlock]) -> None:
        """Drop one reference each; blocks reaching zero go to the back of the free queue.
        Callers pass a request's blocks tail first, so its tail is evicted before its head."""
        for block in blocks:
            if block.ref_cnt <= 0:
                raise RuntimeError(f"double free of block {block.block_id}")
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                self._free[block.block_id] = None

    def cache_block(self, block: KVCacheBlock, block_hash: int, token_ids: tuple[int, ...]) -> None:
        """Register a full, computed block. If an identical block is already cached (two
        requests computed the same prefix at once), the first stays the canonical copy."""
        if not self.enable_caching or block.block_hash is not None:
            return
        if block_hash in self._cached:
            return
        block.block_hash = block_hash
        block.token_ids = token_ids
        self._cached[block_hash] = block
        if self.record_events:
            self.events.append(("stored", block_hash))

    def _evict(self, block: KVCacheBlock) -> None:
        if block.block_hash is None:
            return
        if self._cached.get(block.block_hash) is block:
            del self._cached[block.block_hash]
            if self.record_events:
                self.events.append(("evicted", block.block_hash))
        block.block_hash = None
        block.token_ids = None

    def reset_prefix_cache(self) -> int:
        """Forget every free cached block; returns how many were dropped."""
        dropped = 0
        for block_id in self._free:
            block = self.blocks[block_id]
            if block.block_hash is not None:
                self._evict(block)
                dropped += 1
        return dropped
