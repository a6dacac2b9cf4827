"""The pool of KV blocks: reference counts, an LRU queue of free blocks, and the hash → block map.

No torch here: a block is an id; the tensors that hold its K/V live in the model runner.
"""

from __future__ import annotations

import hashlib
import struct
from collections import OrderedDict
from dataclasses import dataclass
from typing import Iterable, Sequence

BlockHash = bytes


def hash_block_tokens(parent_hash: BlockHash | None, token_ids: Sequence[int], cache_salt: str | None) -> BlockHash:
    """SHA-256 chaining the parent block's hash, this block's token ids and the request's cache salt."""
    digest = hashlib.sha256()
    digest.update(parent_hash or b"root")
    digest.update(struct.pack(f"<{len(token_ids)}q", *token_ids))
    digest.update(b"salt:" + (cache_salt or "").encode())
    return digest.digest()


@dataclass
class KVBlock:
    """One fixed-size block of KV slots. ``block_hash`` is set only while the block is full and cached."""

    block_id: int
    ref_cnt: int = 0
    block_hash: BlockHash | None = None


class BlockPool:
    """Owns every block. Free blocks sit in LRU order; a free block may still be cached (evictable)."""

    def __init__(self, num_blocks: int) -> None:
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {num_blocks}")
        self.num_blocks = num_blocks
        self.blocks = [KVBlock(i) for i in range(num_blocks)]
        # block_id → block, oldest first: the front is evicted first.
        self.free_queue: OrderedDict[int, KVBlock] = OrderedDict((b.block_id, b) for b in self.blocks)
        self.cached_blocks: dict[BlockHash, KVBlock] = {}

    @property
    def num_free_blocks(self) -> int:
        """Blocks with no owner (including evictable cached ones)."""
        return len(self.free_queue)

    def get_cached_block(self, block_hash: BlockHash) -> KVBlock | None:
        """The cached block holding exactly this hash chain, if any."""
        return self.cached_blocks.get(block_hash)

    def get_new_blocks(self, num_blocks: int) -> list[KVBlock]:
        """Take blocks from the front of the free queue (evicting their cache entries). Mutates ref counts."""
        if num_blocks > len(self.free_queue):
            raise ValueError(f"asked for {num_blocks} blocks, {len(self.free_queue)} free")
        taken = []
        for _ in range(num_blocks):
            _, block = self.free_queue.popitem(last=False)
            self._evict(block)
            block.ref_cnt = 1
            taken.append(block)
        return taken

    def touch(self, blocks: Iterable[KVBlock]) -> None:
        """Take a reference on cached blocks (a prefix-cache hit); removes them from the free queue."""
        for block in blocks:
            if block.ref_cnt == 0:
                del self.free_queue[block.block_id]
            block.ref_cnt += 1

    def free_blocks(self, ordered_blocks: Iterable[KVBlock]) -> None:
        """Drop one reference from each block; blocks reaching zero join the queue's end in the given order."""
        for block in ordered_blocks:
            if block.ref_cnt <= 0:
                raise RuntimeError(f"double free of block {block.block_id}")
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                self.free_queue[block.block_id] = block

    def cache_block(self, block: KVBlock, block_hash: BlockHash) -> None:
        """Record a full block under its hash (first writer wins on a duplicate hash)."""
        if block.block_hash is not None:
            return
        if block_hash in self.cached_blocks:
            return
        block.block_hash = block_hash
        self.cached_blocks[block_hash] = block

    def evict_all_cached(self) -> int:
        """Forget every evictable cached block (e.g. on a cache reset); returns how many were dropped."""
        dropped = [b for b in self.free_queue.values() if b.block_hash is not None]
        for block in dropped:
            self._evict(block)
        return len(dropped)

    def _evict(self, block: KVBlock) -> None:
        if block.block_hash is not None:
            if self.cached_blocks.get(block.block_hash) is block:
                del self.cached_blocks[block.block_hash]
            block.block_hash = None

    def check_invariants(self) -> None:
        """Assert the pool's books balance (called by tests after every operation)."""
        in_use = sum(1 for b in self.blocks if b.ref_cnt > 0)
        assert in_use + len(self.free_queue) == self.num_blocks, "free + in use != total"
        assert all(b.ref_cnt >= 0 for b in self.blocks), "negative ref count"
        assert all(b.ref_cnt == 0 for b in self.free_queue.values()), "owned block in free queue"
        for block_hash, block in self.cached_blocks.items():
            assert block.block_hash == block_hash, "hash map out of sync"
