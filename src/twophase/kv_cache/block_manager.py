"""Block tables per request over a shared BlockPool, with prefix caching of full blocks."""

from __future__ import annotations

from dataclasses import dataclass

from twophase.kv_cache.block_pool import BlockHash, BlockPool, KVBlock, hash_block_tokens
from twophase.request import Request


@dataclass
class PrefixCacheStats:
    """Prompt tokens looked up in the prefix cache and tokens found there."""

    num_queries: int = 0
    num_hits: int = 0
    num_resets: int = 0


class BlockManager:
    """Allocates, caches and frees the blocks of each request. Mutates the pool and its own tables only."""

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True) -> None:
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.pool = BlockPool(num_blocks)
        self.req_to_blocks: dict[str, list[KVBlock]] = {}
        self.req_to_hashes: dict[str, list[BlockHash]] = {}
        self.num_cached_blocks: dict[str, int] = {}  # how many of a request's leading blocks are cached
        self.stats = PrefixCacheStats()

    @property
    def num_blocks(self) -> int:
        """Total blocks in the pool."""
        return self.pool.num_blocks

    @property
    def num_blocks_in_use(self) -> int:
        """Blocks owned by at least one request."""
        return self.pool.num_blocks - self.pool.num_free_blocks

    @property
    def usage(self) -> float:
        """Fraction of blocks owned by requests (0..1)."""
        return self.num_blocks_in_use / self.pool.num_blocks

    def num_blocks_for(self, num_tokens: int) -> int:
        """Blocks needed to hold num_tokens tokens."""
        return -(-num_tokens // self.block_size)

    def block_ids(self, request_id: str) -> list[int]:
        """The request's block table."""
        return [b.block_id for b in self.req_to_blocks.get(request_id, [])]

    def get_computed_blocks(self, request: Request) -> tuple[list[KVBlock], int]:
        """Longest cached prefix of the request's tokens: (blocks, number of tokens they hold).

        Never covers the last known token, so the first output token always has logits. Reads only.
        """
        if not self.enable_prefix_caching:
            return [], 0
        hashes = self._block_hashes(request)
        max_blocks = (request.num_tokens - 1) // self.block_size
        hit: list[KVBlock] = []
        for block_hash in hashes[:max_blocks]:
            block = self.pool.get_cached_block(block_hash)
            if block is None:
                break
            hit.append(block)
        return hit, len(hit) * self.block_size

    def record_lookup(self, num_query_tokens: int, num_hit_tokens: int) -> None:
        """Count one admission's prefix-cache lookup."""
        self.stats.num_queries += num_query_tokens
        self.stats.num_hits += num_hit_tokens

    def allocate_slots(
        self, request: Request, num_new_tokens: int, new_computed_blocks: list[KVBlock] | None = None,
        cache: bool = True,
    ) -> bool:
        """Give the request blocks for ``num_computed_tokens + num_new_tokens`` tokens.

        ``new_computed_blocks`` are prefix-cache hits to adopt first (the caller has already counted their
        tokens in ``request.num_computed_tokens``). Returns False, changing nothing, when the pool is short.
        Full blocks whose tokens are now known are cached, unless ``cache`` is False (blocks whose K/V will
        arrive later, from a remote worker: ``cache_blocks`` once they are written).
        """
        new_computed_blocks = new_computed_blocks or []
        blocks = self.req_to_blocks.setdefault(request.request_id, [])
        num_required = self.num_blocks_for(request.num_computed_tokens + num_new_tokens)
        num_fresh = max(0, num_required - len(blocks) - len(new_computed_blocks))
        num_evictable_hits = sum(1 for b in new_computed_blocks if b.ref_cnt == 0)
        if num_fresh + num_evictable_hits > self.pool.num_free_blocks:
            if not blocks:
                del self.req_to_blocks[request.request_id]
            return False
        self.pool.touch(new_computed_blocks)
        blocks.extend(new_computed_blocks)
        blocks.extend(self.pool.get_new_blocks(num_fresh))
        self.num_cached_blocks.setdefault(request.request_id, 0)
        if new_computed_blocks:
            self.num_cached_blocks[request.request_id] = len(blocks) - num_fresh
        if cache:
            # only blocks of known tokens are cached: proposals (speculative decoding) may be rejected
            self._cache_full_blocks(request, min(request.num_computed_tokens + num_new_tokens, request.num_tokens))
        return True

    def cache_blocks(self, request: Request, num_tokens: int) -> None:
        """Cache the request's full blocks among its first ``num_tokens`` tokens (their K/V are now written)."""
        self._cache_full_blocks(request, num_tokens)

    def trim(self, request: Request, num_tokens: int) -> None:
        """Free the request's blocks past those holding ``num_tokens`` tokens (slots of rejected proposals)."""
        blocks = self.req_to_blocks.get(request.request_id)
        keep = self.num_blocks_for(num_tokens)
        if blocks and len(blocks) > keep:
            self.pool.free_blocks(reversed(blocks[keep:]))
            del blocks[keep:]

    def free(self, request: Request) -> None:
        """Release every block of the request, tail first so tails are evicted before shared prefixes."""
        blocks = self.req_to_blocks.pop(request.request_id, [])
        self.pool.free_blocks(reversed(blocks))
        self.num_cached_blocks.pop(request.request_id, None)
        self.req_to_hashes.pop(request.request_id, None)

    def reset_prefix_cache(self) -> int:
        """Drop every evictable cached block; returns how many."""
        self.stats.num_resets += 1
        return self.pool.evict_all_cached()

    def _block_hashes(self, request: Request) -> list[BlockHash]:
        """Hash chain of the request's full blocks of known tokens (extended incrementally)."""
        hashes = self.req_to_hashes.setdefault(request.request_id, [])
        num_full = request.num_tokens // self.block_size
        if len(hashes) < num_full:
            token_ids = request.all_token_ids
            bs = self.block_size
            for i in range(len(hashes), num_full):
                parent = hashes[i - 1] if i else None
                hashes.append(hash_block_tokens(parent, token_ids[i * bs : (i + 1) * bs], request.cache_salt))
        return hashes

    def _cache_full_blocks(self, request: Request, num_tokens: int) -> None:
        if not self.enable_prefix_caching:
            return
        num_full = num_tokens // self.block_size
        start = self.num_cached_blocks[request.request_id]
        if num_full <= start:
            return
        hashes = self._block_hashes(request)
        blocks = self.req_to_blocks[request.request_id]
        for i in range(start, num_full):
            self.pool.cache_block(blocks[i], hashes[i])
        self.num_cached_blocks[request.request_id] = num_full

    def check_invariants(self, live_request_ids: set[str] | None = None) -> None:
        """Assert pool invariants, and (given the live requests) that no other request holds blocks."""
        self.pool.check_invariants()
        owned: dict[int, int] = {}
        for blocks in self.req_to_blocks.values():
            for b in blocks:
                owned[b.block_id] = owned.get(b.block_id, 0) + 1
        for block in self.pool.blocks:
            assert block.ref_cnt == owned.get(block.block_id, 0), f"block {block.block_id} ref count mismatch"
        if live_request_ids is not None:
            stale = set(self.req_to_blocks) - live_request_ids
            assert not stale, f"finished requests still hold blocks: {sorted(stale)}"
