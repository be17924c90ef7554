"""oneDNN-prepacked linear layers: same values as F.linear, batch-invariant rows, and only
where they apply (bf16/fp16 on a CPU with native kernels)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from helpers import greedy, make_engine, run_to_end
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

from kvserve.model.linear import PackedLinear, prepack_linears, prepack_supported

BF16 = torch.bfloat16


def test_this_machine_runs_the_packed_path():
    """CI's machines have AVX-512 (bf16): the packed path is the one that is measured."""
    assert prepack_supported(BF16, torch.device("cpu"))
    assert not prepack_supported(torch.float32, torch.device("cpu"))


def test_packed_linear_matches_f_linear_with_and_without_bias():
    torch.manual_seed(0)
    for bias in (False, True):
        lin = nn.Linear(96, 160, bias=bias).to(BF16)
        packed = PackedLinear(lin)
        x = torch.randn(7, 96, dtype=BF16)
        want = F.linear(
            x.float(), lin.weight.float(), None if lin.bias is None else lin.bias.float()
        )
        got = packed(x).float()
        assert got.shape == (7, 160)
        torch.testing.assert_close(got, want, atol=0.05, rtol=0.02)


@settings(max_examples=12, deadline=None)
@given(
    k=st.sampled_from([64, 576, 1536, 2048, 3072]),
    n=st.sampled_from([64, 576, 960]),
    bias=st.booleans(),
    m=st.integers(2, 300),
    seed=st.integers(0, 2**16),
)
def test_a_row_does_not_depend_on_the_batch_it_is_in(k, n, bias, m, seed):
    """Batch-invariant rows, bit for bit: each row of an M-row batch equals the row computed
    alone (M = 1, which oneDNN runs with another kernel from K = 1536) and within a batch
    of any other size (the engine's determinism rests on this)."""
    torch.manual_seed(seed)
    packed = PackedLinear(nn.Linear(k, n, bias=bias).to(BF16))
    x = torch.randn(m, k, dtype=BF16)
    full = packed(x)
    for i in (0, m // 2, m - 1):
        assert torch.equal(packed(x[i : i + 1]), full[i : i + 1]), (k, n, m, i)
    cut = max(1, m // 3)
    assert torch.equal(packed(x[:cut].contiguous()), full[:cut])


def test_float32_models_are_left_alone():
    model = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 4))
    assert prepack_linears(model) == 0
    assert all(isinstance(m, nn.Linear) for m in (model[0], model[2]))


def test_bf16_engine_packs_every_projection_and_the_tied_head(model_dirs):
    engine = make_engine(model_dirs["llama"], dtype="bfloat16")
    model = engine.runner.model
    assert not any(isinstance(m, nn.Linear) for m in model.modules())
    layer = model.layers[0]
    for lin in (layer.self_attn.qkv_proj, layer.self_attn.o_proj, layer.mlp.down_proj):
        assert isinstance(lin, PackedLinear)
    assert (model.lm_head is None) == (model.lm_head_packed is not None)
    torch_engine = make_engine(model_dirs["llama"], dtype="bfloat16", attention_backend="torch")
    assert isinstance(torch_engine.runner.model.layers[0].mlp.down_proj, nn.Linear)
    prompt = list(range(3, 40))
    hidden = torch.randn(4, model.spec.hidden_size, dtype=BF16)
    torch.testing.assert_close(
        model.compute_logits(hidden),
        torch_engine.runner.model.compute_logits(hidden),
        atol=0.05,
        rtol=0.02,
    )
    for e in (engine, torch_engine):
        e.add_request("r", prompt, greedy(4))
        assert len(run_to_end(e)["r"]) == 4
