"""``RedisStore`` against real ``redis-server`` processes: TCP, unix socket, TLS, a 3-master
Redis Cluster, a server killed and restarted, and ``maxmemory`` (noeviction / allkeys-lru).

Every server is a subprocess on loopback with no persistence; every wait polls with a
deadline. The tests need the ``redis-server``/``redis-cli`` binaries (``apt-get install
redis-server``) and fail — they are never skipped — when those are missing.
"""

from __future__ import annotations

import contextlib
import shutil
import subprocess
import tempfile
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import redis
from redis.cluster import RedisCluster

from kvserve.store.base import StoreUnavailable
from kvserve.store.redis_store import RedisStore
from kvserve.testing.procs import free_port, wait_until
from kvserve.testing.redis_procs import (
    Cluster,
    RedisServer,
    _binary,
    free_ports,
    redis_cluster,
    redis_server,
)

READY_TIMEOUT_S = 20.0
CLUSTER_TIMEOUT_S = 40.0
# generous bound for one failing operation: connect timeout × (1 + retries) plus slack for
# a loaded 2-core machine
FAIL_FAST_S = 6.0


# ---------------------------------------------------------------------------- servers
@pytest.fixture(scope="module")
def tcp_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisServer]:
    with redis_server(tmp_path_factory.mktemp("redis-tcp")) as server:
        yield server


@pytest.fixture(scope="module")
def unix_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisServer]:
    # a short directory: unix socket paths are limited to ~107 bytes
    sockdir = Path(tempfile.mkdtemp(prefix="kvr-", dir="/tmp"))
    try:
        with redis_server(
            tmp_path_factory.mktemp("redis-unix"), unix=sockdir / "redis.sock"
        ) as server:
            yield server
    finally:
        shutil.rmtree(sockdir, ignore_errors=True)


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    with redis_cluster(tmp_path_factory.mktemp("redis-cluster")) as c:
        yield c


# ---------------------------------------------------------------------------- stores
MODES = ("tcp", "unix", "cluster", "cluster_notag")


@pytest.fixture(params=MODES)
def mode(request: pytest.FixtureRequest) -> str:
    return request.param


@pytest.fixture
def make_store(request: pytest.FixtureRequest, mode: str) -> Iterator[Callable[..., RedisStore]]:
    """``make_store(**query)`` → a store of ``mode`` with a fresh unique prefix (unless given)."""
    stores: list[RedisStore] = []
    if mode == "tcp":
        server = request.getfixturevalue("tcp_server")
        base = f"redis://127.0.0.1:{server.port}/1?"  # database from the path
    elif mode == "unix":
        server = request.getfixturevalue("unix_server")
        base = f"unix://{server.unix}?db=2&"  # database from the query
    else:
        base = request.getfixturevalue("cluster").url() + "?"
        if mode == "cluster_notag":
            base += "hash_tag=none&"

    def make(**query: object) -> RedisStore:
        query.setdefault("prefix", f"t{uuid.uuid4().hex[:8]}")
        query.setdefault("timeout", 5)
        store = RedisStore.from_url(base + "&".join(f"{k}={v}" for k, v in query.items()))
        stores.append(store)
        return store

    yield make
    for s in stores:
        s.close()


@pytest.fixture
def raw(request: pytest.FixtureRequest, mode: str) -> Iterator[redis.Redis | RedisCluster]:
    """A plain redis-py client on the same server/database as ``make_store``'s stores."""
    if mode == "tcp":
        client = request.getfixturevalue("tcp_server").client(db=1)
    elif mode == "unix":
        client = request.getfixturevalue("unix_server").client(db=2)
    else:
        client = request.getfixturevalue("cluster").raw()
    yield client
    client.close()


def K(i: int) -> bytes:
    return i.to_bytes(16, "big")


# ---------------------------------------------------------------------------- contract
def test_put_get_contains_leading_count(make_store) -> None:
    store = make_store()
    keys = [K(i) for i in range(5)]
    assert store.contains(keys) == 0
    assert store.get(keys) == [None] * 5
    store.put([(k, b"v%d" % i) for i, k in enumerate(keys) if i != 2])
    assert store.contains(keys) == 2  # k2 missing: stops there even though k3, k4 exist
    assert store.contains(keys[:2]) == 2
    assert store.contains(keys[2:]) == 0
    assert store.contains(keys[3:]) == 2
    assert store.contains([]) == 0
    assert store.get(keys) == [b"v0", b"v1", None, b"v3", b"v4"]
    assert store.get([]) == []
    store.put([(keys[0], b"v0")])  # overwrite with the same bytes
    store.put([])
    assert store.get(keys[:1]) == [b"v0"]


