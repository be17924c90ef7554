"""Cluster coordination against a real ``redis-server``: leases expire, epochs fence a
stale owner's writes atomically, and racing takeovers have exactly one winner."""

from __future__ import annotations

import threading

import pytest

from kvserve.ha.coordination import Coordinator
from kvserve.ha.record import SessionRecord
from kvserve.sampling import SamplingParams
from kvserve.testing.procs import wait_until
from kvserve.testing.redis_procs import redis_server


@pytest.fixture(scope="module")
def url(tmp_path_factory):
    with redis_server(tmp_path_factory.mktemp("ha")) as server:
        yield f"redis://127.0.0.1:{server.port}/0"


def test_nodes_live_while_they_heartbeat(url):
    c = Coordinator.from_url(url, prefix="t-nodes", lease_s=0.3)
    c.register("a", "http://a", role="worker")
    c.register("b", "http://b")
    assert set(c.nodes()) == {"a", "b"} and c.nodes()["a"]["role"] == "worker"
    stop = threading.Event()

    def beat():  # a keeps heart-beating, b stops
        while not stop.wait(0.1):
            c.heartbeat("a", "http://a", role="worker")

    t = threading.Thread(target=beat)
    t.start()
    try:
        wait_until(lambda: set(c.nodes()) == {"a"}, 10, "b's lease to expire")
    finally:
        stop.set()
        t.join(5)
    c.deregister("a")
    assert c.nodes() == {}


def test_a_stale_owner_is_fenced(url):
    c = Coordinator.from_url(url, prefix="t-fence")
    e1 = c.take_over("s", "primary")
    assert e1 == 1
    assert c.write_state("s", "primary", e1, b"tokens 1..16")
    e2 = c.take_over("s", "standby", seen_epoch=e1)  # failover
    assert e2 == 2
    assert not c.write_state("s", "primary", e1, b"late tokens")  # the paused primary
    assert not c.write_state("s", "primary", e2, b"wrong node, right epoch")
    assert c.write_state("s", "standby", e2, b"tokens 1..32")
    own = c.owner("s")
    assert (own.node, own.epoch, own.state) == ("standby", 2, b"tokens 1..32")
    assert not c.release("s", "primary", e1)
    assert c.release("s", "standby", e2) and c.owner("s") is None


