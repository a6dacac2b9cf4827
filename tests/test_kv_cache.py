"""Block pool and block manager: exact block ids, ref counts, eviction order, hash chain, salt isolation."""

import pytest

from twophase.kv_cache.block_manager import BlockManager
from twophase.kv_cache.block_pool import BlockPool, hash_block_tokens
from twophase.request import Request
from twophase.sampling_params import SamplingParams


def make_request(rid: str, tokens: list[int], salt: str | None = None) -> Request:
    return Request(rid, tokens, SamplingParams(max_tokens=4), cache_salt=salt)


def admit(bm: BlockManager, req: Request) -> int:
    """Admit like the scheduler does: adopt cached blocks, allocate the rest, mark all tokens computed."""
    hit, num_hit = bm.get_computed_blocks(req)
    req.num_computed_tokens = num_hit
    assert bm.allocate_slots(req, req.num_tokens - num_hit, hit)
    req.num_computed_tokens = req.num_tokens
    bm.check_invariants()
    return num_hit


def test_pool_order_and_double_free():
    pool = BlockPool(4)
    a, b = pool.get_new_blocks(2)
    assert (a.block_id, b.block_id) == (0, 1)
    pool.free_blocks([b, a])
    pool.check_invariants()
    # uncached blocks used before come back first, the last freed first; then the fresh ones, lowest id first
    assert pool.free_order() == [0, 1, 2, 3]
    with pytest.raises(RuntimeError, match="double free"):
        pool.free_blocks([a])
    pool.check_invariants()
    assert [blk.block_id for blk in pool.get_new_blocks(3)] == [0, 1, 2]
    pool.check_invariants()


def test_pool_reuses_used_blocks_before_fresh_ones_and_evicts_cached_ones_last():
    """A workload that frees what it used never walks into fresh blocks (whose memory may be unmapped); cached
    blocks are evicted only when nothing else is free, the least recently freed first."""
    pool = BlockPool(6)
    cached = pool.get_new_blocks(2)  # 0, 1
    for i, blk in enumerate(cached):
        pool.cache_block(blk, bytes([i]) * 32)
    plain = pool.get_new_blocks(2)  # 2, 3
    pool.free_blocks(cached)
    pool.free_blocks(plain)
    pool.check_invariants()
    assert pool.free_order() == [3, 2, 4, 5, 0, 1]
    for _ in range(3):  # allocate and free the same amount again and again: blocks 3 and 2 every time
        again = pool.get_new_blocks(2)
        assert [blk.block_id for blk in again] == [3, 2]
        pool.free_blocks(reversed(again))
    assert pool.get_cached_block(bytes([0]) * 32) is cached[0]
    taken = pool.get_new_blocks(5)  # 3, 2, then the fresh 4, 5, then the oldest cached block, evicted
    assert [blk.block_id for blk in taken] == [3, 2, 4, 5, 0]
    assert pool.get_cached_block(bytes([0]) * 32) is None and pool.get_cached_block(bytes([1]) * 32) is cached[1]
    pool.check_invariants()
    assert pool.evict_all_cached() == 1 and pool.free_order() == [1]
    pool.check_invariants()


def test_hash_chain_depends_on_parent_tokens_and_salt():
    h1 = hash_block_tokens(None, [1, 2], None)
    assert h1 == hash_block_tokens(None, [1, 2], None)
    assert h1 != hash_block_tokens(None, [1, 3], None)
    assert h1 != hash_block_tokens(None, [1, 2], "tenant-a")
    h2 = hash_block_tokens(h1, [3, 4], None)
    assert h2 != hash_block_tokens(hash_block_tokens(None, [9, 9], None), [3, 4], None)
    assert len(h2) == 32  # sha256


