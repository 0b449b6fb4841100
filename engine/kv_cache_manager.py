"""Maps requests to KV blocks: prefix-cache lookup, slot allocation, caching and freeing.

Imports no torch. Owned by the engine thread (the scheduler calls it).
"""

from __future__ import annotations

from engine.block_pool import BlockPool, KVCacheBlock, chain_block_hashes
from engine.request import Request


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


class KVCacheManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True):
        self.block_size = block_size
        self.pool = BlockPool(num_blocks, enable_caching=enable_prefix_caching)
        self.enable_prefix_caching = enable_prefix_caching
        self._req_blocks: dict[str, list[KVCacheBlock]] = {}
        # How many leading blocks of each request are registered in the prefix cache.
        self._num_cached_blocks: dict[str, int] = {}
        # Prompt tokens looked up / found, once per request (record_prefix_lookup).
        self.prefix_queries = 0
        self.prefix_hits = 0
        # Requests whose blocks hold no real KV (the profiler's): never registered.
        self._uncacheable: set[str] = set()

    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free_blocks

    @property
    def num_blocks(self) -> int:
        return self.pool.num_blocks

    @property
    def usage(self) -> float:
        return 1.0 - self.pool.num_free_blocks / self.pool.num_blocks

    def blocks(self, request_id: str) -> list[KVCacheBlock]:
        return list(self._req_blocks.get(request_id, ()))

    def block_ids(self, request_id: str) -> list[int]:
        return [b.block_id for b in self._req_blocks.get(request_id, ())]

    def _update_block_hashes(self, request: Request) -> None:
        hashes = request.block_hashes
        parent = hashes[-1] if hashes else request.block_hash_root  # the salt's root
        start = len(hashes) * self.block_size
        hashes.extend(chain_block_hashes(parent, request.all_token_ids[start:], self.block_size))

    def get_computed_blocks(self, request: Request) -> tuple[list[KVCacheBlock], int]:
        """Longest cached prefix of the request, in whole blocks. At least one token is left
        uncomputed, because the forward pass must produce logits for the next token. Counts
        nothing: a request blocked at the head of the queue is looked up again every step, so
        the scheduler records the lookup it admits the request with (record_prefix_lookup)."""
        if not self.enable_prefix_caching:
            return [], 0
        self._update_block_hashes(request)
        max_blocks = (request.num_tokens - 1) // self.block_size
        hits: list[KVCacheBlock] = []
        bs = self.block_size
        for i, block_hash in enumerate(request.block_hashes[:max_blocks]):
            tokens = tuple(request.all_token_ids[i * bs : (i + 1) * bs])
            block = self.pool.get_cached_block(block_hash, tokens)
            if block is None:
                break
            hits.append(block)
        return hits, len(hits) * bs

    def blocks_completed(self, request: Request, num_new_tokens: int) -> list[int]:
        """Hashes of the full blocks that the request's next `num_new_tokens` tokens (after
        its computed ones) complete: what cache_blocks registers once they are computed. Empty
        where nothing is registered (prefix caching off, an uncacheable request)."""
        if not self.enable_prefix_caching or request.request_id in self._uncacheable:
            return []
        self._update_block_hashes(request)
        first = request.num_computed_tokens // self.block_size
        return request.block_hashes[first:(request.num_computed_tokens + num_new_tokens)
                                    // self.block_size]

    def computing_blocks(self, request: Request, num_new_tokens: int,
                         ) -> dict[int, tuple[KVCacheBlock, tuple[int, ...]]]:
        """blocks_completed's blocks and their tokens by hash, once the step's slots are
        allocated: the full blocks the request's next `num_new_tokens` tokens complete."""
        blocks = self._req_blocks.get(request.request_id, [])
        bs = self.block_size
        first = request.num_computed_tokens // bs
        return {h: (blocks[i], tuple(request.all_token_ids[i * bs:(i + 1) * bs]))
                for i, h in enumerate(self.blocks_completed(request, num_new_tokens), first)}

    def computing_run(self, request: Request, num_hit_tokens: int,
                      computing: dict[int, tuple[KVCacheBlock, tuple[int, ...]]],
                      ) -> list[KVCacheBlock]:
        """The blocks, one after another, that follow a prefix hit of `num_hit_tokens`
        (block-aligned, from get_computed_blocks) among those a prompt scheduled this step
        computes (`computing`, by hash; tokens compared, as for a cache hit), never the
        prompt's last token's block. A request that takes them reads them in the same step:
        every layer writes the step's K/V before any of its attention reads the cache."""
        if not self.enable_prefix_caching:
            return []
        bs = self.block_size
        last = min(len(request.block_hashes), (request.num_tokens - 1) // bs)
        run: list[KVCacheBlock] = []
        for i in range(num_hit_tokens // bs, last):
            entry = computing.get(request.block_hashes[i])
            if entry is None or entry[1] != tuple(request.all_token_ids[i * bs:(i + 1) * bs]):
                break
            run.append(entry[0])
        return run

    def record_prefix_lookup(self, num_tokens: int, num_hit_tokens: int) -> None:
        """Count one request's lookup in the prefix-cache statistics."""
        if self.enable_prefix_caching:
            self.prefix_queries += num_tokens
            self.prefix_hits += num_hit_tokens

    def exclude_from_prefix_cache(self, request: Request) -> None:
        """Never register this request's blocks: their contents are not its KV."""
        self._uncacheable.add(request.request_id)

    def can_allocate(self, request: Request, num_tokens: int) -> bool:
        needed = cdiv(num_tokens, self.block_size) - len(self._req_blocks.get(request.request_id, ()))
        return needed <= self.pool.num_free_blocks

    def allocate_slots(
        self,
        request: Request,
        num_new_tokens: int,
        new_computed_blocks: list[KVCacheBlock] | None = None,
    ) -> list[int] | None:
        """Make room for `num_new_tokens` more tokens after the computed ones (and after any
        prefix-hit blocks being adopted now). Returns the ids of newly allocated blocks, or
        None, changing nothing, when the pool cannot supply them."""
        new_computed_blocks = new_computed_blocks or []
        blocks = self._req_blocks.get(request.request_id, [])
        num_computed = request.num_computed_tokens + len(new_computed_blocks) * self.block_size
        num_required = cdiv(num_computed + num_new_tokens, self.block_size)
        num_new_blocks = num_required - len(blocks) - len(new_computed_blocks)
        # Adopting a free cached block removes it from the free queue too.
        num_free_hits = sum(1 for b in new_computed_blocks if b.ref_cnt == 0)
        if num_new_blocks > self.pool.num_free_blocks - num_free_hits:
            return None
        self.pool.touch(new_computed_blocks)
        new_blocks = self.pool.allocate(max(num_new_blocks, 0))
        blocks = self._req_blocks.setdefault(request.request_id, blocks)
        blocks.extend(new_computed_blocks)
        blocks.extend(new_blocks)
        if new_computed_blocks:
            self._num_cached_blocks[request.request_id] = len(blocks) - len(new_blocks)
        return [b.block_id for b in new_blocks]

    def cache_blocks(self, request: Request) -> None:
        """Register the request's full blocks whose KV is now computed."""
        rid = request.request_id
        if not self.enable_prefix_caching or rid in self._uncacheable:
            return
        blocks = self._req_blocks.get(rid)
        if not blocks:
            return
        num_full = min(request.num_computed_tokens // self.block_size, len(blocks))
        start = self._num_cached_blocks.get(rid, 0)
        if num_full <= start:
            return
        self._update_block_hashes(request)
        bs = self.block_size
        for i in range(start, num_full):
            tokens = tuple(request.all_token_ids[i * bs : (i + 1) * bs])
            self.pool.cache_block(blocks[i], request.block_hashes[i], tokens)
        self._num_cached_blocks[rid] = num_full

    def trim(self, request: Request, num_tokens: int) -> None:
        """Release blocks past the first `num_tokens` tokens (speculative rollback)."""
        blocks = self._req_blocks.get(request.request_id)
        if not blocks:
            return
        keep = cdiv(num_tokens, self.block_size)
        if keep < len(blocks):
            extra = blocks[keep:]
            del blocks[keep:]
            self.pool.free(reversed(extra))
            cached = self._num_cached_blocks.get(request.request_id, 0)
            self._num_cached_blocks[request.request_id] = min(cached, keep)

    def free(self, request: Request) -> None:
        blocks = self._req_blocks.pop(request.request_id, None)
        self._num_cached_blocks.pop(request.request_id, None)
        self._uncacheable.discard(request.request_id)
        if blocks:
            self.pool.free(reversed(blocks))
