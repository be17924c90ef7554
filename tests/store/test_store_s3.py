"""``S3Store`` against a real HTTP server process speaking the S3 API.

moto's server mode (``python -m moto.server``) stands in for S3: no S3-compatible server
(MinIO, Ceph RGW, …) installs on this machine, while moto runs as a separate process on a
loopback port, so boto3 goes through real HTTP, real sockets and real connection errors when
it is killed. Small in-process HTTP stubs answer fixed 5xx/403 statuses to check the error
mapping. Dummy credentials are set for the whole module; every wait polls with a deadline.
"""

from __future__ import annotations

import contextlib
import signal
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
from botocore.exceptions import ClientError
from s3_proc import BUCKET, MotoServer, moto_server

from kvserve.store.base import StoreUnavailable
from kvserve.store.s3_store import S3Store
from kvserve.testing.procs import free_port

FAIL_FAST_S = 10.0  # timeout=2 × 2 attempts + backoff + slack
pytestmark = pytest.mark.usefixtures("aws_env")


@pytest.fixture
def make_store(moto: MotoServer) -> Iterator[Callable[..., S3Store]]:
    """``make_store(prefix=None, **query)`` → a store on the moto bucket (fresh prefix)."""
    stores: list[S3Store] = []

    def make(prefix: str | None = None, **query: object) -> S3Store:
        store = S3Store.from_url(moto.url(prefix or f"t{uuid.uuid4().hex[:8]}", **query))
        stores.append(store)
        return store

    yield make
    for s in stores:
        s.close()


def K(i: int) -> bytes:
    return i.to_bytes(16, "big")


# ---------------------------------------------------------------------------- contract
def test_put_get_contains_leading_count(make_store) -> None:
    store = make_store()
    keys = [K(i) for i in range(5)]
    assert store.contains(keys) == 0
    assert store.get(keys) == [None] * 5
    store.put([(k, b"v%d" % i) for i, k in enumerate(keys) if i != 2])
    assert store.contains(keys) == 2
    assert store.contains(keys[3:]) == 2
    assert store.contains([]) == 0
    assert store.get(keys) == [b"v0", b"v1", None, b"v3", b"v4"]
    assert store.get([]) == []
    store.put([(keys[0], b"v0")])  # overwrite with the same bytes
    store.put([])
    assert store.get(keys[:1]) == [b"v0"]


def test_contains_counts_across_parallel_windows(make_store) -> None:
    store = make_store()  # 8 workers: HEADs go in windows of 8
    keys = [K(i) for i in range(20)]
    store.put([(k, b"x") for i, k in enumerate(keys) if i != 11])
    assert store.contains(keys) == 11
    assert store.contains(keys[:8]) == 8
    assert store.contains(keys[:11]) == 11
    assert store.contains(keys[12:]) == 8


def test_binary_safety(make_store) -> None:
    store = make_store()
    every_byte = bytes(range(256))
    items = [(bytes((i + j) % 256 for j in range(16)), every_byte * (i + 1)) for i in range(16)]
    items.append((K(999), b""))  # empty object is a hit, not a miss
    store.put(items)
    assert store.get([k for k, _ in items]) == [v for _, v in items]
    assert store.contains([k for k, _ in items]) == len(items)


def test_delete_in_chunks(make_store, moto: MotoServer) -> None:
    store = make_store(prefix="nested/deeper")
    store.delete_chunk = 3  # exercise the chunking without 1000s of objects
    keys = [K(i) for i in range(10)]
    store.put([(k, b"x") for k in keys])
    listed = moto.s3().list_objects_v2(Bucket=BUCKET, Prefix="nested/deeper/")
    assert sorted(o["Key"] for o in listed["Contents"]) == sorted(
        f"nested/deeper/{k.hex()}" for k in keys
    )
    store.delete([keys[1], K(12345), *keys[3:9]])  # absent keys are ignored
    assert store.get(keys) == [b"x", None, b"x", None, None, None, None, None, None, b"x"]
    store.delete([])
    store.delete(keys)
    assert store.contains(keys) == 0
    assert moto.s3().list_objects_v2(Bucket=BUCKET, Prefix="nested/deeper/")["KeyCount"] == 0


def test_prefix_isolation(make_store) -> None:
    a, b = make_store(), make_store()
    a.put([(K(1), b"a1"), (K(2), b"a2")])
    assert b.contains([K(1)]) == 0
    assert b.get([K(1), K(2)]) == [None, None]
    b.put([(K(1), b"b1")])
    b.delete([K(2)])
    assert a.get([K(1), K(2)]) == [b"a1", b"a2"]
    assert b.get([K(1), K(2)]) == [b"b1", None]


def test_missing_bucket_is_a_configuration_error(moto: MotoServer) -> None:
    store = S3Store.from_url(f"s3://no-such-bucket/p?endpoint_url={moto.endpoint}&region=us-east-1")
    try:
        with pytest.raises(ClientError):
            store.get([K(1)])
    finally:
        store.close()


# ---------------------------------------------------------------------------- failures
def _assert_unavailable(op: Callable[[], object]) -> None:
    t0 = time.monotonic()
    with pytest.raises(StoreUnavailable):
        op()
    assert time.monotonic() - t0 < FAIL_FAST_S