def test_binary_safety(make_store) -> None:
    store = make_store()
    every_byte = bytes(range(256))
    items = [(bytes((i + j) % 256 for j in range(16)), every_byte * (i + 1)) for i in range(16)]
    items.append((K(999), b""))  # empty value is a hit, not a miss
    items.append((K(998), b"\x00" * 70_000))
    store.put(items)
    assert store.get([k for k, _ in items]) == [v for _, v in items]
    assert store.contains([k for k, _ in items]) == len(items)


def test_delete(make_store) -> None:
    store = make_store()
    keys = [K(i) for i in range(4)]
    store.put([(k, b"x") for k in keys])
    store.delete([keys[1], keys[3], K(12345)])  # absent keys are ignored
    assert store.get(keys) == [b"x", None, b"x", None]
    assert store.contains(keys) == 1
    store.delete([])
    store.delete(keys)
    assert store.contains(keys) == 0


def test_ttl_set_on_put(make_store, raw) -> None:
    # ttl=5 rather than 1: a busy machine must not expire the key before we look at it
    with_ttl = make_store(ttl=5)
    without = make_store()
    with_ttl.put([(K(1), b"a")])
    without.put([(K(1), b"b")])
    assert 0 < raw.pttl(with_ttl.redis_key(K(1))) <= 5000
    assert raw.pttl(without.redis_key(K(1))) == -1  # exists, no expiry
    assert raw.get(with_ttl.redis_key(K(1))) == b"a"


def test_ttl_expires(make_store) -> None:
    store = make_store(ttl=0.2)  # fractional seconds: PX 200
    store.put([(K(1), b"a"), (K(2), b"b")])
    wait_until(lambda: store.contains([K(1)]) == 0, 10.0, "ttl expiry")
    assert store.get([K(1), K(2)]) == [None, None]


def test_prefix_isolation(make_store) -> None:
    a, b = make_store(prefix="alpha" + uuid.uuid4().hex[:6]), make_store()
    a.put([(K(1), b"a1"), (K(2), b"a2")])
    assert b.contains([K(1)]) == 0
    assert b.get([K(1), K(2)]) == [None, None]
    b.put([(K(1), b"b1")])
    b.delete([K(2)])
    assert a.get([K(1), K(2)]) == [b"a1", b"a2"]
    assert b.get([K(1), K(2)]) == [b"b1", None]


# ---------------------------------------------------------------------------- cluster
def test_cluster_hash_tag_keeps_a_prefix_on_one_node(cluster: Cluster) -> None:
    cluster.flushall()
    store = RedisStore.from_url(cluster.url("prefix=tagged"))
    try:
        store.put([(K(i), b"x") for i in range(64)])
        assert store.redis_key(K(1)) == b"tagged:{tagged}:" + K(1).hex().encode()
        assert sorted(cluster.dbsizes()) == [0, 0, 64]
        assert store.contains([K(i) for i in range(64)]) == 64
    finally:
        store.close()


def test_cluster_without_hash_tag_spreads_keys(cluster: Cluster) -> None:
    cluster.flushall()
    store = RedisStore.from_url(cluster.url("prefix=spread&hash_tag=none"))
    try:
        items = [(K(i), b"v%d" % i) for i in range(64)]
        store.put(items)
        assert store.redis_key(K(1)) == b"spread:" + K(1).hex().encode()
        sizes = cluster.dbsizes()
        assert sum(sizes) == 64
        assert sum(1 for s in sizes if s) > 1, sizes
        assert store.get([k for k, _ in items]) == [v for _, v in items]
        store.delete([k for k, _ in items[:32]])
        assert sum(cluster.dbsizes()) == 32
    finally:
        store.close()


def test_cluster_custom_hash_tag(cluster: Cluster) -> None:
    store = RedisStore.from_url(cluster.url("prefix=p1&hash_tag=shared"))
    try:
        assert store.redis_key(K(3)) == b"p1:{shared}:" + K(3).hex().encode()
        store.put([(K(3), b"z")])
        assert store.get([K(3)]) == [b"z"]
    finally:
        store.close()


# ---------------------------------------------------------------------------- failures
def _assert_unavailable(op: Callable[[], object]) -> None:
    t0 = time.monotonic()
    with pytest.raises(StoreUnavailable):
        op()
    assert time.monotonic() - t0 < FAIL_FAST_S


def test_server_killed_then_restarted(tmp_path: Path) -> None:
    with redis_server(tmp_path) as server:
        store = RedisStore.from_url(f"redis://127.0.0.1:{server.port}/0?timeout=1")
        try:
            store.put([(K(1), b"before")])
            assert store.get([K(1)]) == [b"before"]  # a pooled connection now exists

            server.kill()
            _assert_unavailable(lambda: store.get([K(1)]))
            _assert_unavailable(lambda: store.contains([K(1)]))
            _assert_unavailable(lambda: store.put([(K(2), b"x")]))
            _assert_unavailable(lambda: store.delete([K(1)]))

            server.start()  # same port; nothing persisted
            assert store.get([K(1)]) == [None]
            store.put([(K(1), b"after")])
            assert store.contains([K(1)]) == 1
            assert store.get([K(1)]) == [b"after"]
        finally:
            store.close()


