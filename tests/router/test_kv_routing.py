"""Prefix-aware routing on real processes (issues 18 and 46): two workers publishing KV
events, a router started with no ``--tokenizer`` (it takes the tokenizer from a worker),
one ``redis-server`` as coordinator and shared KV tier, the official ``openai`` client.

A request sharing a 1k-token document with an earlier one (another session, no session
id) lands on the worker holding it and reports those tokens as cached — for completions
and for chat; a router restarted mid-run rebuilds its index from the workers' snapshots
and routes the same way, as does a second router beside it started with ``--tokenizer``
(the override: nothing fetched); with the holder draining the request goes to the other
worker, which restores the prefix from the shared tier."""

from __future__ import annotations

import json
import signal
import urllib.error
import urllib.request

import pytest
import redis
from router_client import router_client

from kvserve.kv.hashing import hash_blocks, root_hash
from kvserve.model.tokenizer import load_tokenizer
from kvserve.testing.cluster import SECRET, cluster, router_view
from kvserve.testing.procs import wait_until

WORDS = ["alpha", "beta", "gamma", "delta", "river", "stone", "cloud", "maple", "orbit"]


def _document(tok, min_tokens: int) -> str:
    words: list[str] = []
    i = 0
    while len(tok.encode(" ".join(words))) < min_tokens:
        words += [WORDS[(i * 7 + k) % len(WORDS)] for k in range(16)]
        i += 1
    return " ".join(words)


def _metric(router, name: str, having: str = "") -> float:
    return router.metric(name, having)


def _synced(router, nodes=("a", "b"), min_device: int = 0, holder: str | None = None) -> bool:
    view = {w["id"]: w["kv_index"] for w in router_view(router)["workers"]}
    if not all(view.get(n) and view[n]["synced"] for n in nodes):
        return False
    return holder is None or view[holder]["device"] >= min_device


def _complete(client, model, prompt):
    raw = client.completions.with_raw_response.create(
        model=model, prompt=prompt, max_tokens=4, temperature=0.0
    )
    out = raw.parse()
    return raw.headers["x-kvserve-worker"], out.usage.prompt_tokens_details.cached_tokens


def _tokenizer_source(router) -> str | None:
    """Where the router's one tokenizer came from (``worker N`` / ``--tokenizer DIR``)."""
    held = router_view(router)["tokenizers"]["held"]
    return next(iter(held.values()), None)


