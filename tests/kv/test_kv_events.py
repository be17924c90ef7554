"""KV events (issue 18): the event log replayed onto an empty view always equals what the
block pool's prefix index and the host tier hold, through random allocation, caching,
reuse, resets and evictions; a full log is replaced by the full state, never a wrong view."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from kvserve.kv.block_pool import BlockPool
from kvserve.kv.events import DEVICE, HOST, KVEventLog, apply, full_state
from kvserve.kv.hashing import hash_block, root_hash
from kvserve.store.host import HostStore


def _pool_hashes(pool: BlockPool) -> set[bytes]:
    return set(pool._index)


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.sampled_from("acfrx"), st.integers(0, 7)), max_size=80))
def test_device_events_replay_to_the_pool_index(ops):
    pool = BlockPool(6)
    log = KVEventLog()
    pool.events = log
    view: dict[str, set[bytes]] = {}
    root = root_hash("m")
    used: list[int] = []
    for op, k in ops:
        if op == "a":  # allocate (reuses least recently freed blocks: evicts hashes)
            got = pool.allocate(1)
            if got:
                used += got
        elif op == "c" and used:  # cache a used block under a fresh or repeated hash
            b = used[k % len(used)]
            pool.cache(b, hash_block(root, [k]), [k])
        elif op == "f" and used:
            pool.free([used.pop(k % len(used))])
        elif op == "r":
            pool.evict_cached()
        elif op == "x":  # drain mid-way: batches concatenate
            assert apply(view, log.drain())
        pool.check_integrity()
    assert apply(view, log.drain())
    assert view.get(DEVICE, set()) == _pool_hashes(pool)


def test_host_events_follow_puts_evictions_and_deletes():
    host = HostStore(capacity_bytes=30)
    log = KVEventLog()
    host.events = log
    keys = [bytes([i]) * 16 for i in range(6)]
    host.put([(keys[0], b"x" * 10), (keys[1], b"x" * 10)])
    host.put([(keys[0], b"y" * 10)])  # an overwrite is not a new block
    host.put([(keys[2], b"x" * 10), (keys[3], b"x" * 10)])  # evicts keys[1] (LRU)
    host.delete([keys[2], keys[5]])
    view: dict[str, set[bytes]] = {}
    events = log.drain()
    assert apply(view, events)
    assert view[HOST] == set(host._data) == {keys[0], keys[3]}
    stored = [h for e in events if type(e).__name__ == "BlocksStored" for h in e.hashes]
    assert stored.count(keys[0]) == 1


def test_a_full_log_is_replaced_by_the_full_state():
    log = KVEventLog(max_pending=4)
    log.stored(DEVICE, [b"a" * 16, b"b" * 16])
    log.stored(HOST, [b"c" * 16])
    log.stored(DEVICE, [b"d" * 16, b"e" * 16])  # past the bound
    log.stored(DEVICE, [b"f" * 16])  # dropped too: the full state covers it
    assert log and log.num_overflows == 1
    assert log.drain() is None and not log  # the caller sends the full state instead
    state = full_state({DEVICE: [b"a" * 16, b"f" * 16], HOST: []})
    view = {DEVICE: {b"z" * 16}, HOST: {b"y" * 16}}
    assert apply(view, state)  # exact again, no snapshot needed
    assert view == {DEVICE: {b"a" * 16, b"f" * 16}, HOST: set()}
    log.removed(DEVICE, [b"a" * 16])  # and the log goes on
    assert apply(view, log.drain())
    assert view[DEVICE] == {b"f" * 16}


def test_consecutive_events_merge_and_keep_their_order():
    log = KVEventLog()
    log.stored(DEVICE, [b"a"])
    log.stored(DEVICE, [b"b"])
    log.removed(DEVICE, [b"a"])
    log.stored(DEVICE, [b"a"])
    events = log.drain()
    assert [type(e).__name__ for e in events] == ["BlocksStored", "BlocksRemoved", "BlocksStored"]
    view: dict[str, set[bytes]] = {}
    apply(view, events)
    assert view[DEVICE] == {b"a", b"b"}


def test_an_engine_s_events_and_its_full_state_agree(llama_dir):
    """Through a real engine (pool + host tier): the drained events replay to exactly
    what ``kv_state`` reads from the engine, also after the log overflowed."""
    from kvserve.config import EngineArgs
    from kvserve.engine.core import kv_state
    from kvserve.engine.llm_engine import LLMEngine
    from kvserve.sampling import SamplingParams

    engine = LLMEngine(
        EngineArgs(model=str(llama_dir), kv_events_port=0, kv_store=("host://",), device="cpu")
    )
    try:
        log = engine.kv_events
        assert log is not None
        view: dict[str, set[bytes]] = {}
        params = SamplingParams(max_tokens=4, temperature=0.0)
        for i, n in enumerate((70, 90, 40)):
            engine.add_request(f"r{i}", [(7 * i + k) % 300 + 2 for k in range(n)], params)
            while engine.has_unfinished_requests():
                engine.step()
            if i == 1:
                log.max_pending = 1  # the third request overflows the log
            events = log.drain()
            if events is None:
                events = kv_state(engine)
            assert apply(view, events)
            want = {DEVICE: set(engine.kv.pool.cached_hashes())}
            want[HOST] = set(engine.offloader.store.tiers[0].keys())
            assert view == want and len(want[DEVICE]) >= 4
        assert log.num_overflows == 1
    finally:
        engine.close()