def test_nothing_listening_is_unavailable() -> None:
    store = RedisStore.from_url(f"redis://127.0.0.1:{free_port()}?timeout=1")
    try:
        _assert_unavailable(lambda: store.contains([K(1)]))
    finally:
        store.close()


def test_cluster_unreachable_at_construction() -> None:
    with pytest.raises(StoreUnavailable):
        RedisStore.from_url(f"redis+cluster://127.0.0.1:{free_port()}?timeout=1")


VALUE = b"\xab" * 16384
BATCH = 16


def test_maxmemory_noeviction_is_unavailable_when_full(tmp_path: Path) -> None:
    with redis_server(tmp_path, "--maxmemory", "2mb", "--maxmemory-policy", "noeviction") as srv:
        store = RedisStore.from_url(f"redis://127.0.0.1:{srv.port}")
        try:
            written = 0
            with pytest.raises(StoreUnavailable, match="OutOfMemoryError"):
                for _ in range(100):  # 100 × 256 KiB ≫ 2 MB: must fail well before
                    store.put([(K(written + i), VALUE) for i in range(BATCH)])
                    written += BATCH
            assert written > 0
            # a full store still serves reads
            assert store.contains([K(i) for i in range(written)]) == written
            assert store.get([K(0)]) == [VALUE]
        finally:
            store.close()


def test_maxmemory_allkeys_lru_evicts_old_keys(tmp_path: Path) -> None:
    with redis_server(tmp_path, "--maxmemory", "2mb", "--maxmemory-policy", "allkeys-lru") as srv:
        store = RedisStore.from_url(f"redis://127.0.0.1:{srv.port}")
        try:
            total = 400  # 400 × 16 KiB ≈ 6.5 MB into a 2 MB server
            for start in range(0, total, BATCH):
                store.put([(K(start + i), VALUE) for i in range(BATCH)])  # never refused
            first = [K(i) for i in range(BATCH)]
            assert store.contains(first) < BATCH
            with contextlib.closing(srv.client()) as raw:
                assert 0 < raw.dbsize() < total
                assert int(raw.info("stats")["evicted_keys"]) > 0
        finally:
            store.close()


# ---------------------------------------------------------------------------- TLS, URLs
def test_rediss_tls(tmp_path: Path) -> None:
    cert, key = tmp_path / "cert.pem", tmp_path / "key.pem"
    subprocess.run(
        [
            _binary("openssl"),
            "req",
            "-x509",
            "-newkey",
            "ec",
            "-pkeyopt",
            "ec_paramgen_curve:prime256v1",
            "-nodes",
            "-keyout",
            str(key),
            "-out",
            str(cert),
            "-days",
            "1",
            "-subj",
            "/CN=127.0.0.1",
            "-addext",
            "subjectAltName=IP:127.0.0.1",
        ],
        check=True,
        capture_output=True,
        timeout=30,
    )
    port, tls_port = free_ports(2)
    args = (
        "--tls-port",
        str(tls_port),
        "--tls-cert-file",
        str(cert),
        "--tls-key-file",
        str(key),
        "--tls-ca-cert-file",
        str(cert),
        "--tls-auth-clients",
        "no",
    )
    with redis_server(tmp_path, *args, port=port):  # readiness is checked on the plain port
        url = f"rediss://127.0.0.1:{tls_port}/0?ssl_ca_certs={cert}&ssl_cert_reqs=required"
        store = RedisStore.from_url(url)
        try:
            store.put([(K(1), b"secret")])
            assert store.get([K(1)]) == [b"secret"]
        finally:
            store.close()


@pytest.mark.parametrize(
    "url",
    [
        "http://127.0.0.1:6379",
        "redis://127.0.0.1:6379?ttl=0",
        "redis://127.0.0.1:6379?ttl=soon",
        "redis://127.0.0.1:6379?ttl=inf",
        "redis://127.0.0.1:6379?timeout=-1",
        "redis://127.0.0.1:6379?prefix=",
        "redis://127.0.0.1:6379?hash_tag=x",
        "redis+cluster://127.0.0.1:7000?prefix=a{b}",
        "redis+cluster://127.0.0.1:7000?hash_tag=",
        "redis+cluster://127.0.0.1:7000/3",
        "redis+cluster://127.0.0.1:7000?bogus=1",
        "redis+cluster://?prefix=x",
    ],
)
def test_bad_urls(url: str) -> None:
    with pytest.raises(ValueError):
        RedisStore.from_url(url)
