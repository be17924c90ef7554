"""Large CPU tensors on huge pages (``kvserve/hugepages.py``): zeroed, 2 MiB-aligned, alive
as long as the tensor, copied exactly into an arena, and plain allocations where they do
not apply (small, another device, ``KVSERVE_HUGEPAGES=0``). Whether the kernel really backs
them with 2 MiB pages depends on its THP settings and free memory, so that is not asserted;
benchmarks/history/notebook.md measures what it gives."""

from __future__ import annotations

import gc

import torch

from kvserve import hugepages
from kvserve.hugepages import HUGE_PAGE, MIN_BYTES, huge_arena, huge_zeros
from kvserve.model.kv_cache import KVCacheSpec
from kvserve.model.kv_quant import kv_format

CPU = torch.device("cpu")


def test_huge_zeros_are_zeroed_aligned_and_outlive_their_views():
    t = huge_zeros((MIN_BYTES // 2, 3), torch.bfloat16, CPU)
    assert t.shape == (MIN_BYTES // 2, 3) and t.dtype == torch.bfloat16 and t.is_contiguous()
    assert t.data_ptr() % HUGE_PAGE == 0
    assert not t.any()
    view = t[5:9]
    del t
    gc.collect()
    view.fill_(2.0)  # the mapping lives while a view does
    assert view.sum().item() == 2.0 * view.numel()


def test_small_tensors_other_devices_and_the_switch_take_plain_zeros(monkeypatch):
    small = huge_zeros((16, 16), torch.float32, CPU)
    assert small.shape == (16, 16) and not small.any()
    monkeypatch.setenv("KVSERVE_HUGEPAGES", "0")
    assert not hugepages.enabled()
    big = huge_zeros((MIN_BYTES,), torch.uint8, CPU)
    assert not big.any() and big.numel() == MIN_BYTES
    tensors = [torch.randn(MIN_BYTES // 4)]
    assert huge_arena(tensors)[0] is tensors[0]


def test_arena_copies_every_tensor_exactly_at_64_byte_boundaries():
    g = torch.Generator().manual_seed(0)
    tensors = [
        torch.randn(1000, 577, generator=g).bfloat16(),
        torch.arange(3, dtype=torch.int8),
        torch.randn(MIN_BYTES // 4, generator=g),
        torch.randn(7, 5, generator=g).half(),
    ]
    copies = huge_arena(tensors)
    for t, c in zip(tensors, copies, strict=True):
        assert c is not t and c.dtype == t.dtype and c.shape == t.shape
        assert torch.equal(c, t) and c.data_ptr() % 64 == 0
    assert copies[0].data_ptr() % HUGE_PAGE == 0
    small = [torch.ones(4)]
    assert huge_arena(small)[0] is small[0]  # too little in all for a mapping of its own


def test_kv_caches_are_allocated_zeroed_on_the_mapping():
    spec = KVCacheSpec(2, 3, 64, torch.bfloat16, 16, tiled=True)
    plain = spec.allocate(2048, CPU)
    assert plain[0].data_ptr() % HUGE_PAGE == 0 and not plain[1].any()
    fmt = kv_format("int8", torch.bfloat16)
    q = KVCacheSpec.for_format(2, 3, 64, fmt, 16, tiled=True).allocate(2048, CPU, fmt)
    assert q[0].data.data_ptr() % HUGE_PAGE == 0 and not q[0].data.any()


def test_int8_codes_move_to_an_arena_and_compute_the_same(monkeypatch):
    from torch import nn

    from kvserve.model.cpu_kernels import load_cpu_kernels
    from kvserve.model.kquants import quantize
    from kvserve.model.quantized import (
        GGUFEmbedding,
        GGUFLinear,
        pack,
        pack_int8,
        quantized_on_huge_pages,
    )

    assert load_cpu_kernels()
    g = torch.Generator().manual_seed(0)
    shared = pack_int8(torch.randn(2048, 1024, generator=g))  # 2 MiB of codes
    own_w = torch.randn(2048, 1024, generator=g)
    own = pack_int8(own_w)
    model = nn.ModuleDict(
        {
            "embed": GGUFEmbedding(shared, torch.bfloat16),
            "head": GGUFLinear([shared]),  # a tied LM head: the embedding's part
            "proj": GGUFLinear([own]),
            # a GGUF file's part stays: numpy already advises its large arrays as huge pages
            "gguf": GGUFLinear([pack(quantize(own_w.numpy(), "Q8_0"), "Q8_0", 1024)]),
        }
    )
    gguf = model["gguf"].parts[0]
    x = torch.randn(5, 1024, generator=g).bfloat16()
    before = [model["head"](x), model["proj"](x)]
    monkeypatch.setenv("KVSERVE_HUGEPAGES", "0")
    assert quantized_on_huge_pages(model) == 0 and model["proj"].parts[0] is own
    monkeypatch.delenv("KVSERVE_HUGEPAGES")
    assert quantized_on_huge_pages(model) == shared.qs.nbytes + own.qs.nbytes
    head, proj = model["head"].parts[0], model["proj"].parts[0]
    assert model["embed"].packed is head  # still one copy of the shared codes
    assert head.qs.data_ptr() % HUGE_PAGE == 0 and proj.qs.data_ptr() % 64 == 0
    assert torch.equal(head.qs, shared.qs) and torch.equal(proj.qs, own.qs)
    assert head.d is shared.d and proj.qs.data_ptr() != own.qs.data_ptr()
    assert torch.equal(model["head"](x), before[0]) and torch.equal(model["proj"](x), before[1])
    assert model["gguf"].parts[0] is gguf
