"""The KV store with the hybrid KV layout: a stored block holds every layer's rows in
layer order whatever the layout (each layer's taken from its group's page), so a hybrid
engine restores its own blocks after a restart and reads a uniform engine's, and back."""

from __future__ import annotations

from pathlib import Path

import pytest
from helpers import make_engine, random_prompts, run_counting

PROMPT = random_prompts([100], seed=22)[0]  # 6 full blocks, many 12-token windows long


def _engine(model: Path, layout: str, store: Path | None = None):
    kw = {} if store is None else {"kv_store": (f"file://{store}?capacity=64MiB",)}
    engine = make_engine(model, kv_layout=layout, **kw)
    assert engine.kv.hybrid == (layout == "hybrid")
    return engine


@pytest.fixture(scope="module")
def reference(model_dirs):
    tokens, cached, _ = run_counting(_engine(model_dirs["gemma3"], "uniform"), PROMPT)
    assert cached == 0
    return tokens


@pytest.mark.parametrize(
    ("writer", "reader"),
    [("hybrid", "hybrid"), ("uniform", "hybrid"), ("hybrid", "uniform")],
)
def test_stored_blocks_restore_across_layouts(model_dirs, tmp_path, reference, writer, reader):
    first = _engine(model_dirs["gemma3"], writer, tmp_path)
    assert run_counting(first, PROMPT)[0] == reference
    assert first.offloader is not None and first.offloader.num_saved_blocks == 6
    first.close()
    second = _engine(model_dirs["gemma3"], reader, tmp_path)
    tokens, cached, computed = run_counting(second, PROMPT)
    assert tokens == reference
    assert cached == 96 and computed == 4 + 7  # 6 blocks restored, the rest computed
    assert second.offloader is not None and second.offloader.num_loaded_blocks == 6
    second.check_integrity()
    second.close()


def test_pushed_blocks_prewarm_every_group(model_dirs, tmp_path, reference):
    """A standby push (or a disaggregated hand-over) into a hybrid engine: each block gets
    a page in every group, named as prefix caching names it, and the request finds them
    all as a device prefix hit (nothing read from its own, empty, store)."""
    from kvserve.store import serde

    first = _engine(model_dirs["gemma3"], "hybrid", tmp_path / "a")
    assert run_counting(first, PROMPT)[0] == reference
    assert first.offloader is not None
    hashes = first.kv.hashes_for(PROMPT[:96], None)
    fmt = first.offloader.block_format()
    items = []
    for i, (key, value) in enumerate(zip(hashes, first.offloader.store.get(hashes), strict=True)):
        tokens = PROMPT[i * 16 : (i + 1) * 16]
        payload = serde.check(fmt, key, value, tokens)
        assert not isinstance(payload, str), payload
        items.append((key, tokens, payload))
    first.close()
    standby = make_engine(
        model_dirs["gemma3"], kv_store=(f"file://{tmp_path / 'b'}?capacity=64MiB",),
        prewarm_device_fraction=0.5,
    )  # fmt: skip
    assert standby.kv.hybrid and standby.offloader is not None
    load = standby.offloader.place_warm(items)
    assert load is not None and load.groups == 2 and len(load.blocks) == 2 * 6
    assert standby.offloader.place_warm(items) is None  # named already: nothing twice
    standby.scheduler.add_copies(load)
    tokens, cached, _ = run_counting(standby, PROMPT)
    assert tokens == reference and cached == 96
    assert standby.offloader.num_loaded_blocks == 0
    standby.check_integrity()
    standby.close()
