"""The pool of KV blocks: reference counts, the free blocks in the order they go out, and the hash → block map.

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
    """Owns every block. A free block is handed out in this order:

    1. a block used before that holds nothing cached, the most recently freed first;
    2. a block never used yet, the lowest id first;
    3. a cached block (evictable), the least recently freed first: evicting it loses its prefix-cache entry.

    Blocks used before come before fresh ones because a fresh block's memory may not be mapped yet: on a CPU the KV
    cache is allocated untouched, and the first write to each of its 2 MiB pages (one per layer's K and V) maps and
    zeroes it in the step that writes it. Handing out fresh blocks first (one queue, oldest first) walked every
    workload through the whole cache: on 2 Zen 3 cores a batch-1 decode step took 166-168 ms instead of 6.5 ms each
    time the walk crossed into new pages. Cached blocks still go last, in LRU order, as in vLLM's free queue.
    """

    def __init__(self, num_blocks: int) -> None:
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {num_blocks}")
        self.num_blocks = num_blocks
        self.blocks = [KVBlock(i) for i in range(num_blocks)]
        self.reusable: list[KVBlock] = []  # used before, nothing cached: a stack (last freed on top)
        self.fresh: list[int] = list(range(num_blocks - 1, -1, -1))  # never used: a stack, lowest id on top
        # cached and free (evictable), block_id → block, oldest first: the front is evicted first.
        self.free_queue: OrderedDict[int, KVBlock] = OrderedDict()
        self.cached_blocks: dict[BlockHash, KVBlock] = {}

    @property
    def num_free_blocks(self) -> int:
        """Blocks with no owner (including evictable cached ones)."""
        return len(self.reusable) + len(self.fresh) + len(self.free_queue)

    def free_order(self) -> list[int]:
        """The free blocks' ids in the order ``get_new_blocks`` hands them out."""
        return [b.block_id for b in reversed(self.reusable)] + self.fresh[::-1] + list(self.free_queue)

    def get_cached_block(self, block_hash: BlockHash) -> KVBlock | None:
        """The cached block holding exactly this hash chain, if any."""
        return self.cached_blocks.get(block_hash)

    def get_new_blocks(self, num_blocks: int) -> list[KVBlock]:
        """Take ``num_blocks`` free blocks in the class's order (evicting cached ones last). Mutates ref counts."""
        if num_blocks > self.num_free_blocks:
            raise ValueError(f"asked for {num_blocks} blocks, {self.num_free_blocks} free")
        taken = []
        for _ in range(num_blocks):
            block = self._next_free()
            block.ref_cnt = 1
            taken.append(block)
        return taken

    def _next_free(self) -> KVBlock:
        if self.reusable:
            return self.reusable.pop()
        if self.fresh:
            return self.blocks[self.fresh.pop()]
        _, block = self.free_queue.popitem(last=False)
        self._evict(block)
        return block

    def touch(self, blocks: Iterable[KVBlock]) -> None:
        """Take a reference on cached blocks (a prefix-cache hit); removes free ones from the free queue."""
        for block in blocks:
            if block.ref_cnt == 0:
                del self.free_queue[block.block_id]
            block.ref_cnt += 1

    def free_blocks(self, ordered_blocks: Iterable[KVBlock]) -> None:
        """Drop one reference from each block. A block reaching zero, in the given order: a cached one joins the
        free queue's end, any other goes on top of the reusable stack."""
        for block in ordered_blocks:
            if block.ref_cnt <= 0:
                raise RuntimeError(f"double free of block {block.block_id}")
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                if block.block_hash is not None:
                    self.free_queue[block.block_id] = block
                else:
                    self.reusable.append(block)

    def cache_block(self, block: KVBlock, block_hash: BlockHash) -> None:
        """Record a full block under its hash (first writer wins on a duplicate hash)."""
        if block.block_hash is not None:
            return
        if block_hash in self.cached_blocks:
            return
        block.block_hash = block_hash
        self.cached_blocks[block_hash] = block

    def evict_all_cached(self) -> int:
        """Forget every evictable cached block (e.g. on a cache reset); returns how many were dropped. They become
        reusable, oldest deepest in the stack."""
        dropped = list(self.free_queue.values())
        self.free_queue.clear()
        for block in dropped:
            self._evict(block)
        self.reusable[:0] = dropped
        return len(dropped)

    def _evict(self, block: KVBlock) -> None:
        if block.block_hash is not None:
            if self.cached_blocks.get(block.block_hash) is block:
                del self.cached_blocks[block.block_hash]
            block.block_hash = None

    def check_invariants(self) -> None:
        """Assert the pool's books balance (called by tests after every operation)."""
        in_use = sum(1 for b in self.blocks if b.ref_cnt > 0)
        order = self.free_order()
        assert in_use + len(order) == self.num_blocks, "free + in use != total"
        assert len(set(order)) == len(order), "a block free twice"
        assert all(b.ref_cnt >= 0 for b in self.blocks), "negative ref count"
        free = [self.blocks[i] for i in order]
        assert all(b.ref_cnt == 0 for b in free), "owned block among the free"
        assert all(b.block_hash is not None for b in self.free_queue.values()), "uncached block in the free queue"
        assert all(b.block_hash is None for b in self.reusable), "cached block among the reusable"
        assert all(self.blocks[i].block_hash is None for i in self.fresh), "cached block among the fresh"
        for block_hash, block in self.cached_blocks.items():
            assert block.block_hash == block_hash, "hash map out of sync"
