"""The MoE layer's combine in C++ (``moe_combine``): each token's expert outputs weighted
in float32 and summed in slot order equal the torch reference it replaced (to float32
rounding, then one rounding to the model dtype), a token's row never depends on the other
tokens, and a malformed ``order`` is refused."""

from __future__ import annotations

import pytest
import torch

from kvserve.model.cpu_kernels import load_cpu_kernels


def _routed(tokens: int, k: int, hidden: int, dtype: torch.dtype, seed: int):
    """(h grouped by expert, weights [tokens, k], order) as ``SparseMoE.forward`` makes them."""
    g = torch.Generator().manual_seed(seed)
    chosen = torch.stack([torch.randperm(16, generator=g)[:k] for _ in range(tokens)])
    weights = torch.softmax(torch.randn(tokens, k, generator=g), dim=-1)
    order = torch.argsort(chosen.flatten(), stable=True)
    h = torch.randn(tokens * k, hidden, generator=g).to(dtype)
    return h, weights, order


def _reference(h, weights, order, k):
    out = h.float() * weights.flatten()[order, None]
    out = out[torch.argsort(order)].view(weights.shape[0], k, -1)
    return out.sum(dim=1).to(h.dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize(("tokens", "k", "hidden"), [(1, 1, 16), (37, 8, 96), (5, 4, 2880)])
def test_combine_matches_the_torch_reference(dtype, tokens, k, hidden):
    assert load_cpu_kernels()
    h, weights, order = _routed(tokens, k, hidden, dtype, tokens + k)
    got = torch.ops.kvserve.moe_combine(h, weights, order)
    want = _reference(h, weights, order, k)
    assert got.shape == (tokens, hidden) and got.dtype == dtype
    tol = 1e-5 if dtype == torch.float32 else 2**-7  # float32 sums, one final rounding
    assert ((got.float() - want.float()).abs() <= tol * want.float().abs() + 1e-6).all()
    if dtype != torch.float32:  # mostly the very same bits
        assert (got != want).float().mean() < 0.02


def test_a_tokens_sum_does_not_depend_on_the_others():
    """Token t combined in a batch of 29 and alone (its k rows only) gives the same bits."""
    assert load_cpu_kernels()
    k, hidden = 8, 200
    h, weights, order = _routed(29, k, hidden, torch.bfloat16, 3)
    full = torch.ops.kvserve.moe_combine(h, weights, order)
    pos = torch.argsort(order)
    for t in (0, 13, 28):
        rows = pos[t * k : (t + 1) * k]  # h's rows of token t, in slot order
        alone = torch.ops.kvserve.moe_combine(h[rows], weights[t : t + 1], torch.arange(k))
        assert torch.equal(alone[0], full[t])


def test_combine_refuses_a_malformed_order():
    assert load_cpu_kernels()
    h, weights, order = _routed(4, 2, 16, torch.bfloat16, 0)
    bad = order.clone()
    bad[0] = bad[1]
    with pytest.raises(RuntimeError, match="not a permutation"):
        torch.ops.kvserve.moe_combine(h, weights, bad)
    with pytest.raises(RuntimeError, match="tokens \\* k"):
        torch.ops.kvserve.moe_combine(h[:-1], weights, order)
