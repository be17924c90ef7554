"""The int8 kinds on AMX-INT8 tiles (``csrc/gguf_amx.cpp``): from 2 rows on, Q8_0 (s8) and
``--quantization int8`` (c8, activation blocks of 128 and of 32) run on tiles where the CPU
has them. Their bits are the VNNI kernel's and the torch reference's at every row count,
so a row computed on tiles equals the row computed alone (one row: VNNI). On a CPU
without AMX both settings run the VNNI kernel, and the same assertions hold."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import pytest
import torch
from helpers import amx_switched, gguf_portable

from kvserve.model.cpu_kernels import load_cpu_kernels
from kvserve.model.kquants import quantize
from kvserve.model.quantized import GGUFLinear, c8_block, pack, pack_int8

ROWS = [1, 2, 3, 15, 16, 17, 31, 32, 33, 100, 300]  # around the switch, the 16- and 32-row tiles


@pytest.fixture(scope="module", autouse=True)
def _kernels():
    assert load_cpu_kernels()


def q8_0(n: int, k: int, g: torch.Generator) -> GGUFLinear:
    w = torch.randn(n, k, generator=g).numpy().astype(np.float32)
    return GGUFLinear([pack(quantize(w, "Q8_0"), "Q8_0", k)], torch.randn(n, generator=g))


def int8(n: int, k: int, g: torch.Generator) -> GGUFLinear:
    return GGUFLinear([pack_int8(torch.randn(n, k, generator=g))], torch.randn(n, generator=g))


LAYERS: dict[str, tuple[Callable[..., GGUFLinear], int]] = {
    "q8_0": (q8_0, 160),
    "int8, blocks of 128": (int8, 384),
    "int8, blocks of 32": (int8, 288),
}


def test_int8_activation_blocks_are_128_wide_where_the_row_allows():
    got = {name: c8_block(k) for name, (make, k) in LAYERS.items() if make is int8}
    assert got == {f"int8, blocks of {b}": b for b in (128, 32)}


def amx(name: str):
    return amx_switched(torch.ops.kvserve.gguf_gemm_use_amx, name)


def test_the_amx_kernel_is_there_where_the_bf16_one_is():
    """Both need AMX tiles and the process's tile state: one is ready iff the other is."""
    assert torch.ops.kvserve.gguf_gemm_amx() == torch.ops.kvserve.bf16_gemm_amx()


@pytest.mark.parametrize("layer", LAYERS)
@pytest.mark.parametrize("n", [16, 40, 200])  # one group, a pair and a half, several pairs
def test_tiles_give_the_vnni_kernels_and_the_references_bits(layer, n):
    make, k = LAYERS[layer]
    g = torch.Generator().manual_seed(n)
    lin = make(n, k, g)
    for m in ROWS:
        x = torch.randn(m, k, generator=g) * 3
        for dtype in (torch.bfloat16, torch.float32):
            with amx("amx"):
                tiles = lin(x.to(dtype))
            with amx("avx512"):
                vnni = lin(x.to(dtype))
            assert torch.equal(tiles, vnni), (m, dtype)
            assert torch.equal(tiles, lin.reference(x.to(dtype))), (m, dtype)


@pytest.mark.parametrize("layer", LAYERS)
def test_a_row_on_tiles_equals_the_row_alone(layer):
    make, k = LAYERS[layer]
    g = torch.Generator().manual_seed(11)
    lin = make(600, k, g)
    x = torch.randn(520, k, generator=g).bfloat16()
    with amx("amx"):
        full = lin(x)
        for rows in ([0], [519], [255, 256], list(range(250, 290)), list(range(7, 23)), [40, 41]):
            assert torch.equal(lin(x[rows]), full[rows]), rows


def test_turning_simd_off_runs_the_portable_loop_not_the_tiles():
    """The portable setting is the tests' reference: it must win over the tiles, and give
    their bits."""
    g = torch.Generator().manual_seed(5)
    lin = q8_0(48, 128, g)
    x = torch.randn(40, 128, generator=g).bfloat16()
    with amx("amx"):
        fast = lin(x)
        with gguf_portable():
            slow = lin(x)
    assert torch.equal(fast, slow)
