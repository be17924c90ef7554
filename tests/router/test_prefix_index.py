"""The router's prefix index and placement (issue 18), without processes: batches apply in
order, a gap / restart / lossy clear / missed last batch asks for a snapshot, and the
snapshot plus the batches kept meanwhile rebuild the exact view. Placement prefers the
worker holding the prompt until load outweighs it, and never trusts a worker it cannot
match (another tokenizer, tenant-isolated cache, not synced)."""

from __future__ import annotations

from kvserve.kv.events import DEVICE, HOST, BlocksRemoved, BlocksStored, TierCleared
from kvserve.kv.hashing import hash_blocks, root_hash
from kvserve.router.index import Match, PrefixIndex
from kvserve.router.scoring import Placement, PromptInfo
from kvserve.router.workers import Worker
from kvserve.server.kv_events import KVEventBatch, KVSnapshot

H = [bytes([i]) * 16 for i in range(10)]


def _b(seq, *events, instance="i1", node="a"):
    return KVEventBatch(node, instance, seq, list(events))


def _synced(index: PrefixIndex, node="a", seq=0, device=(), host=(), instance="i1"):
    assert index.load_snapshot(
        KVSnapshot(node, instance, seq, {DEVICE: list(device), HOST: list(host)})
    )


def test_batches_apply_in_order_and_gaps_ask_for_a_snapshot():
    ix = PrefixIndex()
    assert ix.on_batch(_b(1, BlocksStored(DEVICE, H[:2])))  # unknown worker: snapshot
    assert ix.match("a", H[:2]).device == 0  # nothing trusted before it
    _synced(ix, seq=0)  # the snapshot predates batch 1, which was kept
    assert ix.match("a", H[:3]).device == 2
    assert not ix.on_batch(_b(2, BlocksRemoved(DEVICE, [H[1]]), BlocksStored(HOST, [H[1]])))
    assert ix.match("a", H[:3]) == Match(device=1, host=1)
    assert not ix.on_batch(_b(2))  # a keepalive naming the last batch: in step
    assert ix.on_batch(_b(4, BlocksStored(DEVICE, [H[5]])))  # 3 was lost
    assert not ix.is_synced("a") and ix.match("a", H[:1]).device == 0
    # the snapshot at 3 plus the kept batch 4 rebuild the view
    _synced(ix, seq=3, device=[H[0], H[2]])
    assert ix.workers["a"].held[DEVICE] == {H[0], H[2], H[5]}


def test_a_lost_last_batch_shows_in_the_next_keepalive():
    ix = PrefixIndex()
    _synced(ix, seq=5)
    assert ix.on_batch(_b(6))  # the publisher is at 6; this router applied 5
    assert not ix.is_synced("a")


def test_a_restarted_worker_and_a_lossy_clear_resync():
    ix = PrefixIndex()
    _synced(ix, seq=3, device=[H[0]])
    assert ix.on_batch(_b(1, BlocksStored(DEVICE, [H[1]]), instance="i2"))
    _synced(ix, seq=0, instance="i2")
    assert ix.workers["a"].held[DEVICE] == {H[1]}
    assert not ix.on_batch(_b(2, TierCleared(DEVICE), instance="i2"))  # a reset: exact
    assert ix.workers["a"].held[DEVICE] == set()
    assert ix.on_batch(_b(3, TierCleared(HOST, lossy=True), instance="i2"))
    assert not ix.is_synced("a")


def test_a_snapshot_with_a_gap_after_it_stays_unsynced():
    ix = PrefixIndex()
    ix.mark_unsynced("a")
    ix.on_batch(_b(7, BlocksStored(DEVICE, [H[3]])))
    assert not ix.load_snapshot(KVSnapshot("a", "i1", 5, {DEVICE: [], HOST: []}))
    assert not ix.is_synced("a")


def _worker(node: str, load: int = 0, fp: str = "tok", **info) -> Worker:
    base = {"cache_keys": ["m", "kv=bf16", "block_size=4"], "block_size": 4, "tokenizer_fp": fp}
    w = Worker(node, f"http://{node}", {**base, **info}, healthy=True)
    w.inflight = load
    return w


