"""KV events (issue 18): the event log replayed onto an empty view always equals what the
block pool's prefix index and the host tier hold, through random allocation, caching,
reuse, resets and evictions; a full log degrades to a lossy clear, never a wrong view."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from kvserve.kv.block_pool import BlockPool
from kvserve.kv.events import DEVICE, HOST, KVEventLog, TierCleared, apply
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


def test_a_full_log_turns_into_a_lossy_clear():
    log = KVEventLog(max_pending=4)
    log.stored(DEVICE, [b"a" * 16, b"b" * 16])
    log.stored(HOST, [b"c" * 16])
    log.stored(DEVICE, [b"d" * 16, b"e" * 16])  # past the bound
    events = log.drain()
    assert all(isinstance(e, TierCleared) and e.lossy for e in events)
    view = {DEVICE: {b"z" * 16}}
    assert not apply(view, events)  # the reader must resynchronise
    assert view[DEVICE] == set()
    assert log.num_overflows == 1 and not log


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
