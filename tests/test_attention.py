"""Attention backends agree: C++ paged decode kernel vs the PyTorch (SDPA) path."""

from __future__ import annotations

import pytest
import torch

from kvserve.model.attention import AttentionMetadata, CpuPagedAttention, TorchPagedAttention
from kvserve.model.cpu_kernels import load_cpu_kernels

BS = 16


def test_cpu_kernel_builds_here():
    # CI machines have a compiler; the fallback exists for machines without one.
    assert load_cpu_kernels()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("window", [None, 7, 40])
@pytest.mark.parametrize("heads", [(4, 4), (6, 2), (3, 1)])
def test_decode_kernel_matches_sdpa_path(dtype, window, heads):
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
    pos = torch.arange(4 * BS).unsqueeze(0)
    lens_t = torch.tensor(lens).unsqueeze(1)
    mask = pos < lens_t
    if window is not None:
        mask &= pos > lens_t - 1 - window
    meta = AttentionMetadata(
        slot_mapping=torch.empty(0, dtype=torch.long),
        num_decodes=len(lens),
        decode_block_tables=tables,
        decode_lens=torch.tensor(lens),
        decode_mask=mask.view(len(lens), 1, 1, -1),
    )
    ref = TorchPagedAttention(BS).decode(q.float(), cache.float(), meta, 0.3)
    got = CpuPagedAttention(BS, window).decode(q, cache, meta, 0.3)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    assert (got.float() - ref).abs().max().item() < tol
