"""``--replicate-to s3``: session checkpoints in the S3 tier (real ``redis-server``, S3 by
``moto`` — no real S3 endpoint can run here). A worker of another site, whose Redis never
saw the session, continues it exactly from the S3 checkpoint and the blocks in S3."""

from __future__ import annotations

import json
import urllib.request

import pytest
from helpers import make_engine, run_to_end

from kvserve.engine.llm_engine import EngineError
from kvserve.sampling import SamplingParams
from kvserve.testing.cluster import SECRET
from kvserve.testing.procs import ServerProcess
from kvserve.testing.redis_procs import redis_server

pytestmark = pytest.mark.usefixtures("aws_env")


@pytest.fixture(scope="module")
def two_sites(tmp_path_factory):
    root = tmp_path_factory.mktemp("sites")
    (root / "a").mkdir()
    (root / "b").mkdir()
    with redis_server(root / "a") as ra, redis_server(root / "b") as rb:
        yield f"redis://127.0.0.1:{ra.port}/0", f"redis://127.0.0.1:{rb.port}/0"


def test_another_site_resumes_a_session_from_its_s3_checkpoint(two_sites, moto, llama_dir):
    site_a, site_b = two_sites
    s3 = moto.url("ckpt")
    params = SamplingParams(temperature=0.8, seed=3, max_tokens=60, ignore_eos=True)
    prompt = list(range(5, 45))
    plain = make_engine(llama_dir)
    plain.add_request("ref", prompt, params)
    want = run_to_end(plain)["ref"]

    ha = dict(replicate_every=16, replicate_to=("s3",), checkpoint_interval=0.0)
    a = make_engine(llama_dir, kv_store=(site_a, s3), cluster=site_a, node_id="a", **ha)
    req = a.add_request("x", prompt, params, session_id="trip")
    a.replicator.linger_s = 0  # every record published (and checkpointed) on its own
    while len(req.output_token_ids) < 32:  # checkpoints after the prompt, at 16 and 32
        a.step()
    assert a.replicator.flush() and a.offloader.store.flush()
    assert a.replicator.checkpointer.num_written == 3

    b = make_engine(llama_dir, kv_store=(site_b, s3), cluster=site_b, node_id="b", **ha)
    assert b.replicator.coord.owner("trip") is None  # site B's Redis never saw it
    record = b.replicator.checkpointer.read("trip")
    assert record is not None and record.output_token_ids == want[:32]
    assert b.replicator.checkpointer.read("unknown") is None
    resumed = b.resume_request("x-b", record, want[:35])
    assert run_to_end(b)["x-b"] == want
    assert resumed.num_cached_tokens >= 64  # blocks came from S3, not recomputed
    a.close()
    b.close()


def test_s3_checkpoints_need_an_s3_tier(two_sites, llama_dir):
    with pytest.raises(EngineError, match="s3:// --kv-store tier"):
        make_engine(llama_dir, kv_store=(two_sites[0],), cluster=two_sites[0], replicate_to=("s3",))
    with pytest.raises(ValueError, match="replicate-to"):
        make_engine(llama_dir, cluster=two_sites[0], replicate_to=("tape",))


def test_a_worker_resumes_from_the_s3_checkpoint_over_http(two_sites, moto, llama_dir, tmp_path):
    """The same through ``POST /internal/resume`` of a ``kvserve serve`` worker at site B:
    its Redis has no record, so the API server asks its engine core for the S3 checkpoint
    (a ReadCheckpoint call over the wire). The client's request has no seed, so only the
    checkpoint's seed (the one A drew) continues A's stream token for token."""
    site_a, site_b = two_sites
    s3 = moto.url("ckpt-http")
    params = SamplingParams(temperature=0.8, max_tokens=60, ignore_eos=True)  # no seed
    prompt = list(range(7, 47))
    ha = dict(replicate_every=16, replicate_to=("s3",), checkpoint_interval=0.0)
    a = make_engine(llama_dir, kv_store=(site_a, s3), cluster=site_a, node_id="a2", **ha)
    a.replicator.linger_s = 0
    a.add_request("y", prompt, params, session_id="trip-http")
    want = run_to_end(a)["y"]
    assert a.replicator.flush() and a.offloader.store.flush()
    a.close()

    b = ServerProcess(
        llama_dir, "--kv-store", site_b, "--kv-store", s3, "--cluster", site_b,
        "--node-id", "b2", "--replicate-to", "s3", "--cluster-secret", SECRET,
        "--kv-cache-memory", "16MiB", "--max-model-len", "256", log=tmp_path / "b.log",
    )  # fmt: skip
    try:
        b.wait_ready()
        body = {
            "session_id": "trip-http",
            "delivered_token_ids": want[:35],
            "kind": "completion",
            "request": {
                "prompt": prompt, "max_tokens": 60, "temperature": 0.8, "ignore_eos": True,
                "return_token_ids": True,
            },
        }  # fmt: skip
        req = urllib.request.Request(
            b.url + "/internal/resume", data=json.dumps(body).encode(), method="POST"
        )
        req.add_header("Content-Type", "application/json")
        req.add_header("X-Kvserve-Cluster-Secret", SECRET)
        with urllib.request.urlopen(req, timeout=60) as r:
            choice = json.loads(r.read())["choices"][0]
        assert choice["token_ids"] == want  # delivered + continuation with A's seed
        assert b.metric("kvserve_kv_store_loaded_blocks_total") >= 2  # A's blocks, from S3
    finally:
        assert b.stop() == 0, (tmp_path / "b.log").read_text()[-2000:]
