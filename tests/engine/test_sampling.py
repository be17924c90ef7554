"""The sampler: filters, determinism per (seed, position), distribution, logprobs."""

from __future__ import annotations

import pytest
import torch

from kvserve.sampling import SampleRow, SamplingParams, position_seed, sample

V = 50


def _logits(seed: int = 0, rows: int = 1) -> torch.Tensor:
    return torch.randn(rows, V, generator=torch.Generator().manual_seed(seed)) * 2


def _row(**kw) -> SampleRow:
    seed, pos = kw.pop("seed", 1), kw.pop("position", 0)
    return SampleRow(SamplingParams(**kw), seed, pos)


def test_greedy_and_degenerate_filters_pick_the_argmax():
    logits = _logits()
    top = int(logits.argmax())
    for kw in ({"temperature": 0}, {"top_k": 1}, {"top_p": 1e-6}, {"min_p": 1.0}):
        for pos in range(5):
            assert sample(logits.clone(), [_row(position=pos, **kw)]).token_ids == [top], kw


def test_top_k_and_top_p_never_pick_outside_their_set():
    logits = _logits(3)
    order = logits[0].argsort(descending=True).tolist()
    probs = logits[0].softmax(-1)[order]
    nucleus = int((probs.cumsum(0) < 0.5).sum()) + 1
    for pos in range(200):
        t = sample(logits.clone(), [_row(position=pos, top_k=3)]).token_ids[0]
        assert t in order[:3]
        t = sample(logits.clone(), [_row(position=pos, top_p=0.5)]).token_ids[0]
        assert t in order[:nucleus]


def test_draw_depends_only_on_seed_and_position():
    logits = _logits(1, rows=3)
    a = sample(logits.clone(), [_row(seed=7, position=p) for p in (4, 5, 6)]).token_ids
    b = [
        sample(logits[i : i + 1].clone(), [_row(seed=7, position=p)]).token_ids[0]
        for i, p in enumerate((4, 5, 6))
    ]
    assert a == b
    draws = {sample(_logits(1), [_row(seed=s, position=0)]).token_ids[0] for s in range(40)}
    assert len(draws) > 3  # different seeds really differ


def test_sampling_follows_the_distribution():
    logits = _logits(5)
    probs = logits[0].softmax(-1)
    n = 4000
    counts = torch.zeros(V)
    for pos in range(n):
        counts[sample(logits.clone(), [_row(position=pos)]).token_ids[0]] += 1
    # total variation distance between empirical and true distributions
    tv = 0.5 * (counts / n - probs).abs().sum().item()
    assert tv < 0.06


def test_logprobs_are_raw_log_softmax_with_ranks():
    logits = _logits(2)
    res = sample(logits.clone(), [_row(temperature=0, logprobs=3)])
    entry = res.logprobs[0]
    lp = logits[0].log_softmax(-1)
    tok = res.token_ids[0]
    assert entry[tok].rank == 1
    assert entry[tok].logprob == pytest.approx(lp[tok].item(), abs=1e-5)
    assert len(entry) == 3
    assert sorted(e.rank for e in entry.values()) == [1, 2, 3]


def test_position_seed_mixes():
    assert position_seed(1, 2) != position_seed(2, 1)
    assert position_seed(1, 2) == position_seed(1, 2)
    assert 0 <= position_seed(2**62, 10**9) < 2**63


@pytest.mark.parametrize(
    "kw, msg",
    [
        ({"temperature": -1}, "temperature"),
        ({"top_p": 0}, "top_p"),
        ({"top_k": -2}, "top_k"),
        ({"min_p": 2}, "min_p"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"n": 0}, "n must"),
        ({"logprobs": 50}, "logprobs"),
        ({"stop": [""]}, "stop"),
    ],
)
def test_invalid_sampling_params_raise(kw, msg):
    with pytest.raises(ValueError, match=msg):
        SamplingParams(**kw)


@pytest.mark.parametrize("vocab", [1, 15, 16, 17, 50, 49152])
def test_the_cpu_argmax_kernel_picks_torch_argmax(vocab):
    """The sampler's CPU kernel (argmax_rows) and torch.argmax agree: the first of tied
    maxima, a NaN counts as the maximum (the first one), an all -inf row gives 0."""
    from kvserve.model.cpu_kernels import kernels_loaded, load_cpu_kernels
    from kvserve.sampling.sampler import _argmax

    assert load_cpu_kernels() and kernels_loaded()
    g = torch.Generator().manual_seed(vocab)
    x = torch.randn(9, vocab, generator=g)
    x[1] = torch.randint(0, 3, (vocab,), generator=g).float()  # many ties
    x[2] = float("-inf")
    x[3, vocab // 2] = float("nan")
    x[4, -1] = float("nan")
    x[4, 0] = float("inf")
    x[5, vocab // 3 :] = float("nan")
    x[6] = float("inf")
    x[7, -1] = 1e9  # the maximum in the last, partial vector
    want = x.argmax(dim=-1)
    assert torch.equal(torch.ops.kvserve.argmax_rows(x), want)
    assert torch.equal(_argmax(x), want)
    wide = torch.randn(3, vocab + 5, generator=g)
    assert torch.equal(torch.ops.kvserve.argmax_rows(wide[:, :vocab]), wide[:, :vocab].argmax(-1))
    assert torch.ops.kvserve.argmax_rows(torch.empty(0, vocab)).shape == (0,)
    # bf16 logits (the LM head's own, for rows that need only their argmax): the index of
    # their exact float32 conversion, ties (many more in bf16) and NaNs included
    half = x.bfloat16()
    assert torch.equal(torch.ops.kvserve.argmax_rows(half), half.float().argmax(dim=-1))
    assert torch.equal(_argmax(half), half.float().argmax(dim=-1))
    half_wide = wide.bfloat16()[:, :vocab]
    assert torch.equal(torch.ops.kvserve.argmax_rows(half_wide), half_wide.float().argmax(-1))
    with pytest.raises(RuntimeError, match="float32 or bf16"):
        torch.ops.kvserve.argmax_rows(x.half())


def test_only_plain_greedy_rows_sample_from_bf16_logits():
    """``argmax_only`` holds for greedy rows with nothing else to do; any other row makes
    ``sample`` convert bf16 logits to float32 first, so it picks what it picks from
    float32 logits."""
    from kvserve.sampling import argmax_only

    greedy = SamplingParams(temperature=0)
    plain = SampleRow(greedy, seed=1, position=3)
    assert argmax_only([plain, plain]) and argmax_only([])
    others = [
        SampleRow(SamplingParams(temperature=0.8, seed=3), seed=3, position=3),
        SampleRow(SamplingParams(temperature=0, logprobs=2), seed=1, position=3),
        SampleRow(SamplingParams(temperature=0, repetition_penalty=1.3), 1, 3, output_ids=[5]),
        SampleRow(SamplingParams(temperature=0, logit_bias={7: 100.0}), seed=1, position=3),
        SampleRow(greedy, seed=1, position=3, suppress=(2,)),
    ]
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(2, 64, generator=g).bfloat16()
    for other in others:
        assert not argmax_only([plain, other])
        rows = [plain, other]
        want = sample(logits.float(), rows)
        got = sample(logits.clone(), rows)
        assert got.token_ids == want.token_ids and got.logprobs == want.logprobs
    assert sample(logits, [plain, plain]).token_ids == logits.float().argmax(-1).tolist()
