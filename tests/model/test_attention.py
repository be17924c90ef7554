"""Attention backends agree: C++ paged decode kernel vs the PyTorch (SDPA) path."""

from __future__ import annotations

import pytest
import torch
from helpers import filled_quantized_cache

from kvserve.model.attention import AttentionMetadata, CpuPagedAttention, TorchPagedAttention
from kvserve.model.cpu_kernels import load_cpu_kernels

BS = 16


def _decode_meta(lens: list[int], tables: torch.Tensor, window: int | None, sinks: int):
    """Decode metadata with the validity mask the PyTorch reference path needs."""
    pos = torch.arange(tables.shape[1] * BS).unsqueeze(0)
    lens_t = torch.tensor(lens).unsqueeze(1)
    mask = pos < lens_t
    if window is not None:
        mask &= (pos > lens_t - 1 - window) | (pos < sinks)
    return AttentionMetadata(
        slot_mapping=torch.empty(0, dtype=torch.long),
        num_decodes=len(lens),
        decode_block_tables=tables,
        decode_lens=torch.tensor(lens),
        decode_mask=mask.view(len(lens), 1, 1, -1),
    )


def test_cpu_kernel_builds_here():
    # CI machines have a compiler; the fallback exists for machines without one.
    assert load_cpu_kernels()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("window,sinks", [(None, 0), (7, 0), (40, 0), (7, 4), (20, 17)])
