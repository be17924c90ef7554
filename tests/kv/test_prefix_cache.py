"""Automatic prefix caching: hashing, LRU eviction, sharing, isolation, exact outputs."""

from __future__ import annotations

from helpers import greedy, make_engine, random_prompts, run_to_end
from hypothesis import given, settings
from hypothesis import strategies as st

from kvserve.kv.block_pool import BlockPool
from kvserve.kv.hashing import hash_block, hash_blocks, root_hash
from kvserve.kv.manager import KVCacheManager
from kvserve.request import Request
from kvserve.sampling import SamplingParams

BS = 16


def _req(rid: str, tokens: list[int], salt: str | None = None) -> Request:
    return Request(rid, tokens, SamplingParams(), seed=0, max_tokens=8, cache_salt=salt)


def test_hashes_chain_and_depend_on_every_key():
    root = root_hash("model-a", "kv=float32")
    toks = list(range(48))
    hs = hash_blocks(root, toks, BS)
    assert len(hs) == 3 and len(set(hs)) == 3
    assert hs[1] == hash_block(hs[0], toks[16:32])  # chained
    assert hash_blocks(root_hash("model-b", "kv=float32"), toks, BS)[0] != hs[0]
    assert hash_blocks(root_hash("model-a", "kv=int8"), toks, BS)[0] != hs[0]
    assert hash_blocks(root, [99, *toks[1:]], BS)[2] != hs[2]  # a change early changes all
    assert hash_blocks(root, toks + [1] * 15, BS) == hs  # partial blocks are not hashed
    assert root_hash("m", None) == root_hash("m")  # an unset key keeps old hashes


def test_lru_evicts_least_recently_freed_and_lazily():
    pool = BlockPool(4)
    blocks = pool.allocate(4)
    for i, b in enumerate(blocks):
        assert pool.cache(b, bytes([i]) * 16, [i] * BS)
    pool.free([blocks[2], blocks[0], blocks[3], blocks[1]])
    assert pool.num_free == 4 and pool.num_cached == 4  # freed, still findable
    assert pool.lookup(bytes([0]) * 16, [0] * BS) == blocks[0]
    pool.touch([blocks[0]])  # a hit revives block 0: it leaves the free list
    assert pool.ref_count(blocks[0]) == 1 and pool.num_free == 3
    got = pool.allocate(2)  # evicts in free order: 2, then 3
    assert got == [blocks[2], blocks[3]]
    assert pool.lookup(bytes([2]) * 16, [2] * BS) is None
    assert pool.lookup(bytes([1]) * 16, [1] * BS) == blocks[1]
    assert pool.num_evictions == 2
    pool.check_integrity()


def test_hash_collision_is_detected_not_served():
    pool = BlockPool(2)
    (b,) = pool.allocate(1)
    pool.cache(b, b"h" * 16, [1] * BS)
    assert pool.lookup(b"h" * 16, [2] * BS) is None
    assert pool.num_collisions == 1
    # the manager sees a forged collision as a miss too
    kv = KVCacheManager(8, BS, enable_caching=True)
    a = _req("a", list(range(40)))
    kv.allocate_slots(a, 40)
    a.num_computed_tokens = 40
    kv.cache_full_blocks(a)
    other = _req("b", [7] * 40)
    kv._hashes["b"] = kv.block_hashes(a, 2)  # same hashes, different tokens
    assert kv.find_cached_prefix(other) == []
    assert kv.pool.num_collisions == 1


def test_second_request_allocates_only_its_new_blocks():
    kv = KVCacheManager(16, BS, enable_caching=True)
    prefix = list(range(100, 148))  # 3 full blocks
    a = _req("a", [*prefix, 1, 2, 3])
    kv.allocate_slots(a, a.num_tokens)
    a.num_computed_tokens = a.num_tokens
    kv.cache_full_blocks(a)
    b = _req("b", [*prefix, 9, 9, 9, 9, 9])
    hits = kv.find_cached_prefix(b)
    assert hits == kv.block_table("a")[:3]
    free_before = kv.pool.num_free
    new = kv.allocate_slots(b, 5, hits)
    assert len(new) == 1 and kv.pool.num_free == free_before - 1
    assert all(kv.pool.ref_count(x) == 2 for x in hits)
    assert kv.stats.hits == 48 and kv.stats.queries == 51 + 53
    kv.free(a)
    assert all(kv.pool.ref_count(x) == 1 for x in hits)
    kv.free(b)
    assert kv.pool.num_free == 16 and kv.pool.num_cached == 3
    kv.check_integrity()


