"""The Triton KV writes store what the torch writes store, bit for bit: a copy into a
16/32-bit cache from strided rows, and int8/fp8 codes with per-token scales (the fp8
scale search and the K shift included); a negative slot (a padded row) writes nothing."""

from __future__ import annotations

import pytest
import torch

from kvserve.model.kv_quant import QuantizedKVCache, kv_format
from kvserve.model.triton_kv_write import write_kv, write_quantized

DEV = "cuda" if torch.cuda.is_available() else "cpu"


def _rows(t: int, h: int, d: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """K (×3, one row all zero) and V as strided views of one fused projection."""
    g = torch.Generator().manual_seed(seed)
    kv = torch.randn(t, 3 * h * d, generator=g)
    k, v = kv[:, : h * d].view(t, h, d) * 3, kv[:, h * d : 2 * h * d].view(t, h, d)
    k[1] = 0
    return k.to(DEV), v.to(DEV)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_plain_write_copies_rows_and_skips_padding(dtype):
    k, v = _rows(9, 2, 48, 0)
    k, v = k.to(dtype), v.to(dtype)
    slots = torch.tensor([5, 17, 3, 40, 41, 0, 63, 22, -1], device=DEV)
    cache = torch.full((2, 64, 2, 48), 7.0, dtype=dtype, device=DEV)
    write_kv(k, v, slots, cache)
    assert torch.equal(cache[0][slots[:-1]], k[:-1]) and torch.equal(cache[1][slots[:-1]], v[:-1])
    untouched = torch.ones(64, dtype=torch.bool)
    untouched[slots[:-1].cpu()] = False
    assert bool((cache[:, untouched.to(DEV)] == 7).all())  # the padded row wrote nothing


@pytest.mark.parametrize("name", ["int8", "fp8_e4m3", "fp8_e5m2"])
@pytest.mark.parametrize("shifted", [False, True])
def test_quantized_write_equals_the_torch_write(name, shifted):
    fmt = kv_format(name, torch.bfloat16)
    want = QuantizedKVCache(fmt, 96, 2, 48, torch.device(DEV))
    got = QuantizedKVCache(fmt, 96, 2, 48, torch.device(DEV))
    if shifted:
        shift = torch.randn(2, 48, generator=torch.Generator().manual_seed(1))
        want.set_k_shift(shift)
        got.set_k_shift(shift)
    for seed in range(3):  # three steps into other slots, some rewritten
        k, v = _rows(24, 2, 48, seed)
        k, v = k.to(torch.bfloat16), v.to(torch.bfloat16)
        slots = torch.randperm(96, generator=torch.Generator().manual_seed(seed))[:24].to(DEV)
        want.write(slots, k, v)
        write_quantized(got, slots, k, v)
        assert torch.equal(got.data.view(torch.uint8), want.data.view(torch.uint8))
        assert torch.equal(got.scale, want.scale)