def test_placement_weighs_overlap_against_load():
    ix = PrefixIndex()
    ids = list(range(41))  # 10 full blocks usable (one token is always computed)
    chain = hash_blocks(root_hash("m", "kv=bf16", "block_size=4"), ids[:40], 4)
    _synced(ix, "a", device=chain[:8])
    _synced(ix, "b", device=chain[:2], host=chain[2:10])
    p = Placement("prefix", ix, load_weight=10, host_weight=0.5)
    a, b, c = _worker("a"), _worker("b"), _worker("c")
    prompt = PromptInfo({"tok": ids})
    assert p.cached_tokens(a, prompt) == (32, 0)
    assert p.cached_tokens(b, prompt) == (8, 32)
    d = p.choose([a, b, c], "s", prompt)
    assert (d.worker.node_id, d.reason, d.predicted_cached, d.prompt_tokens) == (
        "a",
        "prefix",
        32,
        41,
    )
    a.inflight = 2  # 20 tokens of load: a costs 41-32+20=29, b 41-8-16=17
    assert p.choose([a, b, c], "s", prompt).worker.node_id == "b"
    a.inflight = b.inflight = 5
    d = p.choose([a, b, c], "s", prompt)
    assert d.worker.node_id == "c" and d.reason == "load"
    # another salt is another chain: nothing matches
    assert p.cached_tokens(a, PromptInfo({"tok": ids}, "other")) == (0, 0)


def test_placement_never_trusts_a_worker_it_cannot_match():
    ix = PrefixIndex()
    ids = list(range(17))
    chain = hash_blocks(root_hash("m", "kv=bf16", "block_size=4"), ids[:16], 4)
    for n in "abc":
        _synced(ix, n, device=chain)
    p = Placement("prefix", ix)
    prompt = PromptInfo({"tok": ids})
    assert p.cached_tokens(_worker("a", fp="other"), prompt) == (0, 0)
    assert p.cached_tokens(_worker("b", tenant_isolation=True), prompt) == (0, 0)
    ix.mark_unsynced("c")
    assert p.cached_tokens(_worker("c"), prompt) == (0, 0)
    assert p.cached_tokens(_worker("d"), prompt) == (0, 0)  # never heard of


def test_each_worker_is_matched_in_its_own_tokenizers_ids():
    """Two models behind one router: a worker is matched with the ids of the tokenizer it
    registered, never with another model's, and a worker whose tokenizer the router does
    not have yet is placed by load."""
    ix = PrefixIndex()
    ids_m, ids_n = list(range(17)), list(range(100, 117))  # one prompt, two tokenizers
    root = root_hash("m", "kv=bf16", "block_size=4")
    _synced(ix, "a", device=hash_blocks(root, ids_m[:16], 4))
    _synced(ix, "b", device=hash_blocks(root, ids_n[:16], 4))
    a, b, c = _worker("a", fp="m"), _worker("b", fp="n"), _worker("c", fp="unknown")
    p = Placement("prefix", ix, load_weight=0)
    both = PromptInfo({"m": ids_m, "n": ids_n})
    assert p.cached_tokens(a, both) == (16, 0) and p.cached_tokens(b, both) == (16, 0)
    # with only model m's tokenizer, b (model n) matches nothing, even though the same
    # block hashes would be found in its index under m's ids
    _synced(ix, "b", device=hash_blocks(root, ids_m[:16], 4))
    only_m = PromptInfo({"m": ids_m})
    assert p.cached_tokens(b, only_m) == (0, 0) and p.cached_tokens(c, only_m) == (0, 0)
    assert p.choose([b, c, a], "s", only_m).worker.node_id == "a"
    d = p.choose([b, c], "s", only_m)
    assert d.reason == "load" and d.prompt_tokens == 0  # no guess to check for b or c
    assert p.choose([b, c], "s", PromptInfo()).reason == "least_loaded"


def test_round_robin_and_least_loaded():
    ws = [_worker("b", load=1), _worker("a", load=3), _worker("c", load=2)]
    rr = Placement("round-robin", None)
    assert [rr.choose(ws, "s", PromptInfo()).worker.node_id for _ in range(4)] == [
        "a",
        "b",
        "c",
        "a",
    ]
    ll = Placement("least-loaded", None)
    assert ll.choose(ws, "s", PromptInfo({"tok": [1, 2, 3]})).worker.node_id == "b"