def test_allocate_exact_ids_and_free_order():
    bm = BlockManager(num_blocks=8, block_size=4)
    r1 = make_request("r1", list(range(10)))  # 10 tokens → 3 blocks
    admit(bm, r1)
    assert bm.block_ids("r1") == [0, 1, 2]
    assert [b.ref_cnt for b in bm.pool.blocks[:3]] == [1, 1, 1]
    # two full blocks are cached, the partial third is not
    assert bm.pool.blocks[0].block_hash is not None and bm.pool.blocks[1].block_hash is not None
    assert bm.pool.blocks[2].block_hash is None
    bm.free(r1)
    bm.check_invariants(live_request_ids=set())
    # the uncached partial block first, then 3..7 untouched, then the cached 1, 0 (freed tail first)
    assert bm.pool.free_order() == [2, 3, 4, 5, 6, 7, 1, 0]


def test_prefix_hit_shares_blocks_and_counts_refs():
    bm = BlockManager(num_blocks=8, block_size=4)
    r1, r2 = make_request("r1", list(range(10))), make_request("r2", list(range(8)) + [50, 51, 52])
    assert admit(bm, r1) == 0
    assert admit(bm, r2) == 8
    assert bm.block_ids("r2")[:2] == [0, 1]
    assert bm.pool.blocks[0].ref_cnt == 2 and bm.pool.blocks[1].ref_cnt == 2
    assert bm.block_ids("r2")[2] == 3
    bm.free(r1)
    assert bm.pool.blocks[0].ref_cnt == 1
    bm.check_invariants(live_request_ids={"r2"})


def test_last_token_always_computed():
    bm = BlockManager(num_blocks=8, block_size=4)
    admit(bm, make_request("r1", list(range(8))))
    r2 = make_request("r2", list(range(8)))  # identical, exactly two full blocks
    _, num_hit = bm.get_computed_blocks(r2)
    assert num_hit == 4  # not 8: the last token must be computed to get logits


def test_cached_blocks_survive_free_until_evicted_lru():
    bm = BlockManager(num_blocks=4, block_size=4)
    r1 = make_request("r1", list(range(9)))  # 3 blocks: [0, 1] full, [2] partial
    admit(bm, r1)
    bm.free(r1)
    # free order: 2 (used, uncached), 3 (fresh), 1, 0 (cached) → a request needing one new block takes 2; hit kept
    r2 = make_request("r2", list(range(8)) + [7, 7])
    assert admit(bm, r2) == 8
    assert bm.block_ids("r2") == [0, 1, 2]
    bm.free(r2)
    # free order again 2, 3, 1, 0; a 4-block request of other tokens evicts the cached ones last, oldest first
    r3 = make_request("r3", [100 + i for i in range(16)])
    assert admit(bm, r3) == 0
    assert bm.block_ids("r3") == [2, 3, 1, 0]
    assert bm.get_computed_blocks(make_request("r4", list(range(9))))[1] == 0


def test_salt_isolates_tenants():
    bm = BlockManager(num_blocks=8, block_size=4)
    admit(bm, make_request("a", list(range(9)), salt="tenant-a"))
    assert bm.get_computed_blocks(make_request("b", list(range(9)), salt="tenant-b"))[1] == 0
    assert bm.get_computed_blocks(make_request("c", list(range(9)), salt="tenant-a"))[1] == 8
    assert bm.get_computed_blocks(make_request("d", list(range(9))))[1] == 0


def test_allocation_failure_changes_nothing():
    bm = BlockManager(num_blocks=2, block_size=4)
    r1 = make_request("r1", list(range(12)))
    assert not bm.allocate_slots(r1, 12)
    bm.check_invariants(live_request_ids=set())
    assert bm.pool.num_free_blocks == 2


def test_prefix_caching_off_never_hits():
    bm = BlockManager(num_blocks=8, block_size=4, enable_prefix_caching=False)
    admit(bm, make_request("r1", list(range(9))))
    assert bm.get_computed_blocks(make_request("r2", list(range(9))))[1] == 0
    assert not bm.pool.cached_blocks


def test_lookup_stats():
    bm = BlockManager(num_blocks=8, block_size=4)
    bm.record_lookup(10, 8)
    assert (bm.stats.num_queries, bm.stats.num_hits) == (10, 8)
