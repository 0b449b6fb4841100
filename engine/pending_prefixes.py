"""Decode role: the prompt blocks reserved for KV still on its way, which a later reservation
of the same prefix adopts instead of having that KV sent again."""

from __future__ import annotations

from engine.block_pool import KVCacheBlock
from engine.kv_cache_manager import KVCacheManager
from engine.request import Request


class PendingPrefixes:
    """Full prompt blocks reserved (with reuse_cached_prefix) for KV not yet landed, by hash:
    the block, its tokens (compared, never trusted to the hash alone) and the request it was
    reserved for, its owner. Twelve chats sent together behind a new 1,100-token system prompt
    each had its whole KV (25 MB) gathered, sent and written, the prefix twelve times; adopted,
    each gets only its own blocks. Owned by the scheduler (the engine thread)."""

    def __init__(self, kv: KVCacheManager) -> None:
        self.kv = kv
        self._blocks: dict[int, tuple[KVCacheBlock, tuple[int, ...], str]] = {}
        self._by_owner: dict[str, list[int]] = {}
        self._followers: dict[str, set[str]] = {}  # owner -> requests that adopted its blocks

    def __bool__(self) -> bool:
        return bool(self._blocks)

    def adopt(self, request: Request, hits: list[KVCacheBlock]) -> set[str]:
        """Extends `hits` (the request's cached prefix) with the pending blocks that follow it,
        never the prompt's last token's block; returns the owners of those it took, whose KV
        the request waits for once reserved (follow)."""
        bs = self.kv.block_size
        last = min(len(request.block_hashes), (request.num_tokens - 1) // bs)
        owners: set[str] = set()
        i = len(hits)
        while i < last:
            entry = self._blocks.get(request.block_hashes[i])
            if entry is None or entry[1] != tuple(request.all_token_ids[i * bs:(i + 1) * bs]):
                break
            hits.append(entry[0])
            owners.add(entry[2])
            i += 1
        return owners

    def follow(self, request_id: str, owners: set[str]) -> None:
        """The request reserved the blocks it adopted from `owners` (settle returns it)."""
        for owner in owners:
            self._followers.setdefault(owner, set()).add(request_id)

    def add(self, request: Request, first: int) -> None:
        """The request's full prompt blocks from `first` on (those it did not adopt) become
        adoptable until its KV lands (settle)."""
        if not self.kv.enable_prefix_caching:
            return
        bs = self.kv.block_size
        blocks = self.kv.blocks(request.request_id)
        added = []
        for i in range(first, min(len(request.block_hashes), request.num_prompt_tokens // bs)):
            block_hash = request.block_hashes[i]
            if block_hash not in self._blocks:
                self._blocks[block_hash] = (
                    blocks[i], tuple(request.all_token_ids[i * bs:(i + 1) * bs]),
                    request.request_id)
                added.append(block_hash)
        if added:
            self._by_owner[request.request_id] = added

    def settle(self, owner_id: str) -> list[str]:
        """The owner's KV landed, or never will: its blocks are no longer adoptable. Returns
        the requests that adopted them, in a fixed order."""
        for block_hash in self._by_owner.pop(owner_id, ()):
            self._blocks.pop(block_hash, None)
        return sorted(self._followers.pop(owner_id, ()))
