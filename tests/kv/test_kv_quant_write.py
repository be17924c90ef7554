"""The CPU quantized-KV kernels: ``quantize_kv`` writes what the PyTorch path writes, bit for
bit (ties between two codes included; fp8 scales may differ where two candidates' errors
tie within float rounding), the fp8_e4m3 scale search never rounds a vector worse than the plain
``max|x| / 448`` scale, and the paged-attention kernel decodes every fp8 code as PyTorch
does."""

from __future__ import annotations

import pytest
import torch

from kvserve.model import kv_quant as quant
from kvserve.model.cpu_kernels import load_cpu_kernels
from kvserve.model.kv_quant import QuantizedKVCache, kv_format


@pytest.fixture(autouse=True, scope="module")
def _kernels():
    assert load_cpu_kernels(), "the CPU kernels must build here"


FORMATS = ("int8", "fp8_e4m3", "fp8_e5m2")
H, D, SLOTS = 3, 64, 512


def _inputs(
    dtype: torch.dtype, g: torch.Generator, D: int = D
) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V ``[300, H, D]`` as strided views of one fused QKV output: magnitudes over 8
    decades, a zero vector, an outlier row, and small integers (bfloat16 values over
    float16 scales that land exactly between two codes)."""
    t = 300
    qkv = torch.randn(t, 5 * H * D, generator=g) * torch.logspace(-3, 3, t).view(-1, 1)
    qkv[:100:3] = torch.randint(-64, 65, (34, 5 * H * D), generator=g).float()
    qkv[1] = 0.0
    qkv[2, : D // 4] = 3e4
    qkv = qkv.to(dtype)
    k = qkv[:, 3 * H * D : 4 * H * D].view(t, H, D)
    v = qkv[:, 4 * H * D :].view(t, H, D)
    return k, v


def _write(fmt_name: str, dtype: torch.dtype, k, v, slots, kernel: bool) -> QuantizedKVCache:
    D = k.shape[-1]
    cache = QuantizedKVCache(kv_format(fmt_name, dtype), SLOTS, H, D, torch.device("cpu"))
    (cache.write_cpu if kernel else cache.write)(slots, k, v)
    return cache


# head size 64 takes the kernel's 16-lane fp8 path, 24 its scalar one
@pytest.mark.parametrize("head_size", [64, 24])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("fmt", FORMATS)
def test_cpu_write_kernel_matches_the_torch_path(fmt, dtype, head_size):
    g = torch.Generator().manual_seed(7)
    k, v = _inputs(dtype, g, head_size)
    slots = torch.randperm(SLOTS, generator=g)[: k.shape[0]]
    a = _write(fmt, dtype, k, v, slots, kernel=True)
    b = _write(fmt, dtype, k, v, slots, kernel=False)
    # the fp8 search may pick another scale where two candidates' errors tie within float
    # rounding (its sums run in another order): rare, and never a worse vector
    same = a.scale[:, slots] == b.scale[:, slots]
    assert same.float().mean() > 0.999
    for which, x in ((0, k), (1, v)):
        err_a = (a.read_slots(which, slots, torch.float32) - x.float()).square().sum(-1)
        err_b = (b.read_slots(which, slots, torch.float32) - x.float()).square().sum(-1)
        assert (err_a <= err_b * (1 + 1e-5) + 1e-30).all()
    # the one other difference: an int8 vector whose scale rounds to 0 in float16 stores 0
    # where PyTorch stores ±127 (x / 0 clamped); both decode to 0
    live = (same & (a.scale[:, slots] > 0)).unsqueeze(-1).expand(2, len(slots), H, head_size)
    da, db = a.data[:, slots].view(torch.uint8), b.data[:, slots].view(torch.uint8)
    assert torch.equal(da[live], db[live])
    assert (a.data[0][slots[1]].float() == 0).all()  # the zero vector stays zero


def test_fp8_scale_search_never_rounds_worse_than_the_plain_scale():
    g = torch.Generator().manual_seed(3)
    x = (torch.randn(4096, H, D, generator=g) * torch.rand(4096, H, 1, generator=g) * 10).to(
        torch.bfloat16
    )
    slots = torch.arange(x.shape[0])
    cache = QuantizedKVCache(kv_format("fp8_e4m3", torch.bfloat16), 4096, H, D, torch.device("cpu"))
    cache.write_cpu(slots, x, x)
    searched = (cache.read_slots(0, slots, torch.float32) - x.float()).square().sum(-1)
    xf = x.float()
    s = (xf.abs().amax(-1, keepdim=True) / 448).half().clamp_min(6.103515625e-05).float()
    plain = ((xf / s).clamp(-448, 448).to(torch.float8_e4m3fn).float() * s - xf).square().sum(-1)
    assert (searched <= plain * (1 + 1e-6)).all()
    assert searched.mean() < 0.85 * plain.mean()  # measured: ~0.7×


@pytest.mark.parametrize("storage", [torch.float8_e4m3fn, torch.float8_e5m2])
def test_paged_attention_decodes_every_fp8_code(storage):
    """One key per sequence: the output row is its value vector, decoded in the kernel."""
    codes = torch.arange(256, dtype=torch.uint8)
    ref = codes.view(storage).float()
    finite = torch.isfinite(ref)
    codes = torch.where(finite, codes, torch.zeros_like(codes))  # NaN/inf are never stored
    s, bs = 256 // D, 16
    v = torch.zeros(s, bs, 1, D, dtype=torch.uint8)
    v[:, 0, 0] = codes.view(s, D)
    k = torch.zeros_like(v)
    scale = torch.ones(s * bs, 1, dtype=torch.float16)
    out = torch.ops.kvserve.paged_attention(
        torch.randn(s, 1, D, dtype=torch.bfloat16),
        k.view(storage),
        v.view(storage),
        torch.arange(s).view(s, 1),
        torch.ones(s, dtype=torch.long),
        torch.arange(s + 1),
        D**-0.5,
        0,
        0,
        scale,
        scale,
    )
    want = torch.where(finite, ref, torch.zeros_like(ref)).to(torch.bfloat16)
    assert torch.equal(out.view(-1), want)


def test_torch_fp8_search_in_token_chunks_equals_one_pass():
    """Off the CPU kernel (CUDA), a long prefill is searched in bounded chunks of tokens."""
    x = torch.randn(quant._SEARCH_TOKENS * 2 + 5, H, D, generator=torch.Generator().manual_seed(1))
    cache = QuantizedKVCache(kv_format("fp8_e4m3", torch.float32), 8, H, D, torch.device("cpu"))
    codes, scales = cache.quantize(0, x)
    whole, whole_scales = cache._fp8_search(x, x.abs().amax(-1))
    assert torch.equal(codes.view(torch.uint8), whole.view(torch.uint8))
    assert torch.equal(scales, whole_scales)
