"""KV store tiers without a network: block serialization (header checks, corruption), the
host and file LRUs (the file tier across a restart), and the tiered store's read-through
promotion, write policies, shedding and circuit breaker."""

from __future__ import annotations

import os
import threading
import time

import pytest
import torch
from tmpfs import small_disk

from kvserve.store import serde
from kvserve.store.base import KVStore, StoreUnavailable
from kvserve.store.file_store import FileStore
from kvserve.store.host import HostStore
from kvserve.store.tiered import TieredStore
from kvserve.store.url import open_store, open_tiered, with_namespace
from kvserve.testing.procs import wait_until

FMT = serde.BlockFormat("model-a", "int8", 4, 2, (("int8", (2, 4, 2, 8)), ("float16", (2, 4, 2))))


def _block(seed: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(FMT.num_layers):
        out.append(torch.randint(-127, 127, (2, 4, 2, 8), generator=g, dtype=torch.int8))
        out.append(torch.rand(2, 4, 2, generator=g).half())
    return out


def _key(i: int) -> bytes:
    return i.to_bytes(16, "big")


def test_serde_round_trip_and_every_mismatch_is_a_miss():
    key = _key(7)
    data = serde.encode(FMT, key, serde.pack(FMT, _block(1)))
    got = serde.decode(FMT, key, data, tokens=[5, 6, 7, 8])
    assert isinstance(got, str) and got == "mismatch: tokens"  # stored without tokens
    data = serde.encode(FMT, key, serde.pack(FMT, _block(1)), tokens=[5, 6, 7, 8])
    got = serde.decode(FMT, key, data, tokens=[5, 6, 7, 8])
    assert not isinstance(got, str)
    assert all(torch.equal(a, b) for a, b in zip(serde.unpack(FMT, got), _block(1), strict=True))
    assert serde.decode(FMT, key, data, tokens=[5, 6, 7, 9]) == "mismatch: tokens"
    data = serde.encode(FMT, key, serde.pack(FMT, _block(1)))
    assert len(data) - FMT.payload_bytes < 400  # the header is small

    flipped = bytearray(data)
    flipped[-3] ^= 0x40
    cases = {
        "corrupt: checksum": bytes(flipped),
        "corrupt: payload": data[:-10],  # truncated
        "corrupt: bad magic": b"XXXX" + data[4:],
        "corrupt: truncated header": data[:20],
        "mismatch: key": serde.encode(FMT, _key(8), serde.pack(FMT, _block(1))),
    }
    for reason, bad in cases.items():
        result = serde.decode(FMT, key, bad)
        assert isinstance(result, str) and result.startswith(reason), (reason, result)
    for field, other in {
        "model": serde.BlockFormat("model-b", *list(FMT.__dict__.values())[1:]),
        "kv": serde.BlockFormat("model-a", "fp8_e4m3", 4, 2, FMT.parts),
        "layers": serde.BlockFormat("model-a", "int8", 4, 3, FMT.parts),
        "scales": serde.BlockFormat("model-a", "int8", 4, 2, FMT.parts, "abc"),
    }.items():
        result = serde.decode(other, key, data)
        assert result == f"mismatch: {field}", (field, result)
    with pytest.raises(ValueError, match="expected"):
        serde.pack(FMT, _block(1)[:-1])
    with pytest.raises(ValueError, match="payload"):
        serde.encode(FMT, key, b"short")


@pytest.mark.parametrize("kind", ["host", "file"])
def test_store_contract_and_lru(kind, tmp_path):
    size = len(serde.encode(FMT, _key(0), serde.pack(FMT, _block(0))))
    cap = 3 * size
    store: KVStore = HostStore(cap) if kind == "host" else FileStore(tmp_path, cap)
    items = [(_key(i), serde.encode(FMT, _key(i), serde.pack(FMT, _block(i)))) for i in range(3)]
    store.put(items)
    assert store.contains([_key(0), _key(1), _key(9), _key(2)]) == 2  # leading run only
    assert store.get([_key(1), _key(9)]) == [items[1][1], None]
    store.get([_key(0)])  # 0 is now more recent than 2
    # evicts 2, the least recently used
    store.put([(_key(3), serde.encode(FMT, _key(3), serde.pack(FMT, _block(3))))])
    assert store.contains([_key(2)]) == 0
    assert store.contains([_key(0), _key(1), _key(3)]) == 3
    store.delete([_key(1), _key(42)])
    assert store.get([_key(1)]) == [None]
    assert store.used_bytes <= cap


def test_file_store_survives_a_restart_in_lru_order(tmp_path):
    size = len(serde.encode(FMT, _key(0), serde.pack(FMT, _block(0))))
    store = FileStore(tmp_path, 10 * size)
    past = time.time_ns() - 100 * 10**9
    for i in range(4):
        store.put([(_key(i), serde.encode(FMT, _key(i), serde.pack(FMT, _block(i))))])
        path = tmp_path / _key(i).hex()[:2] / f"{_key(i).hex()}.kvb"
        os.utime(path, ns=(past + i * 10**9,) * 2)  # written one second apart
    store.get([_key(0)])  # refreshes 0's mtime to now: most recent
    (tmp_path / "ff").mkdir()
    (tmp_path / "ff" / "junk.kvb.123.tmp").write_bytes(b"torn")  # an interrupted write
    again = FileStore(tmp_path, 3 * size)  # smaller: the two least recent go
    assert len(again) == 3
    assert again.contains([_key(0)]) == 1 and again.contains([_key(1)]) == 0
    got = serde.decode(FMT, _key(3), again.get([_key(3)])[0])
    assert all(torch.equal(a, b) for a, b in zip(serde.unpack(FMT, got), _block(3), strict=True))
    assert not (tmp_path / "ff" / "junk.kvb.123.tmp").exists()


class FlakyStore(HostStore):
    """A host store that can be switched to fail (a stand-in for a tier whose server is
    down, to test the breaker without timing a real network; the real-server versions
    are in test_store_redis)."""

    name = "flaky"

    def __init__(self, capacity: int):
        super().__init__(capacity)
        self.down = False
        self.calls = 0
        self.callers: set[str] = set()  # names of the threads that called it
        self.refuse_writes = False  # reads work, writes fail (a full Redis, noeviction)
        self.gate: threading.Event | None = None
        self.puts: list[list] = []  # the batches written, in order

    def _check(self) -> None:
        self.calls += 1
        self.callers.add(threading.current_thread().name)
        if self.gate is not None:
            self.gate.wait(10)
        if self.down:
            raise StoreUnavailable("down")

    def contains(self, keys):
        self._check()
        return super().contains(keys)

    def get(self, keys):
        self._check()
        return super().get(keys)

    def put(self, items):
        self._check()
        if self.refuse_writes:
            raise StoreUnavailable("OOM command not allowed")
        self.puts.append(list(items))
        super().put(items)


def test_tiered_read_through_promotes_and_extends_the_prefix():
    top, mid, low = HostStore(1 << 20), HostStore(1 << 20), HostStore(1 << 20)
    store = TieredStore([top, mid, low])
    keys = [_key(i) for i in range(6)]
    vals = [bytes([i]) * 10 for i in range(6)]
    top.put(list(zip(keys[:2], vals[:2], strict=True)))
    mid.put(list(zip(keys[:4], vals[:4], strict=True)))
    low.put(list(zip(keys[3:5], vals[3:5], strict=True)))
    assert store.lookup(keys) == 5  # top 0-1, mid 2-3, low 4
    assert store.get(keys) == [*vals[:5], None]
    assert top.contains(keys) == 5  # everything read was promoted into the first tier
    assert store.flush()
    assert mid.contains(keys) == 5  # 4 came from low: promoted into mid as well
    assert [s.hits for s in store.stats] == [2, 2, 1]
    assert store.stats[2].misses == 1
    store.close()


def test_a_session_record_is_read_newest_first_and_never_promoted():
    """Another node recorded a later turn in the shared tier: this node's own tier holds
    an older copy; the read returns the later turn and leaves the copies as they were."""
    from kvserve.store.sessions import SessionStore, session_key

    top, shared = HostStore(1 << 20), HostStore(1 << 20)
    tiered = TieredStore([top, shared])
    sessions = SessionStore(tiered, ttl=60)
    sessions.record("t", "s", [1, 2], [])
    assert tiered.flush(5)
    other_node = SessionStore(TieredStore([HostStore(1 << 20), shared]), ttl=60)
    other_node.record("t", "s", [1, 2, 3, 4], [])
    assert other_node.store.flush(5)
    assert sessions.get("t", "s").tokens == [1, 2, 3, 4]
    key = session_key("t", "s")
    assert b"[1,2]" in top.get([key])[0]  # nothing promoted over the older copy
    assert sessions.get("u", "s") is None  # another tenant's session is another record


def test_a_stored_session_that_does_not_decode_is_absent_and_deleted():
    """A foreign or corrupt value under a session's key (an older format, a stray write)
    reads as no session, and is removed, rather than being half-read."""
    from kvserve.store.sessions import SessionStore, session_key

    tiered = TieredStore([HostStore(1 << 20)])
    sessions = SessionStore(tiered, ttl=60)
    for bad in (b"not json", b'{"session": "s", "tokens": "many"}', b"[]"):
        tiered.put([(session_key("t", "s"), bad)])
        assert sessions.get("t", "s") is None
        assert tiered.lookup([session_key("t", "s")]) == 0
    sessions.record("t", "s", [5, 6], [b"\x01" * 16])
    got = sessions.get("t", "s")
    assert got is not None and got.tokens == [5, 6] and got.blocks == ["01" * 16]
    assert got.expires - got.updated == 60
    tiered.close()


def test_write_through_and_write_back():
    top, low = HostStore(1 << 20), HostStore(1 << 20)
    wt = TieredStore([top, low])
    wt.put([(_key(1), b"x" * 100)])
    assert wt.flush() and low.contains([_key(1)]) == 1
    wt.close()
    top, low = HostStore(250), HostStore(1 << 20)
    wb = TieredStore([top, low], write_policy="write-back")
    wb.put([(_key(1), b"a" * 100), (_key(2), b"b" * 100)])
    assert wb.flush() and low.contains([_key(1)]) == 0  # not evicted yet: only on top
    wb.put([(_key(3), b"c" * 100)])  # evicts 1 from top → written to low
    assert wb.flush() and low.get([_key(1)]) == [b"a" * 100]
    assert wb.get([_key(1)]) == [b"a" * 100]
    wb.close()


def test_a_batch_writes_each_key_once_with_its_newest_value():
    """Writes queued together reach a lower tier as one batch; two writes of one key
    become one put of the newer value (a tier may run a batch's puts in parallel, as S3
    does, and the older value must not win the race)."""
    top, slow = HostStore(1 << 20), FlakyStore(1 << 20)
    slow.gate = threading.Event()  # holds the writer: the writes queue up together
    store = TieredStore([top, slow])
    store.put([(_key(0), b"first")])
    store.put([(_key(1), b"old")])
    store.put([(_key(1), b"new"), (_key(2), b"x")])
    slow.gate.set()
    assert store.flush()
    written = [item for batch in slow.puts for item in batch]
    assert [v for k, v in written if k == _key(1)] == [b"new"]
    assert sorted(k for k, _ in written) == [_key(0), _key(1), _key(2)]
    assert slow.get([_key(1)]) == [b"new"]
    store.close()


def test_a_slow_tier_sheds_writes_instead_of_blocking():
    top, slow = HostStore(1 << 20), FlakyStore(1 << 20)
    slow.gate = threading.Event()  # the slow tier's writes hang until released
    store = TieredStore([top, slow], queue_size=2)
    t0 = time.perf_counter()
    for i in range(20):
        store.put([(_key(i), b"v" * 10)])
    assert time.perf_counter() - t0 < 1.0  # never waited for the slow tier
    assert top.contains([_key(i) for i in range(20)]) == 20
    assert store.stats[1].dropped_writes >= 17  # queue of 2 + the one in flight
    slow.gate.set()
    assert store.flush()
    store.close()


def test_a_tier_refusing_writes_is_probed_with_a_write_and_stays_open():
    """Reads answer, writes fail: a read must not close the breaker (it flapped: open on
    each write, closed by the next lookup probe), so its backoff grows until a write
    succeeds."""
    top, full = HostStore(1 << 20), FlakyStore(1 << 20)
    store = TieredStore([top, full])
    store._breakers[1].base = 0.02
    full.refuse_writes = True
    store.put([(_key(1), b"v")])
    wait_until(lambda: store._breakers[1].failures >= 3, 5, "write probes failing")
    assert store.breaker_open(1)
    full.refuse_writes = False
    wait_until(lambda: not store.breaker_open(1), 5, "a write probe to close the breaker")
    store.close()


def test_breaker_skips_a_failed_tier_and_probes_it_again():
    """The call that finds a tier down is a miss; after it, requests never call the tier
    (however long it stays down): only the writer thread probes it, and its first
    successful probe closes the breaker."""
    top, flaky = HostStore(1 << 20), FlakyStore(1 << 20)
    flaky.put([(_key(1), b"v")])
    store = TieredStore([top, flaky])
    store._breakers[1].base = 0.05  # probe quickly in the test
    flaky.down = True
    assert store.get([_key(1)]) == [None]  # a failed tier is a miss, not an error
    assert store.breaker_open(1) and store.stats[1].errors == 1
    flaky.callers.clear()
    calls = flaky.calls
    deadline = time.monotonic() + 0.5  # ten backoffs: the readers still skip it
    while time.monotonic() < deadline:
        assert store.lookup([_key(1)]) == 0 and store.get([_key(1)]) == [None]
    assert flaky.calls > calls and flaky.callers == {"kvstore-writer"}  # probes only
    assert store.breaker_open(1)
    flaky.down = False
    wait_until(lambda: not store.breaker_open(1), 5, "a probe to close the breaker")
    assert store.get([_key(1)]) == [b"v"]
    store.close()


def test_urls(tmp_path):
    assert isinstance(open_store("host://?capacity=1MiB"), HostStore)
    f = open_store(f"file://{tmp_path}/kv?capacity=2MiB")
    assert isinstance(f, FileStore) and f.capacity_bytes == 2 << 20
    for bad, msg in {
        "ftp://x": "unknown KV store scheme",
        f"file://{tmp_path}": "capacity",
        "host://?capacity=lots": "lots",
    }.items():
        with pytest.raises(ValueError, match=msg):
            open_store(bad)
    t = open_tiered([f"file://{tmp_path}/kv?capacity=2MiB"])
    assert [x.name for x in t.tiers] == ["host", "file"]
    t.close()
    with pytest.raises(ValueError, match="first tier"):
        open_tiered(["host://", "host://"])


def test_shared_tiers_get_a_namespace_unless_they_set_a_prefix():
    ns = "0123abcd-bfloat16-bs16"
    assert with_namespace("redis://h:6379/0?ttl=5", ns) == (
        "redis://h:6379/0?ttl=5&prefix=kvserve%3A0123abcd-bfloat16-bs16"
    )
    assert with_namespace("unix:///run/r.sock", ns).startswith("unix:///run/r.sock?prefix=")
    assert with_namespace("redis://h:6379/0?prefix=mine", ns).endswith("prefix=mine")
    assert with_namespace("s3://bucket", ns) == "s3://bucket/kvserve/0123abcd-bfloat16-bs16"
    assert with_namespace("s3://bucket/p", ns) == "s3://bucket/p"
    assert with_namespace("file:///x?capacity=1GiB", ns) == "file:///x?capacity=1GiB"


def test_a_full_disk_drops_the_block_and_the_file_tier_goes_on_smaller(tmp_path, caplog):
    """A real 256 KiB filesystem under a file tier that believes it has 100 MiB: the write
    that finds the disk full is dropped (no exception, no partial file left), the capacity
    drops to what fit, and the tier goes on as a smaller LRU: new blocks are written by
    evicting the oldest, and every read is a hit or a miss."""
    block = bytes(range(256)) * 256  # 64 KiB
    with small_disk(tmp_path / "disk", "256k") as disk:
        store = FileStore(disk, 100 << 20)
        keys = [bytes([i]) * 16 for i in range(8)]
        with caplog.at_level("WARNING", logger="kvserve"):
            store.put([(k, block) for k in keys[:6]])
        assert "the disk is full" in caplog.text
        assert store.num_dropped >= 1 and store.capacity_bytes < 256 << 10
        assert not list(disk.rglob("*.tmp"))
        store.put([(keys[6], block), (keys[7], block)])  # room made by evicting the oldest
        got = store.get(keys)
        assert got[7] == block and got[0] is None
        assert all(v in (None, block) for v in got)
        assert store.used_bytes <= store.capacity_bytes
