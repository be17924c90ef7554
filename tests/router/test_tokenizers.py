"""A worker's tokenizer, shipped to a router (issue 46): the export rebuilds exactly the
worker's tokenizer — an HF directory's and a GGUF file's converted one alike — or is
refused, and the router's ``Tokenizers`` fetches one per fingerprint, verifies it, backs
off on failures (logged once) and never shares a tokenizer across fingerprints.

The fetch tests answer through ``httpx.MockTransport`` with real exports: a worker cannot
be made to fail in these precise ways (the end-to-end fetch from real workers is in
test_kv_routing.py)."""

from __future__ import annotations

import asyncio
import json
import logging
import shutil
import time
from pathlib import Path
from types import SimpleNamespace

import httpx
import msgspec
import pytest

from kvserve.model.gguf import resolve_model
from kvserve.model.tokenizer import load_tokenizer
from kvserve.router.metrics import RouterMetrics
from kvserve.router.tokenizers import BACKOFF_S, Tokenizers, load_override
from kvserve.router.workers import Worker
from kvserve.server.protocol import ChatCompletionRequest
from kvserve.server.tokenizer_export import (
    TOKENIZER_PATH,
    TokenizerExport,
    export_tokenizer,
    rebuild_tokenizer,
)

CHAT = {"messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hé"}]}


def _same(a, b) -> None:
    assert a.fingerprint == b.fingerprint
    text = "The quick brown fox — naïve café, 日本語 and <|im_end|> too"
    assert a.encode(text) == b.encode(text)
    req = ChatCompletionRequest.model_validate(CHAT)
    assert req.prompt_ids(a) == req.prompt_ids(b)
    assert (a.eos_token_id, a.bos_token_id, a.vocab_size) == (
        b.eos_token_id,
        b.bos_token_id,
        b.vocab_size,
    )


def test_an_export_rebuilds_the_workers_tokenizer(llama_dir):
    tok = load_tokenizer(llama_dir)
    rebuilt = rebuild_tokenizer(export_tokenizer(tok), tok.fingerprint)
    _same(tok, rebuilt)
    assert rebuilt.source == tok.source  # messages name the worker's directory


def test_a_gguf_models_tokenizer_travels_the_same_way(gguf_file):
    """A worker serving a GGUF file loaded its tokenizer from the converted directory;
    the export carries that directory's files (no GGUF on the router)."""
    tok = load_tokenizer(resolve_model(str(gguf_file)))
    assert tok is not None and tok.chat_template
    data = export_tokenizer(tok)
    exp = msgspec.msgpack.decode(data, type=TokenizerExport)
    assert set(exp.files) == {"tokenizer.json", "tokenizer_config.json"}
    _same(tok, rebuild_tokenizer(data, tok.fingerprint))


