"""A worker's KV events on a real ``kvserve serve`` (issue 18): a ZeroMQ subscriber sees
numbered batches naming exactly the chained hashes of the prompt's full blocks (device
pool and host tier), quiet periods repeat the last ``seq``, and the snapshot endpoint
(cluster secret required) returns the same set with that ``seq``. A port in use is
refused at start."""

from __future__ import annotations

import json
import subprocess
import sys
import time
import urllib.error
import urllib.request

import msgspec
import pytest
import zmq

from kvserve.kv.events import DEVICE, HOST, apply, events_key, seal
from kvserve.kv.hashing import hash_blocks, model_fingerprint, root_hash
from kvserve.model.tokenizer import load_tokenizer
from kvserve.server.kv_events import KVEventBatch, KVSnapshot
from kvserve.testing.procs import free_port, running_server

SECRET = "kv-events-secret"


def _snapshot(url: str, secret: str | None = SECRET) -> KVSnapshot:
    headers = {"X-Kvserve-Cluster-Secret": secret} if secret else {}
    req = urllib.request.Request(url + "/internal/kv/snapshot", headers=headers)
    with urllib.request.urlopen(req, timeout=10) as r:
        return msgspec.msgpack.decode(r.read(), type=KVSnapshot)


def test_events_and_snapshot_name_the_prompt_blocks(llama_dir, tmp_path):
    port = free_port()
    sub = zmq.Context.instance().socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"kv")
    sub.connect(f"tcp://127.0.0.1:{port}")
    args = ("--kv-events-port", str(port), "--cluster-secret", SECRET, "--kv-store", "host://",
            "--dtype", "float32")  # fmt: skip
    with running_server(llama_dir, *args, log=tmp_path / "server.log") as srv:
        prompt = " ".join(f"word{i % 37}" for i in range(120))
        body = {"model": str(llama_dir), "prompt": prompt, "max_tokens": 2, "temperature": 0}
        req = urllib.request.Request(
            srv.url + "/v1/completions",
            json.dumps(body).encode(),
            {"Content-Type": "application/json"},
        )
        with urllib.request.urlopen(req, timeout=60) as r:
            assert r.status == 200
        ids = load_tokenizer(llama_dir).encode(prompt)
        view: dict[str, set[bytes]] = {}
        batches: list[KVEventBatch] = []
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and not (batches and not batches[-1].events):
            if sub.poll(500):  # until a keepalive: every batch with events came before it
                batches.append(msgspec.msgpack.decode(sub.recv_multipart()[1], type=KVEventBatch))
        assert batches and not batches[-1].events, "no keepalive within 10 s"
        with_events = [b for b in batches if b.events]
        assert [b.seq for b in with_events] == list(range(1, len(with_events) + 1))
        assert batches[-1].seq == with_events[-1].seq  # a keepalive repeats the last seq
        for b in with_events:
            apply(view, b.events)

        snap = _snapshot(srv.url)
        assert snap.seq == batches[-1].seq and snap.instance == batches[-1].instance
        assert set(snap.tiers[DEVICE]) == view[DEVICE] and set(snap.tiers[HOST]) == view[HOST]
        # the root keys as the engine builds them (a router reads them from the registry)
        keys = [model_fingerprint(llama_dir), "kv=float32", "block_size=16"]
        raw = hash_blocks(root_hash(*keys), ids, 16)
        want = set(seal(events_key(SECRET), raw))  # sealed: only the secret's holders match
        assert len(want) >= 7 and not set(raw) & (view[DEVICE] | view[HOST])
        assert want <= view[DEVICE]  # every full prompt block is in the pool's index
        assert want <= view[HOST]  # and was saved to the host tier

        for bad in (None, "wrong"):
            with pytest.raises(urllib.error.HTTPError) as e:
                _snapshot(srv.url, bad)
            assert e.value.code in (401, 403)
    sub.close(linger=0)


def test_a_kv_events_port_in_use_is_refused_at_start(llama_dir, tmp_path):
    sock = zmq.Context.instance().socket(zmq.PUB)
    port = sock.bind_to_random_port("tcp://127.0.0.1")
    try:
        out = subprocess.run(
            [sys.executable, "-m", "kvserve.cli", "serve", "--model", str(llama_dir),
             "--port", str(free_port()), "--kv-events-port", str(port)],
            capture_output=True, text=True, timeout=120,
        )  # fmt: skip
        assert out.returncode != 0
        assert f"cannot publish KV events on port {port}" in out.stderr + out.stdout
    finally:
        sock.close(linger=0)


def test_the_events_port_listens_where_routers_reach_the_worker():
    from kvserve.server.kv_events import bind_host

    assert bind_host("0.0.0.0", "http://10.1.2.3:8000") == "10.1.2.3"
    assert bind_host("127.0.0.1", "http://10.1.2.3:8000") == "127.0.0.1"
    assert bind_host("0.0.0.0", None) == "0.0.0.0"
