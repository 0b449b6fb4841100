"""Physical KV blocks: reference counts, the free queue (LRU) and the prefix-cache index.

Imports no torch. Owned by the engine thread; nothing here is thread-safe.
"""

from __future__ import annotations

from collections import OrderedDict, deque
from collections.abc import Iterable
from dataclasses import dataclass, field

# Parent hash of the first block of every sequence. Hashes of int tuples are stable across
# processes (no PYTHONHASHSEED salt for ints), so a gateway can compute the same chain.
ROOT_HASH = 0x5EED


def hash_block_tokens(parent_hash: int, token_ids: tuple[int, ...]) -> int:
    """Chained block hash: two blocks match only if all tokens up to and including them match."""
    return hash((parent_hash, token_ids))


def hash_prompt_blocks(token_ids: list[int], block_size: int) -> list[int]:
    """Hashes of every full block of `token_ids`, in order (used by routers too)."""
    hashes: list[int] = []
    parent = ROOT_HASH
    for start in range(0, len(token_ids) - block_size + 1, block_size):
        parent = hash_block_tokens(parent, tuple(token_ids[start : start + block_size]))
        hashes.append(parent)
    return hashes


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