def test_racing_takeovers_have_one_winner(url):
    c = Coordinator.from_url(url, prefix="t-race")
    seen = c.take_over("s", "primary")
    results = []
    barrier = threading.Barrier(8)

    def router(i: int) -> None:
        mine = Coordinator.from_url(url, prefix="t-race")
        barrier.wait(10)
        results.append((i, mine.take_over("s", f"standby{i}", seen_epoch=seen)))

    threads = [threading.Thread(target=router, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(10)
    winners = [(i, e) for i, e in results if e is not None]
    assert len(results) == 8 and len(winners) == 1
    i, epoch = winners[0]
    assert epoch == seen + 1 and c.owner("s").node == f"standby{i}"


def test_the_primary_replicates_session_state_and_a_fenced_primary_stops(url, llama_dir):
    """An engine in a cluster publishes each session's record after its first token,
    every 16 tokens and at the end; once another node takes the session over, the old
    primary's writes are refused, it drops the request, and the new owner's state is never
    overwritten."""
    import json

    from helpers import greedy, make_engine, random_prompts, step_finished

    engine = make_engine(llama_dir, cluster=url, node_id="primary", replicate_every=16)
    engine.replicator.linger_s = 0
    coord = Coordinator.from_url(url)
    prompt = random_prompts([20], seed=4)[0]
    engine.add_request("r1", prompt, greedy(40), session_id="chat-1")
    # Flushed after every step: a record still queued when the next one for its session
    # comes is replaced by it (by design), so without the flush the count below would
    # depend on how fast the engine steps against the publisher thread.
    done: dict[str, list[int]] = {}
    for _ in range(100):
        if not engine.has_unfinished_requests():
            break
        step_finished(engine, done)
        assert engine.replicator.flush()
    assert not engine.has_unfinished_requests()
    own = coord.owner("chat-1")
    record = json.loads(own.state)
    assert (own.node, own.epoch) == ("primary", 1)
    assert record["output_token_ids"] == done["r1"] and record["finished"]
    assert record["prompt_token_ids"] == prompt and record["params"]["max_tokens"] == 40
    assert record["stored_tokens"] % 16 == 0 and record["epoch"] == 1
    # after the prompt (how it was computed), at 16, 32 and at the end (40)
    assert engine.replicator.num_published == 4
    assert record["prefill_from"] == 0

    req = engine.add_request("r2", prompt, greedy(200), session_id="chat-2")
    for _ in range(20):
        engine.step()
    assert engine.replicator.flush() and coord.owner("chat-2").node == "primary"
    epoch = coord.take_over("chat-2", "standby", seen_epoch=coord.owner("chat-2").epoch)
    assert coord.write_state("chat-2", "standby", epoch, b"standby state")
    for _ in range(200):  # the primary's next publish is refused; it drops the request
        if req.is_finished:
            break
        engine.step()
        engine.replicator.flush()
    assert req.status.value == "abort" and len(req.output_token_ids) < 200
    assert coord.owner("chat-2").state == b"standby state"
    engine.close()


@pytest.mark.parametrize("temperature", [0.0, 0.9])
def test_a_standby_resumes_the_stream_exactly(url, llama_dir, temperature):
    """Primary A replicates a session (KV blocks to the shared Redis tier, the record to
    the coordinator) and is abandoned mid-stream; standby B resumes from the record and the
    tokens the client already has: delivered + B's tokens equal an uninterrupted run, B
    restored the replicated KV instead of recomputing it, and A, stepping on, is fenced."""
    import json

    from helpers import make_engine, random_prompts, run_to_end

    from kvserve.sampling import SamplingParams

    params = SamplingParams(temperature=temperature, seed=11, max_tokens=60, ignore_eos=True)
    prompt = random_prompts([70], seed=9)[0]
    plain = make_engine(llama_dir)
    plain.add_request("ref", prompt, params)
    want = run_to_end(plain)["ref"]

    session = f"failover-{temperature}"
    ha = dict(kv_store=(url,), cluster=url, replicate_every=16)
    a = make_engine(llama_dir, node_id="a", **ha)
    req = a.add_request("x", prompt, params, session_id=session)
    while len(req.output_token_ids) < 37:  # 2 records published (16, 32), 5 tokens unsynced
        a.step()
    assert a.replicator.flush() and a.offloader.store.flush()
    delivered = list(req.output_token_ids)

    coord = Coordinator.from_url(url)
    owner = coord.owner(session)
    record = SessionRecord.from_json(owner.state)
    assert owner.node == "a" and len(record.output_token_ids) == 32
    b = make_engine(llama_dir, node_id="b", **ha)
    resumed = b.resume_request("x-b", record, delivered, seen_epoch=owner.epoch)
    out = run_to_end(b)["x-b"]
    assert out == want  # delivered + continuation, no token lost or repeated
    assert out[: len(delivered)] == delivered
    assert resumed.num_cached_tokens >= 96 and b.offloader.num_loaded_blocks >= 6
    assert coord.owner(session).node == "b"

    for _ in range(50):  # the old primary steps on: fenced at its next publish
        if req.is_finished:
            break
        a.step()
        a.replicator.flush()
    assert req.status.value == "abort"
    assert json.loads(coord.owner(session).state)["output_token_ids"] == want
    with pytest.raises(Exception, match="taken over"):  # a late resume loses the race
        a.resume_request("x-late", record, delivered, seen_epoch=owner.epoch)
    a.close()
    b.close()


def test_a_hybrid_engine_replicates_and_its_standby_resumes_exactly(url, model_dirs):
    """Gemma 3's sliding and global layers in the hybrid layout (``auto`` in a cluster):
    primary A replicates a session, standby B resumes it from the record, restoring the
    stored blocks into a page in every group; the stream equals an uninterrupted run."""
    from helpers import make_engine, random_prompts, run_to_end

    from kvserve.sampling import SamplingParams

    model = model_dirs["gemma3"]
    params = SamplingParams(temperature=0.8, seed=3, max_tokens=50, ignore_eos=True)
    prompt = random_prompts([70], seed=13)[0]  # many 12-token windows long
    plain = make_engine(model)
    plain.add_request("ref", prompt, params)
    want = run_to_end(plain)["ref"]
    ha = dict(kv_store=(url,), cluster=url, replicate_every=16)
    a = make_engine(model, node_id="ha-a", **ha)
    assert a.kv.hybrid
    req = a.add_request("x", prompt, params, session_id="hybrid")
    while len(req.output_token_ids) < 37:
        a.step()
    assert a.replicator.flush() and a.offloader.store.flush()
    delivered = list(req.output_token_ids)
    coord = Coordinator.from_url(url)
    owner = coord.owner("hybrid")
    record = SessionRecord.from_json(owner.state)
    b = make_engine(model, node_id="ha-b", **ha)
    assert b.kv.hybrid
    resumed = b.resume_request("x-b", record, delivered, seen_epoch=owner.epoch)
    assert run_to_end(b)["x-b"] == want
    assert resumed.num_cached_tokens >= 96 and b.offloader.num_loaded_blocks >= 6
    b.check_integrity()
    a.close()
    b.close()


def test_a_standby_prewarms_the_session_and_resumes_from_its_host_tier(url, llama_dir):
    """The primary names standby B; each publish tells B, whose pre-warmer copies the
    session's replicated blocks from Redis into B's host tier. B's takeover then reads
    them from local memory: no Redis read during the resume."""

    from helpers import make_engine, random_prompts, run_to_end

    from kvserve.sampling import SamplingParams

    params = SamplingParams(temperature=0.7, seed=5, max_tokens=80, ignore_eos=True)
    prompt = random_prompts([60], seed=21)[0]
    ha = dict(kv_store=(url,), cluster=url, replicate_every=16)
    a = make_engine(llama_dir, node_id="a", **ha)
    b = make_engine(llama_dir, node_id="b", **ha)
    req = a.add_request("x", prompt, params, session_id="warm", standby="b")
    while len(req.output_token_ids) < 48:  # a record was just published: it covers all
        a.step()
    assert a.replicator.flush() and a.offloader.store.flush()
    coord = Coordinator.from_url(url)
    record = SessionRecord.from_json(coord.owner("warm").state)
    assert record.standby == "b"
    stored = record.stored_tokens // 16
    assert stored == (len(prompt) + 48 - 1) // 16
    wait_until(lambda: b.prewarmer.num_blocks >= stored, 20, "standby pre-warmed")
    host, shared = b.offloader.store.stats
    host_hits, shared_hits = host.hits, shared.hits
    delivered = list(req.output_token_ids)
    resumed = b.resume_request("x-b", record, delivered, seen_epoch=coord.owner("warm").epoch)
    out = run_to_end(b)["x-b"]
    plain = make_engine(llama_dir)
    plain.add_request("ref", prompt, params)
    assert out == run_to_end(plain)["ref"]
    assert resumed.num_cached_tokens >= stored * 16
    assert host.hits - host_hits >= stored and shared.hits == shared_hits
    a.close()
    b.close()


def test_a_newer_request_of_the_session_on_the_same_node_is_not_fenced(url, llama_dir):
    """A node resuming (or starting the next turn of) a session it served moves the epoch
    itself: the older request's late write is refused and dropped, and the newer request
    is not aborted as if another node had taken the session over."""
    import json

    from helpers import greedy, make_engine, random_prompts, run_to_end

    engine = make_engine(llama_dir, kv_store=(url,), cluster=url, node_id="n", replicate_every=16)
    coord = engine.replicator.coord
    real_write, gate = coord.write_states, threading.Event()

    def held_write(items):  # the last turn-1 record waits for the gate
        if any(json.loads(state)["finished"] for *_, state in items):
            gate.wait(30)
        return real_write(items)

    coord.write_states = held_write
    prompt = random_prompts([20], seed=8)[0]
    old = engine.add_request("turn-1", prompt, greedy(40), session_id="same")
    run_to_end(engine)  # its final record is now held in the publisher
    record = SessionRecord(
        session_id="same", tenant="default", prompt_token_ids=prompt, seed=1,
        params=SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True),
    )  # fmt: skip
    new = engine.resume_request("turn-2", record, old.output_token_ids[:18])
    gate.set()  # turn-1's write (epoch 1) reaches Redis after turn-2 took epoch 2: refused
    assert engine.replicator.flush()
    done = run_to_end(engine)
    assert engine.replicator.flush()
    assert done["turn-2"] == old.output_token_ids and new.status.value != "abort"
    assert engine.replicator.num_fenced == 0
    assert json.loads(Coordinator.from_url(url).owner("same").state)["epoch"] == 2
    engine.close()


@pytest.mark.parametrize("seed,k", [(0, 44), (1, 57), (2, 18), (3, 44)])
def test_resumed_sampling_is_exact_on_the_default_model(url, seed, k):
    """Sampled (temperature 0.8) continuations on the bundled bf16 model: restoring the
    primary's blocks and replaying the delivered tail one decode step at a time gives the
    uninterrupted run's tokens. (These (seed, k) pairs diverged when the tail was
    recomputed as one prefill chunk: different kernels round differently, and a sampling
    draw near a boundary flips.)"""

    from helpers import run_to_end

    from kvserve.config import EngineArgs
    from kvserve.default_model import default_model_path
    from kvserve.engine.llm_engine import LLMEngine
    from kvserve.sampling import SamplingParams

    def engine(node: str) -> LLMEngine:
        return LLMEngine(
            EngineArgs(
                model=str(default_model_path()), kv_cache_memory="64MiB", kv_store=(url,),
                cluster=url, node_id=node, replicate_every=16,
            )
        )  # fmt: skip

    a, b = engine("a"), engine("b")
    params = SamplingParams(temperature=0.8, seed=seed, max_tokens=120, ignore_eos=True)
    a.add_request("r", f"Once upon a time number {seed}, there was a", params, session_id="s")
    want = run_to_end(a)["r"]
    assert a.replicator.flush() and a.offloader.store.flush()
    record = SessionRecord.from_json(Coordinator.from_url(url).owner("s").state)
    b.resume_request("r-b", record, want[:k])
    assert run_to_end(b)["r-b"] == want
    a.close()
    b.close()