def test_a_shared_document_is_routed_to_its_holder(llama_dir, tmp_path):
    tok = load_tokenizer(llama_dir)
    doc = _document(tok, 1024)
    n_doc = len(tok.encode(doc))
    with cluster(llama_dir, tmp_path, worker_args=("--max-model-len", "1536")) as c:
        router = c.routers[0]  # no --tokenizer: it takes the workers' (one fingerprint)
        view = router_view(router)
        assert view["routing"] == "prefix"
        assert {w["tokenizer_fp"] for w in view["workers"]} == {tok.fingerprint}
        wait_until(lambda: _tokenizer_source(router) is not None, 30, "the tokenizer fetched")
        assert _tokenizer_source(router) in ("worker a", "worker b")
        assert router_view(router)["tokenizers"]["held"].keys() == {tok.fingerprint}
        assert _metric(router, "kvserve_router_tokenizer_fetches_total", 'outcome="ok"') == 1
        assert _metric(router, "kvserve_router_tokenizers", 'source="worker"') == 1
        assert "taken from worker" in router.log.read_text()
        wait_until(lambda: _synced(router), 30, "the router's index synced with both workers")
        client = router_client(router)
        model = str(llama_dir)

        holder, cached = _complete(client, model, doc + " first question")
        assert cached == 0
        blocks = n_doc // 16 - 1
        wait_until(lambda: _synced(router, min_device=blocks, holder=holder), 30, "events")
        for i in range(3):  # other sessions (ephemeral ids): each lands on the holder
            w, cached = _complete(client, model, f"{doc} question number {i}")
            assert w == holder, f"request {i} went to {w}, not to the holder {holder}"
            assert cached >= n_doc - 32
        assert _metric(router, "kvserve_router_decisions_total", 'reason="prefix"') >= 3
        predicted = _metric(router, "kvserve_router_cached_tokens_total", 'kind="predicted"')
        actual = _metric(router, "kvserve_router_cached_tokens_total", 'kind="actual"')
        assert predicted >= 3 * (n_doc - 32) and abs(actual - predicted) <= 3 * 32

        # chat: the document as a system prompt, another user turn each time
        def chat(q: str):
            raw = client.chat.completions.with_raw_response.create(
                model=model,
                messages=[{"role": "system", "content": doc}, {"role": "user", "content": q}],
                max_tokens=4,
                temperature=0.0,
            )
            return raw.headers["x-kvserve-worker"], raw.parse().usage

        chat_holder, _ = chat("what is it about?")
        wait_until(
            lambda: (
                _metric(router, "kvserve_router_kv_event_batches_total") > 0
                and _synced(router, min_device=blocks, holder=chat_holder)
            ),
            30,
            "chat events",
        )
        w, usage = chat("who wrote it?")
        assert w == chat_holder and usage.prompt_tokens_details.cached_tokens >= n_doc - 32

        # a new router knows nothing: it reads both workers' snapshots and routes the same
        router.proc.send_signal(signal.SIGKILL)
        router.proc.wait(10)
        c.routers.clear()
        router = c.add_router()
        wait_until(lambda: _synced(router, min_device=blocks, holder=holder), 30, "snapshots")
        wait_until(lambda: _tokenizer_source(router) is not None, 30, "the tokenizer again")
        assert _metric(router, "kvserve_router_kv_snapshots_total") >= 2
        w, cached = _complete(router_client(router), model, doc + " after the restart")
        assert w == holder and cached >= n_doc - 32
        # a second router, beside it, builds the same index and places the same way; it
        # has --tokenizer (the override), so it fetches nothing
        second = c.add_router("--tokenizer", str(llama_dir))
        wait_until(lambda: _synced(second, min_device=blocks, holder=holder), 30, "second")
        assert _tokenizer_source(second) == f"--tokenizer {llama_dir}"
        for r in (router, second):
            assert _complete(router_client(r), model, doc + " two routers")[0] == holder
        assert _metric(second, "kvserve_router_tokenizer_fetches_total") == 0
        assert _metric(second, "kvserve_router_tokenizers", 'source="flag"') == 1
        assert _metric(second, "kvserve_router_decisions_total", 'reason="prefix"') == 1

        # the tokenizer endpoint is internal: no cluster secret, no tokenizer
        with pytest.raises(urllib.error.HTTPError) as e:
            urllib.request.urlopen(c.workers[holder].url + "/internal/tokenizer", timeout=5)
        assert e.value.code == 401

        # the holder drains: the other worker restores the document from the shared tier
        ids = tok.encode(doc + " while draining")
        info = c.coord.nodes()[holder]
        keys = hash_blocks(root_hash(*info["cache_keys"]), ids, info["block_size"])
        r = redis.Redis.from_url(c.url)
        last = keys[(n_doc // 16) - 2].hex()  # a block of the document near its end
        wait_until(lambda: bool(r.keys(f"*{last}")), 30, "the document in the shared tier")
        req = urllib.request.Request(
            c.workers[holder].url + "/internal/drain",
            json.dumps({"drain": True}).encode(),
            {"X-Kvserve-Cluster-Secret": SECRET, "Content-Type": "application/json"},
        )
        urllib.request.urlopen(req, timeout=5).read()
        other = next(n for n in c.workers if n != holder)
        wait_until(
            lambda: [w["id"] for w in router_view(router)["workers"] if w["routable"]] == [other],
            30,
            "the holder out of rotation",
        )
        w, cached = _complete(router_client(router), model, doc + " while draining")
        assert w == other and cached >= n_doc - 48