def test_server_killed_then_restarted(tmp_path: Path) -> None:
    with moto_server(tmp_path / "moto.log") as server:
        store = S3Store.from_url(server.url("p", timeout=2))
        try:
            store.put([(K(1), b"before")])
            assert store.get([K(1)]) == [b"before"]

            server.kill()
            _assert_unavailable(lambda: store.contains([K(1)]))
            _assert_unavailable(lambda: store.get([K(1), K(2)]))
            _assert_unavailable(lambda: store.put([(K(2), b"x")]))
            _assert_unavailable(lambda: store.delete([K(1)]))

            server.start()  # same port, empty again (bucket recreated)
            assert store.get([K(1)]) == [None]
            store.put([(K(1), b"after")])
            assert store.contains([K(1)]) == 1
        finally:
            store.close()


@contextlib.contextmanager
def stub_server(status: int, code: str) -> Iterator[str]:
    """An HTTP server answering every request with ``status`` and an S3 error body."""
    body = (
        f'<?xml version="1.0" encoding="UTF-8"?><Error><Code>{code}</Code>'
        f"<Message>stub</Message></Error>"
    ).encode()

    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"  # answers botocore's "Expect: 100-continue" at once

        def _reply(self) -> None:
            length = int(self.headers.get("Content-Length") or 0)
            if length:
                self.rfile.read(length)
            self.send_response(status)
            self.send_header("Content-Type", "application/xml")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            if self.command != "HEAD":
                self.wfile.write(body)

        do_GET = do_PUT = do_POST = do_HEAD = do_DELETE = _reply

        def log_message(self, *args) -> None:
            pass

    httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{httpd.server_address[1]}"
    finally:
        httpd.shutdown()
        httpd.server_close()
        thread.join(10)


@pytest.mark.parametrize(("status", "code"), [(500, "InternalError"), (503, "SlowDown")])
def test_server_errors_are_unavailable(status: int, code: str) -> None:
    with stub_server(status, code) as endpoint:
        store = S3Store.from_url(f"s3://b/p?endpoint_url={endpoint}&region=us-east-1&retries=0")
        try:
            _assert_unavailable(lambda: store.contains([K(1)]))
            _assert_unavailable(lambda: store.get([K(1)]))
            _assert_unavailable(lambda: store.put([(K(1), b"x")]))
            _assert_unavailable(lambda: store.delete([K(1)]))
        finally:
            store.close()


def test_access_denied_propagates() -> None:
    with stub_server(403, "AccessDenied") as endpoint:
        store = S3Store.from_url(f"s3://b/p?endpoint_url={endpoint}&region=us-east-1&retries=0")
        try:
            with pytest.raises(ClientError):
                store.get([K(1)])
        finally:
            store.close()


def test_nothing_listening_is_unavailable() -> None:
    url = f"s3://b/p?endpoint_url=http://127.0.0.1:{free_port()}&region=us-east-1&timeout=2"
    store = S3Store.from_url(url)
    try:
        _assert_unavailable(lambda: store.contains([K(1)]))
    finally:
        store.close()


@pytest.mark.parametrize(
    "url",
    [
        "http://bucket/p",
        "s3:///p",
        "s3://b/p?bogus=1",
        "s3://b/p?timeout=0",
        "s3://b/p?timeout=nan",
        "s3://b/p?retries=-1",
        "s3://b/p?workers=0",
        "s3://b/p?addressing_style=sideways",
    ],
)
def test_bad_urls(url: str) -> None:
    with pytest.raises(ValueError):
        S3Store.from_url(url)


def test_default_prefix() -> None:
    store = S3Store.from_url("s3://b?region=us-east-1")
    try:
        assert store.object_key(K(1)) == "kvserve/" + K(1).hex()
    finally:
        store.close()


def test_a_stalled_server_costs_one_call_its_timeout(tmp_path: Path) -> None:
    """moto SIGSTOPped: each call raises StoreUnavailable within its ``timeout`` although
    botocore would retry the timed-out reads twice more (3x the wait); right after SIGCONT
    the same store answers again."""
    with moto_server(tmp_path / "moto.log") as server:
        store = S3Store.from_url(server.url("p", timeout=0.5, retries=2))
        try:
            store.put([(K(1), b"v")])
            assert server.proc is not None
            server.proc.send_signal(signal.SIGSTOP)
            try:
                for op in (
                    lambda: store.contains([K(1)]),
                    lambda: store.get([K(1), K(2)]),
                    lambda: store.put([(K(3), b"x")]),
                ):
                    t0 = time.monotonic()
                    with pytest.raises(StoreUnavailable, match=r"did not answer within 0\.5 s"):
                        op()
                    assert time.monotonic() - t0 < 0.5 + 0.4
            finally:
                server.proc.send_signal(signal.SIGCONT)
            # at once: the timed-out requests' threads are not in the way (fresh pools)
            assert store.get([K(1)]) == [b"v"] and store.contains([K(1)]) == 1
        finally:
            store.close()
