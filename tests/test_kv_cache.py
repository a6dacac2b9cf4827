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


def test_pool_lru_order_and_double_free():
    pool = BlockPool(4)
    a, b = pool.get_new_blocks(2)
    assert (a.block_id, b.block_id) == (0, 1)
    pool.free_blocks([b, a])
    pool.check_invariants()
    # free queue: 2, 3, 1, 0 — the freed blocks go to the back in the given order
    assert list(pool.free_queue) == [2, 3, 1, 0]
    with pytest.raises(RuntimeError, match="double free"):
        pool.free_blocks([a])
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
    # freed tail first: 3..7 untouched, then 2, 1, 0
    assert list(bm.pool.free_queue) == [3, 4, 5, 6, 7, 2, 1, 0]


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
    # free queue: 3, 2, 1, 0 → a new 1-block request takes 3 (uncached), hit still possible
    r2 = make_request("r2", list(range(8)) + [7, 7])
    assert admit(bm, r2) == 8
    assert bm.block_ids("r2") == [0, 1, 3]
    bm.free(r2)
    # queue now: 2, 3, 1, 0; a 4-block request of other tokens evicts everything, oldest first
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
