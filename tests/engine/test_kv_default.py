"""Without --kv-cache-memory a CPU engine sizes its cache to the model: room for 32
sequences of max_model_len, at most 4 GiB (the bundled 14 MB model no longer becomes a
4.5 GB process)."""

from __future__ import annotations

from helpers import make_engine

from kvserve.config import EngineArgs
from kvserve.default_model import default_model_path
from kvserve.engine.llm_engine import LLMEngine


def test_bundled_model_gets_a_small_default_cache():
    engine = LLMEngine(EngineArgs(model=str(default_model_path()), device="cpu"))
    want = 32 * engine.max_model_len
    assert want <= engine.kv.capacity_tokens <= want + 2 * engine.kv.block_size
    assert engine.kv.capacity_tokens * engine.kv_spec.bytes_per_token <= 256 * 1024**2
    engine.close()


def test_an_explicit_size_still_wins(llama_dir):
    engine = make_engine(llama_dir, kv_cache_memory="1MiB")
    assert engine.kv.capacity_tokens < 32 * engine.max_model_len