def test_whole_prompt_hit_leaves_one_token_to_compute():
    kv = KVCacheManager(8, BS, enable_caching=True)
    a = _req("a", list(range(32)))
    kv.allocate_slots(a, 32)
    a.num_computed_tokens = 32
    kv.cache_full_blocks(a)
    assert len(kv.find_cached_prefix(_req("b", list(range(32))))) == 1


def test_salt_isolates_sharing():
    kv = KVCacheManager(8, BS, enable_caching=True)
    a = _req("a", list(range(40)), salt="tenant=x")
    kv.allocate_slots(a, 40)
    a.num_computed_tokens = 40
    kv.cache_full_blocks(a)
    assert kv.find_cached_prefix(_req("b", list(range(40)), salt="tenant=y")) == []
    assert len(kv.find_cached_prefix(_req("c", list(range(40)), salt="tenant=x"))) == 2


ops = st.lists(
    st.tuples(
        st.sampled_from(["admit", "grow", "free", "evict"]),
        st.integers(0, 5),
        st.integers(1, 40),
        st.integers(0, 2),
    ),
    max_size=60,
)


@settings(max_examples=150, deadline=None)
@given(ops)
def test_integrity_under_random_cache_operations(seq):
    """Random admit (with prefix hits from a few shared prefixes) / grow / free / evict
    sequences keep the pool, the hash index and every table consistent."""
    kv = KVCacheManager(12, BS, enable_caching=True)
    prefixes = [list(range(1000 * p, 1000 * p + 48)) for p in range(3)]
    live: dict[str, Request] = {}
    for op, rid_i, n, p in seq:
        rid = str(rid_i)
        if op == "admit" and rid not in live:
            req = _req(rid, prefixes[p][: 16 + n])
            hits = kv.find_cached_prefix(req)
            computed = len(hits) * BS
            if kv.allocate_slots(req, req.num_tokens - computed, hits) is not None:
                req.num_computed_tokens = req.num_tokens
                kv.cache_full_blocks(req)
                live[rid] = req
        elif op == "grow" and rid in live:
            req = live[rid]
            req.output_token_ids.extend([5] * n)
            new = req.num_tokens - req.num_computed_tokens
            if kv.allocate_slots(req, new) is not None:
                req.num_computed_tokens = req.num_tokens
                kv.cache_full_blocks(req)
            else:
                del req.output_token_ids[-n:]
        elif op == "free" and rid in live:
            kv.free(live.pop(rid))
        elif op == "evict":
            kv.reset_prefix_cache()
        kv.check_integrity()
        for req in live.values():
            assert len(kv.block_table(req.request_id)) * BS >= req.num_tokens
    for req in live.values():
        kv.free(req)
    assert kv.pool.num_free == 12
    kv.check_integrity()


def test_engine_prefix_hit_gives_identical_tokens(llama_dir):
    """A second request sharing a 3-block prefix computes only its suffix and produces
    exactly the tokens it produces with prefix caching off."""
    prefix = random_prompts([48], seed=3)[0]
    a, b = [*prefix, *random_prompts([5], seed=4)[0]], [*prefix, *random_prompts([7], seed=5)[0]]
    outs = {}
    for caching in (False, True):
        engine = make_engine(llama_dir, enable_prefix_caching=caching)
        engine.add_request("a", a, greedy(12))
        run_to_end(engine)
        pool = engine.kv.pool
        fresh_before = pool.num_free - pool.num_cached_free
        req = engine.add_request("b", b, greedy(12))
        engine.step()
        if caching:
            assert req.num_cached_tokens == 48
            # 55 tokens = 4 blocks: 3 revived from the cache, 1 newly allocated
            assert fresh_before - (pool.num_free - pool.num_cached_free) == 1
            assert pool.num_evictions == 0
        else:
            assert req.num_cached_tokens == 0
        outs[caching] = run_to_end(engine)["b"]
        engine.check_integrity()
    assert outs[True] == outs[False]
    assert engine.info()["prefix_cache_hits"] == 48


def test_engine_tenant_isolation_and_prompt_logprobs_skip_cache(llama_dir):
    prompt = random_prompts([40], seed=6)[0]
    engine = make_engine(llama_dir, prefix_cache_isolation="tenant")
    engine.add_request("a", prompt, greedy(2), tenant="x")
    run_to_end(engine)
    r = engine.add_request("b", prompt, greedy(2), tenant="y")
    run_to_end(engine)
    assert r.num_cached_tokens == 0
    r = engine.add_request("c", prompt, greedy(2), tenant="x")
    run_to_end(engine)
    assert r.num_cached_tokens == 32
    params = SamplingParams(temperature=0.0, max_tokens=2, prompt_logprobs=0)
    r = engine.add_request("d", prompt, params, tenant="x")
    run_to_end(engine)
    assert r.num_cached_tokens == 0 and len(r.prompt_logprobs) == 40