def test_an_export_that_does_not_rebuild_to_its_fingerprint_is_refused(llama_dir, tmp_path):
    model = Path(shutil.copytree(llama_dir, tmp_path / "m"))
    tok = load_tokenizer(model)
    fp = tok.fingerprint
    cfg = json.loads((model / "tokenizer_config.json").read_text())
    cfg["chat_template"] = "{{ messages[0].content }}"  # changed on disk after the load
    (model / "tokenizer_config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="changed on disk"):
        rebuild_tokenizer(export_tokenizer(tok), fp)
    with pytest.raises(ValueError, match="not other"):
        rebuild_tokenizer(export_tokenizer(tok), "other")
    sneaky = TokenizerExport(fp, "x", {"tokenizer.json": b"{}", "../evil": b""})
    with pytest.raises(ValueError, match="unknown files"):
        rebuild_tokenizer(msgspec.msgpack.encode(sneaky), fp)
    with pytest.raises(ValueError, match="unreadable"):
        rebuild_tokenizer(b"\x93 not an export", fp)
    with pytest.raises(ValueError, match=r"no tokenizer\.json"):
        load_override(str(tmp_path))


def _fetches(metrics: RouterMetrics, outcome: str) -> float:
    value = metrics.registry.get_sample_value(
        "kvserve_router_tokenizer_fetches_total", {"outcome": outcome}
    )
    return value or 0.0


def _w(node: str, fp: str | None, **info) -> Worker:
    return Worker(node, f"http://{node}", {"tokenizer_fp": fp, **info}, healthy=True)


async def _settle(t: Tokenizers) -> None:
    while t._fetching:
        await asyncio.gather(*t._fetching.values(), return_exceptions=True)


def test_the_router_fetches_each_fingerprint_once_verifies_it_and_backs_off(
    llama_dir, gguf_file, caplog
):
    llama = load_tokenizer(llama_dir)
    smol = load_tokenizer(resolve_model(str(gguf_file)))
    exports = {llama.fingerprint: export_tokenizer(llama), smol.fingerprint: export_tokenizer(smol)}
    answers: dict[str, list[int]] = {"a": [500], "b": [200], "c": [200], "d": [200], "e": [200]}
    served: dict[str, str] = {"a": llama.fingerprint, "b": llama.fingerprint}
    served |= {"c": smol.fingerprint, "d": "f" * 16, "e": llama.fingerprint}
    asked: list[str] = []

    def answer(request: httpx.Request) -> httpx.Response:
        node = request.url.host
        asked.append(node)
        assert request.url.path == TOKENIZER_PATH
        assert request.headers["x-kvserve-cluster-secret"] == "s3cret"
        status = answers[node].pop(0) if len(answers[node]) > 1 else answers[node][0]
        if status != 200:
            return httpx.Response(status, text="engine gone")
        fp = served[node]
        return httpx.Response(200, content=exports.get(fp, exports[llama.fingerprint]))

    async def run() -> None:
        http = httpx.AsyncClient(transport=httpx.MockTransport(answer))
        no_pool = SimpleNamespace(workers={}, routable=list)
        metrics = RouterMetrics(lambda: no_pool)
        t = Tokenizers(None, lambda w: http, "s3cret", 1.0, lambda w: w.node_id != "x", metrics)
        a, b = _w("a", llama.fingerprint), _w("b", llama.fingerprint)
        c, d = _w("c", smol.fingerprint), _w("d", "f" * 16)  # d's export is another's
        untrusted = _w("x", "e" * 16)  # another cluster secret: never asked
        workers = {w.node_id: w for w in (a, b, c, d, untrusted)}

        before = time.monotonic()
        t.follow(workers)
        t.follow(workers)  # a fetch per fingerprint in flight at a time
        await _settle(t)
        assert sorted(asked) == ["a", "c", "d"]  # one worker per fingerprint, by id
        assert t.get(smol.fingerprint).fingerprint == smol.fingerprint
        assert t.get(llama.fingerprint) is None and t.get("f" * 16) is None
        assert {o: _fetches(metrics, o) for o in ("ok", "failed", "refused")} == {
            "ok": 1,
            "failed": 1,
            "refused": 1,
        }
        warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
        assert len(warnings) == 2 and any("HTTP 500" in m for m in warnings)
        pending = t._attempts[llama.fingerprint]
        assert before + BACKOFF_S <= pending.retry_at <= time.monotonic() + BACKOFF_S

        for fp in (llama.fingerprint, "f" * 16):  # (the machine may be slower than 1 s)
            t._attempts[fp].retry_at = time.monotonic() + 60
        t.follow(workers)  # within the backoff: nothing asked
        await _settle(t)
        assert len(asked) == 3
        for fp in (llama.fingerprint, "f" * 16):
            t._attempts[fp].retry_at = 0.0  # the backoff has passed
        caplog.clear()
        before = time.monotonic()
        t.follow(workers)
        await _settle(t)
        assert sorted(asked[3:]) == ["b", "d"]  # b: the next worker of its fingerprint
        assert t.get(llama.fingerprint).fingerprint == llama.fingerprint
        assert t._attempts["f" * 16].failures == 2
        retry_at = t._attempts["f" * 16].retry_at  # the backoff doubled
        assert before + 2 * BACKOFF_S <= retry_at <= time.monotonic() + 2 * BACKOFF_S
        assert not [r for r in caplog.records if r.levelno == logging.WARNING]  # logged once
        assert any("taken from worker b" in r.getMessage() for r in caplog.records)
        assert t.view()["held"] == {
            llama.fingerprint: "worker b",
            smol.fingerprint: "worker c",
        }
        assert t.count("worker") == 2 and t.count("flag") == 0

        del workers["c"]  # the model's last worker left: its tokenizer goes too
        t.follow(workers)
        assert t.get(smol.fingerprint) is None
        await t.stop()

        # --tokenizer: its fingerprint is never fetched, and stays without workers
        asked.clear()
        t = Tokenizers(llama, lambda w: http, "s3cret", 1.0)
        t.follow({"a": a, "b": b, "e": _w("e", llama.fingerprint)})
        await _settle(t)
        assert asked == [] and t.get(llama.fingerprint) is llama
        t.follow({})
        assert t.get(llama.fingerprint) is llama and t.count("flag") == 1
        await http.aclose()

    caplog.set_level(logging.DEBUG, logger="kvserve.router")
    asyncio.run(run())
