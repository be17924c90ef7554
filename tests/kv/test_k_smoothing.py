"""K smoothing (``kvserve.model.kv_smoothing``): an int8 / token-scale fp8 cache stores keys less
their layer's mean key. The C++ write and the PyTorch write store the same codes; the
shift leaves attention's softmax where it was and shrinks the quantization error of keys
with per-channel offsets; the engine calibrates the same shift every start, only for
token-scale caches; and stored blocks written under another shift are a miss."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from helpers import make_engine, random_prompts, run_counting

from kvserve.model.cpu_kernels import load_cpu_kernels
from kvserve.model.kv_quant import QuantizedKVCache, kv_format
from kvserve.model.kv_smoothing import calibration_ids, key_means

H, D, SLOTS = 3, 64, 256
FORMATS = ("int8", "fp8_e4m3", "fp8_e5m2")


def _offset_keys(g: torch.Generator, t: int = 200) -> tuple[torch.Tensor, torch.Tensor]:
    """Keys ``[t, H, D]`` with large per-channel offsets shared by every token (what real
    models' keys have after RoPE), and those offsets ``[H, D]``."""
    mean = torch.zeros(H, D)
    mean[:, :4] = torch.randn(H, 4, generator=g) * 20
    return (torch.randn(t, H, D, generator=g) + mean).bfloat16(), mean


@pytest.mark.parametrize("fmt", FORMATS)
def test_shifted_cpu_write_matches_the_torch_path(fmt):
    assert load_cpu_kernels()
    g = torch.Generator().manual_seed(3)
    k, mean = _offset_keys(g)
    v = torch.randn(k.shape, generator=g).bfloat16()
    slots = torch.randperm(SLOTS, generator=g)[: k.shape[0]]
    caches = []
    for kernel in (True, False):
        c = QuantizedKVCache(kv_format(fmt, torch.bfloat16), SLOTS, H, D, torch.device("cpu"))
        c.set_k_shift(mean)
        (c.write_cpu if kernel else c.write)(slots, k, v)
        caches.append(c)
    a, b = caches
    same = a.scale[:, slots] == b.scale[:, slots]
    assert same.float().mean() > 0.999  # fp8 search ties, as in test_kv_quant_write
    rows = same[0].all(-1)
    assert torch.equal(
        a.data[0].view(torch.uint8)[slots][rows], b.data[0].view(torch.uint8)[slots][rows]
    )
    # stored keys are k - mean: reading back and adding the mean gives k
    back = a.read_slots(0, slots, torch.float32) + mean
    assert (back - k.float()).norm() / k.float().norm() < 0.05


@pytest.mark.parametrize("fmt", FORMATS)
def test_the_shift_keeps_softmax_and_shrinks_its_error(fmt):
    g = torch.Generator().manual_seed(4)
    k, mean = _offset_keys(g)
    q = torch.randn(8, H, D, generator=g)
    slots = torch.arange(k.shape[0])
    exact = torch.einsum("qhd,thd->hqt", q, k.float()).softmax(-1)
    errors = {}
    for shifted in (False, True):
        c = QuantizedKVCache(kv_format(fmt, torch.bfloat16), SLOTS, H, D, torch.device("cpu"))
        if shifted:
            c.set_k_shift(mean)
        c.write(slots, k, k)
        p = torch.einsum("qhd,thd->hqt", q, c.read_slots(0, slots, torch.float32)).softmax(-1)
        errors[shifted] = (p - exact).abs().sum(-1).mean().item()
    assert errors[True] < 0.7 * errors[False], errors


def test_set_k_shift_refuses_head_scales_and_bad_shapes():
    head = QuantizedKVCache(
        kv_format("fp8_e4m3", torch.bfloat16, "head"), 16, H, D, torch.device("cpu")
    )
    with pytest.raises(ValueError, match="per-token scales"):
        head.set_k_shift(torch.zeros(H, D))
    tok = QuantizedKVCache(kv_format("int8", torch.bfloat16), 16, H, D, torch.device("cpu"))
    with pytest.raises(ValueError, match=r"\[3, 64\]"):
        tok.set_k_shift(torch.zeros(D, H))


def _shifts(engine) -> list[torch.Tensor | None]:
    return [getattr(c, "k_shift", None) for c in engine.runner.kv_caches]


def test_engine_calibrates_token_scale_caches_only(llama_dir):
    int8 = make_engine(llama_dir, kv_cache_dtype="int8")
    shifts = _shifts(int8)
    assert all(s is not None and s.dtype == torch.float32 for s in shifts)
    assert any(s.abs().max() > 0 for s in shifts)
    again = make_engine(llama_dir, kv_cache_dtype="int8")  # the same shift every start
    assert all(torch.equal(a, b) for a, b in zip(shifts, _shifts(again), strict=True))
    # it is the mean key of the calibration text, computed by the same forward pass
    spec = int8.kv_spec
    ids = calibration_ids(int8.tokenizer, int8.spec.vocab_size)
    means = key_means(
        int8.model, ids, spec.block_size, int8.max_model_len, int8.dtype, int8.device,
        spec.num_kv_heads, spec.head_dim,
    )  # fmt: skip
    assert all(torch.equal(a, b) for a, b in zip(shifts, means, strict=True))
    off = make_engine(llama_dir, kv_cache_dtype="int8", kv_cache_smooth_k=False)
    assert all(s is None for s in _shifts(off))
    head = make_engine(llama_dir, kv_cache_dtype="fp8_e4m3", kv_cache_scales="head")
    assert all(s is None for s in _shifts(head))
    plain = make_engine(llama_dir)
    assert not any(isinstance(c, QuantizedKVCache) for c in plain.runner.kv_caches)


def test_calibration_ids_without_a_tokenizer_are_seeded():
    a, b = calibration_ids(None, 300), calibration_ids(None, 300)
    assert a == b and len(a) >= 512 and max(a) < 300


def _store(path: Path) -> str:
    return f"file://{path}?capacity=64MiB"


def test_blocks_stored_under_another_shift_are_a_miss(llama_dir, tmp_path):
    prompt = random_prompts([100], seed=22)[0]
    first = make_engine(llama_dir, kv_cache_dtype="int8", kv_store=(_store(tmp_path),))
    tokens, cached, _ = run_counting(first, prompt, "r")
    assert cached == 0
    first.close()
    same = make_engine(llama_dir, kv_cache_dtype="int8", kv_store=(_store(tmp_path),))
    again, cached, _ = run_counting(same, prompt, "r")
    assert cached == 96 and again == tokens  # the same shift: the blocks are found
    same.close()
    other = make_engine(
        llama_dir, kv_cache_dtype="int8", kv_cache_smooth_k=False, kv_store=(_store(tmp_path),)
    )
    _, cached, _ = run_counting(other, prompt, "r")
    assert cached == 0  # written as k - mean, read as k: never served
    other.close()
