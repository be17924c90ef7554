"""The GEMM over GGUF-quantized weights (``csrc/gguf_gemm.cpp``, ``model/quantized.py``):
each type's kernel equal bit for bit to its torch reference (the same operations written
from the unpacked codes: ``GGUFLinear.reference``) and within a stated tolerance of plain
dequantize-then-matmul with the ``gguf`` package's values; rows independent of the batch;
the portable loop and the VNNI kernel bit for bit equal; embeddings looked up with
``gguf``'s values exactly."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from helpers import gguf_portable

from kvserve.model.cpu_kernels import load_cpu_kernels
from kvserve.model.kquants import quantize, quantize_q4_k, quantize_q5_k, quantize_q6_k
from kvserve.model.quantized import (
    BLOCKS,
    GGUFEmbedding,
    GGUFLinear,
    dequantize,
    pack,
    unpack_rows,
)

TYPES = ["Q4_0", "Q4_1", "Q4_K", "Q5_K", "Q6_K", "Q8_0"]
# plain dequantize-then-matmul vs the kernel: the int8 activations' rounding (at most half
# a step of amax/127 per value) gives an RMS error of 0.53 % of the output's RMS on these
# random data (measured, each type, the K-quants included); the bound is 1.2 %
RMS_TOLERANCE = 0.012


@pytest.fixture(scope="module", autouse=True)
def _kernels():
    assert load_cpu_kernels()


def whole(ggml_type: str, k: int) -> int:
    """``k`` rounded up to whole blocks of ``ggml_type`` (Q4_K's are 256 long)."""
    per = BLOCKS[ggml_type][0]
    return -(-k // per) * per


def quantized(ggml_type: str, n: int, k: int, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """(raw GGUF rows, their dequantized float32 values) of a random [n, k] matrix (the
    ``gguf`` package writes no K-quant: kvserve's quantizers write them)."""
    w = np.random.default_rng(seed).standard_normal((n, k)).astype(np.float32)
    raw = quantize(w, ggml_type)
    return raw, dequantize(raw, ggml_type)


def layer(ggml_type: str, n: int, k: int, bias: bool = False, seed: int = 0) -> GGUFLinear:
    raw, _ = quantized(ggml_type, n, k, seed)
    b = torch.randn(n, generator=torch.Generator().manual_seed(seed)) if bias else None
    return GGUFLinear([pack(raw, ggml_type, k)], b)


@pytest.mark.parametrize("ggml_type", TYPES)
@pytest.mark.parametrize(
    ("m", "n", "k"),
    [(1, 40, 96), (5, 16, 32), (64, 200, 256), (2048, 48, 256), (300, 640, 256)],
)  # the last: two chunks of rows, each item a span of several groups of outputs
def test_kernel_equals_its_torch_reference_bit_for_bit(ggml_type, m, n, k):
    k = whole(ggml_type, k)
    lin = layer(ggml_type, n, k, bias=True, seed=m)
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(n)) * 3
    for dtype in (torch.float32, torch.bfloat16):
        got = lin(x.to(dtype))
        assert got.shape == (m, n) and got.dtype == dtype
        # the reference: the same operations written in torch from the unpacked codes
        assert torch.equal(got, lin.reference(x.to(dtype)))


@pytest.mark.parametrize("ggml_type", TYPES)
def test_kernel_is_close_to_dequantize_then_matmul(ggml_type):
    raw, w = quantized(ggml_type, 256, 512, seed=3)
    lin = GGUFLinear([pack(raw, ggml_type, 512)])
    x = torch.randn(32, 512, generator=torch.Generator().manual_seed(1))
    ref = x.double() @ torch.from_numpy(w).double().T
    err = (lin(x).double() - ref).pow(2).mean().sqrt() / ref.pow(2).mean().sqrt()
    assert err.item() <= RMS_TOLERANCE


@pytest.mark.parametrize("ggml_type", TYPES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_a_row_never_depends_on_the_other_rows(ggml_type, dtype):
    k = whole(ggml_type, 160)
    lin = layer(ggml_type, 72, k, bias=True)
    g = torch.Generator().manual_seed(7)
    x = torch.randn(67, k, generator=g).to(dtype)
    full = lin(x)
    assert full.dtype == dtype
    for rows in ([0], [66], list(range(3, 8)), list(range(10, 43)), [5, 60, 61]):
        assert torch.equal(lin(x[rows]), full[rows]), rows
    batch = torch.cat([x[9:10], torch.randn(12, k, generator=g).to(dtype)])
    assert torch.equal(lin(batch)[:1], full[9:10])  # the same row among other rows


@pytest.mark.parametrize("ggml_type", TYPES)
def test_a_row_of_a_large_batch_equals_the_row_alone(ggml_type):
    """Past one tile of rows the kernel splits the work differently (spans of output
    groups kept in L2, chunks of 256 rows): no row may notice."""
    k = whole(ggml_type, 256)
    lin = layer(ggml_type, 1024, k, bias=True)
    x = torch.randn(600, k, generator=torch.Generator().manual_seed(5)).bfloat16()
    full = lin(x)
    for rows in ([0], [599], [255, 256], list(range(250, 270))):
        assert torch.equal(lin(x[rows]), full[rows]), rows


@pytest.mark.parametrize("ggml_type", TYPES)
def test_the_portable_loop_gives_the_vnni_kernels_bits(ggml_type):
    k = whole(ggml_type, 128)
    lin = layer(ggml_type, 56, k, bias=True)
    x = torch.randn(37, k, generator=torch.Generator().manual_seed(2)).bfloat16()
    fast = lin(x)
    with gguf_portable():
        slow = lin(x)
    assert torch.equal(fast, slow)


def test_fused_parts_of_different_types_stack_along_the_output():
    parts = [pack(quantized(t, n, 256, i)[0], t, 256) for i, (t, n) in
             enumerate([("Q4_1", 32), ("Q8_0", 16), ("Q4_0", 24), ("Q4_K", 8),
                        ("Q6_K", 40), ("Q5_K", 24)])]  # fmt: skip
    lin = GGUFLinear(parts)
    x = torch.randn(6, 256, generator=torch.Generator().manual_seed(0))
    alone = [GGUFLinear([p])(x) for p in parts]
    assert lin.out_features == 144
    assert torch.equal(lin(x), torch.cat(alone, dim=-1))


@pytest.mark.parametrize("ggml_type", TYPES)
def test_embedding_rows_are_ggufs_values_exactly(ggml_type):
    k = whole(ggml_type, 96)
    raw, w = quantized(ggml_type, 83, k)
    p = pack(raw, ggml_type, k)
    ids = torch.tensor([0, 15, 16, 17, 82, 40, 40])
    assert torch.equal(unpack_rows(p, ids), torch.from_numpy(w)[ids])
    emb = GGUFEmbedding(p, torch.bfloat16)
    assert torch.equal(emb(ids.view(1, -1))[0], torch.from_numpy(w)[ids].bfloat16())


def test_rows_that_are_not_whole_blocks_are_refused():
    raw, _ = quantized("Q8_0", 4, 64)
    with pytest.raises(ValueError, match="do not hold rows of 96"):
        pack(raw, "Q8_0", 96)
    with pytest.raises(ValueError, match="not whole blocks"):
        pack(raw, "Q8_0", 48)
    for writer in (quantize_q4_k, quantize_q5_k, quantize_q6_k):
        with pytest.raises(ValueError, match="not whole blocks of 256"):
            writer(np.zeros((2, 96), np.float32))