@pytest.mark.parametrize("heads", [(4, 4), (6, 2), (3, 1)])
def test_decode_kernel_matches_sdpa_path(dtype, window, sinks, heads):
    assert load_cpu_kernels()
    hq, hkv = heads
    g = torch.Generator().manual_seed(0)
    num_blocks, d = 64, 32
    cache = torch.randn(2, num_blocks * BS, hkv, d, generator=g).to(dtype)
    lens = [1, 15, 16, 17, 50, 33]
    tables = torch.zeros(len(lens), 4, dtype=torch.long)
    perm = torch.randperm(num_blocks, generator=g)
    for i, n in enumerate(lens):
        nb = -(-n // BS)
        tables[i, :nb] = perm[i * 4 : i * 4 + nb]
    q = torch.randn(len(lens), hq, d, generator=g).to(dtype)
    meta = _decode_meta(lens, tables, window, sinks)
    ref = TorchPagedAttention(BS).decode(q.float(), cache.float(), meta, 0.3)
    got = CpuPagedAttention(BS, window, sinks).decode(q, cache, meta, 0.3)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    assert (got.float() - ref).abs().max().item() < tol


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_fused_ops_match_pytorch_ops(dtype):
    """The C++ element-wise kernels round like the unfused PyTorch code."""
    from kvserve.model.ops import CpuKernelOps, TorchOps

    assert load_cpu_kernels()
    g = torch.Generator().manual_seed(0)
    ref, fused = TorchOps(), CpuKernelOps()
    x = torch.randn(37, 96, generator=g).to(dtype)
    res = torch.randn(37, 96, generator=g).to(dtype)
    w = (1 + 0.1 * torch.randn(96, generator=g)).to(dtype)
    tol = 0 if dtype == torch.float32 else 1e-2

    def close(a: torch.Tensor, b: torch.Tensor, rel: float) -> None:
        diff = (a.float() - b.float()).abs().max().item()
        assert diff <= rel * max(1.0, b.float().abs().max().item()), diff

    close(fused.rms_norm(x, w, 1e-5), ref.rms_norm(x, w, 1e-5), max(tol, 1e-6))
    # Qwen3's q/k norms: per-head rows of a strided [T, H, D] view, each head's row the
    # bits of the same row normed from a contiguous copy
    heads = torch.randn(37, 5 * 32 + 16, generator=g).to(dtype)[:, 16:].view(37, 5, 32)
    hw = w[:32].contiguous()
    assert not heads.is_contiguous()
    normed = fused.rms_norm(heads, hw, 1e-6)
    assert torch.equal(normed, fused.rms_norm(heads.contiguous(), hw, 1e-6))
    close(normed, ref.rms_norm(heads, hw, 1e-6), max(tol, 1e-6))
    out_f, res_f = fused.add_rms_norm(x, res.clone(), w, 1e-5)
    out_r, res_r = ref.add_rms_norm(x, res.clone(), w, 1e-5)
    assert torch.equal(res_f, res_r)
    close(out_f, out_r, max(tol, 1e-6))
    gu = torch.randn(37, 2 * 48, generator=g).to(dtype)
    close(fused.silu_and_mul(gu), ref.silu_and_mul(gu), max(tol, 1e-6))
    qkv = torch.randn(37, (6 + 2 * 2) * 16, generator=g).to(dtype)
    positions = torch.randint(0, 100, (37,), generator=g)
    cos = torch.randn(128, 16, generator=g).to(dtype)
    sin = torch.randn(128, 16, generator=g).to(dtype)
    q = qkv[:, : 6 * 16].view(37, 6, 16)
    k = qkv[:, 6 * 16 : 8 * 16].view(37, 2, 16)
    q_r, k_r = ref.rope(positions, q.clone(), k.clone(), cos, sin)
    q_f, k_f = fused.rope(positions, q, k, cos, sin)
    close(q_f, q_r, max(tol, 1e-6))
    close(k_f, k_r, max(tol, 1e-6))
    if dtype == torch.bfloat16:  # each product and the sum rounded to bf16, as PyTorch does
        assert torch.equal(q_f, q_r) and torch.equal(k_f, k_r)
        for d in (64, 40):  # whole 16-lane vectors, and a partial one (half = 20)
            q = torch.randn(37, 9, d, generator=g).to(dtype)
            k = torch.randn(37, 3, d, generator=g).to(dtype)
            cos = torch.randn(128, d, generator=g).to(dtype)
            sin = torch.randn(128, d, generator=g).to(dtype)
            q_r, k_r = ref.rope(positions, q.clone(), k.clone(), cos, sin)
            q_f, k_f = fused.rope(positions, q, k, cos, sin)
            assert torch.equal(q_f, q_r) and torch.equal(k_f, k_r)


@pytest.mark.parametrize("fmt", ["int8", "fp8_e4m3", "fp8_e5m2"])
@pytest.mark.parametrize("window,sinks", [(None, 0), (20, 4)])
def test_decode_kernel_reads_quantized_cache_like_the_dequantizing_path(fmt, window, sinks):
    """int8 (per-token scales) and fp8 (per-head scales) K/V: the kernel, applying the
    scales in registers, matches gather + dequantize + SDPA."""
    assert load_cpu_kernels()
    g = torch.Generator().manual_seed(1)
    num_blocks, hq, d = 16, 6, 64
    cache = filled_quantized_cache(fmt, num_blocks * BS, g)
    lens = [1, 17, 40, 64]
    tables = torch.randperm(num_blocks, generator=g)[:16].view(4, 4)
    q = torch.randn(len(lens), hq, d, generator=g)
    meta = _decode_meta(lens, tables, window, sinks)
    ref = TorchPagedAttention(BS).decode(q, cache, meta, 0.125)
    got = CpuPagedAttention(BS, window, sinks).decode(q, cache, meta, 0.125)
    assert (got - ref).abs().max().item() < 1e-4


def test_kernel_cache_is_keyed_by_sources_torch_flags_and_cpu(tmp_path, monkeypatch):
    """Two checkouts with different kernels never share (or overwrite) one cached .so; the
    same kernels elsewhere share it; a library for another CPU is never this one's."""
    import shutil

    import kvserve.model.cpu_kernels as ck
    import kvserve.model.kernel_build as kb

    assert load_cpu_kernels()
    name = ck.build_name()
    assert name.startswith("kvserve_cpu_kernels_")
    assert ck.loaded_library().name == f"{name}.so"  # what this process loaded
    copy = tmp_path / "csrc"
    shutil.copytree(kb.CSRC, copy)
    monkeypatch.setattr(kb, "CSRC", copy)
    assert ck.build_name() == name  # same sources elsewhere: the same build is reused
    src = copy / "fused_ops.cpp"
    src.write_text(src.read_text() + "\n// changed\n")
    changed = ck.build_name()
    assert changed != name
    monkeypatch.setattr(kb, "CFLAGS", (*kb.CFLAGS, "-DX"))
    assert ck.build_name() not in (name, changed)
    flags = ck.build_name()
    monkeypatch.setattr(kb, "cpu_features", lambda: "fpu sse sse2")
    assert ck.build_name() not in (name, changed, flags)
    monkeypatch.setattr(torch, "__version__", "0.0.0")
    assert len({ck.build_name(), name, changed, flags}) == 4
