"""Helpers shared by tests: drive an engine by hand and compare with HF transformers."""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import torch

from kvserve.config import EngineArgs
from kvserve.engine.llm_engine import LLMEngine
from kvserve.sampling import SamplingParams
from kvserve.testing.models import ARCHS

__all__ = ["ARCHS"]  # (the families' list lives with their builders)

# the tiny checkpoints conftest builds
MOE_ARCHS = ("qwen3_moe", "qwen2_moe", "mixtral")
UNSPLIT_ARCHS: tuple[str, ...] = ()  # architectures not split over ranks yet (none)


def make_engine(model_dir: Path, **kwargs) -> LLMEngine:
    kwargs.setdefault("kv_cache_memory", "8MiB")
    return LLMEngine(EngineArgs(model=str(model_dir), **kwargs))


def random_prompts(lengths: list[int], vocab: int = 512, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(2, vocab, (n,), generator=g).tolist() for n in lengths]


def greedy(max_tokens: int) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)


def run_to_end(engine: LLMEngine, max_steps: int = 10_000) -> dict[str, list[int]]:
    """Step until idle (bounded); returns output token ids per finished request."""
    done: dict[str, list[int]] = {}
    for _ in range(max_steps):
        if not engine.has_unfinished_requests():
            return done
        step_finished(engine, done)
    raise AssertionError(f"engine still busy after {max_steps} steps")


def step_finished(engine: LLMEngine, done: dict[str, list[int]]) -> None:
    """One step; ``done`` gets the whole output token ids of each request it finished."""
    live = dict(engine.requests)
    for d in engine.step():
        if d.finished and d.request_id in live:
            done[d.request_id] = list(live[d.request_id].output_token_ids)


def step_logits(
    engine: LLMEngine, prompts: list[list[int]], max_tokens: int
) -> tuple[dict[str, list[int]], dict[str, list[torch.Tensor]]]:
    """Run ``prompts`` (requests ``r0``, ``r1``, …) greedily to the end, keeping the
    logits each step sampled from: (output token ids, logits per step) per request."""
    engine.runner.keep_logits = True
    for i, p in enumerate(prompts):
        engine.add_request(f"r{i}", p, greedy(max_tokens))
    steps: dict[str, list[torch.Tensor]] = {f"r{i}": [] for i in range(len(prompts))}
    outputs: dict[str, list[int]] = {}
    while engine.has_unfinished_requests():
        step_finished(engine, outputs)
        for rid, logits in engine.runner.last_logits.items():
            steps[rid].append(logits)
    return outputs, steps


def hf_model(model_dir: Path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()


def hf_greedy(model, prompt: list[int], max_new_tokens: int) -> list[int]:
    """HF ``generate`` with EOS disabled, so it runs exactly ``max_new_tokens``."""
    with torch.no_grad():
        out = model.generate(
            torch.tensor([prompt]),
            attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
            max_new_tokens=max_new_tokens,
            do_sample=False,
            eos_token_id=None,
            pad_token_id=0,
        )
    return out[0, len(prompt) :].tolist()


def run_counting(engine: LLMEngine, prompt: list[int], rid: str = "r", max_tokens: int = 8):
    """Run one greedy request to the end; returns (output tokens, the request's cached
    tokens, the tokens the engine computed for it — counted at the real scheduler)."""
    computed = [0]
    schedule = engine.scheduler.schedule

    def counting():
        out = schedule()
        computed[0] += out.num_tokens
        return out

    engine.scheduler.schedule = counting
    req = engine.add_request(rid, prompt, greedy(max_tokens))
    done = run_to_end(engine)
    engine.scheduler.schedule = schedule
    engine.check_integrity()
    return done[rid], req.num_cached_tokens, computed[0]


def filled_quantized_cache(fmt: str, num_slots: int, g: torch.Generator):
    """A ``QuantizedKVCache`` (2 KV heads, head dim 64) of format ``fmt`` (a kv-cache
    dtype; ``…@head`` for fp8 with per-head scales, which are set first) with every slot
    written from random K (×3) and V."""
    from kvserve.model.kv_quant import QuantizedKVCache, kv_format

    hkv, d = 2, 64
    name, _, scales = fmt.partition("@")
    kv = kv_format(name, torch.float32, scales or "auto")
    cache = QuantizedKVCache(kv, num_slots, hkv, d, torch.device("cpu"))
    if kv.scale == "head":
        cache.set_head_scales(torch.tensor([0.5, 2.0]), torch.tensor([0.25, 1.5]))
    slots = torch.arange(num_slots)
    cache.write(
        slots,
        torch.randn(num_slots, hkv, d, generator=g) * 3,
        torch.randn(num_slots, hkv, d, generator=g),
    )
    return cache


def quantized_blocks(fmt: str, nb: int, bs: int, g: torch.Generator):
    """A ``filled_quantized_cache`` of ``nb`` blocks seen as blocks: (codes K, codes V,
    their scales, dequantized float32 K, V), each ``[nb, bs, 2, 64]`` but the scales."""
    cache = filled_quantized_cache(fmt, nb * bs, g)
    slots = torch.arange(nb * bs)
    blocks = (nb, bs, *cache.data.shape[-2:])
    kq, vq = cache.data[0].view(blocks), cache.data[1].view(blocks)
    kf = cache.read_slots(0, slots, torch.float32).view(blocks)
    vf = cache.read_slots(1, slots, torch.float32).view(blocks)
    return kq, vq, (cache.scale[0], cache.scale[1]), kf, vf


def paged_batch(seqs: list[tuple[int, int]], bs: int, g: torch.Generator):
    """A random paged batch for attention tests: ``seqs`` as (context, r) pairs, r wrapped
    into 1..context query rows. Returns (seqs as (context, rows), blocks to allocate,
    tables [S, max_blocks] of distinct shuffled blocks, lens [S], query_start [S + 1])."""
    seqs = [(ctx, 1 + r % ctx) for ctx, r in seqs]
    max_blocks = -(-max(c for c, _ in seqs) // bs)
    nb = max_blocks * len(seqs) + 2
    tables = torch.randperm(nb, generator=g)[: max_blocks * len(seqs)].view(len(seqs), -1)
    lens = torch.tensor([c for c, _ in seqs])
    starts = torch.tensor([0, *torch.tensor([n for _, n in seqs]).cumsum(0).tolist()])
    return seqs, nb, tables.contiguous(), lens, starts


def attention_reference(
    q, k, v, table, ctx, n, bs, window, sinks, scale, softcap=0.0, sink_logits=None
):
    """float32 softmax attention of the last ``n`` of ``ctx`` positions, from a block table;
    scores soft-capped to ``softcap * tanh(score / softcap)`` when ``softcap`` > 0; with
    ``sink_logits`` ``[heads]`` one more softmax column per head, its weight dropped."""
    hkv, d = k.shape[2], k.shape[3]
    slots = torch.tensor([table[p // bs] * bs + p % bs for p in range(ctx)])
    kk = k.reshape(-1, hkv, d)[slots].float()
    vv = v.reshape(-1, hkv, d)[slots].float()
    g = q.shape[1] // hkv
    kk, vv = kk.repeat_interleave(g, 1), vv.repeat_interleave(g, 1)
    out = torch.empty(n, q.shape[1], d)
    for j in range(n):
        p = ctx - n + j
        keys = torch.arange(ctx)
        ok = keys <= p
        if window:
            ok &= (keys > p - window) | (keys < sinks)
        s = torch.einsum("hd,thd->ht", q[j].float(), kk) * scale
        if softcap > 0:
            s = torch.tanh(s / softcap) * softcap
        s = s.masked_fill(~ok, -math.inf)
        if sink_logits is not None:
            s = torch.cat([s, sink_logits.float()[:, None]], dim=1).softmax(-1)[:, :-1]
        else:
            s = s.softmax(-1)
        out[j] = torch.einsum("ht,thd->hd", s, vv)
    return out


@contextmanager
def amx_switched(switch: Callable[[bool], bool], name: str) -> Iterator[None]:
    """Within the block the kernels ``switch`` governs run ``name``: "amx" (AMX tiles, where
    the CPU has them) or "avx512". ``switch`` is an op such as
    ``torch.ops.kvserve.attention_use_amx``: it takes whether AMX may run and returns the
    previous setting, which is restored after the block."""
    before = switch(name == "amx")
    try:
        yield
    finally:
        switch(before)


@contextmanager
def gguf_portable() -> Iterator[None]:
    """Within the block the GGUF / int8 kernels run their portable loops (no VNNI, no AMX
    tiles, scalar activation quantization): the reference the fast paths must equal."""
    before = torch.ops.kvserve.gguf_gemm_use_vnni(False)
    try:
        yield
    finally:
        torch.ops.kvserve.gguf_gemm_use_vnni(before)


def expert_modules(
    spec, hidden: int, inter: int, count: int, bias: bool, clamped: bool
) -> torch.nn.ModuleList:
    """``count`` float32 MoE experts of ``spec``'s family resized to ``hidden`` /
    ``inter``, on the C++ ops: SwiGLU ``MLP``s, or gpt-oss's ``ClampedSwiGLU`` (limit 0.05,
    which weights of scale 0.1 reach; alpha 1.702). Seeded: the same experts every call."""
    import dataclasses

    from kvserve.model.mlp import MLP, ClampedSwiGLU
    from kvserve.model.ops import CpuKernelOps

    torch.manual_seed(0)
    shape = dataclasses.replace(
        spec, hidden_size=hidden, intermediate_size=inter, mlp_bias=bias,
        swiglu_limit=0.05 if clamped else None, swiglu_alpha=1.702,
    )  # fmt: skip
    cls = ClampedSwiGLU if clamped else MLP
    return torch.nn.ModuleList(cls(shape, CpuKernelOps(), None) for _ in range(count))


def experts_looped(experts: torch.nn.ModuleList, x: torch.Tensor, counts: list[int]):
    """``x``'s rows grouped by expert (``counts[e]`` for expert e) through their expert
    modules one by one: what a one-call expert kernel must equal."""
    parts, start = [], 0
    for expert, n in zip(experts, counts, strict=True):
        if n:
            parts.append(expert(x[start : start + n]))
            start += n
    return torch.cat(parts)


def check_every_forward(model) -> list[int]:
    """Make ``model.forward`` run the Python loop, then the fused stack, on each step's
    inputs and assert that the stack ran and gave the same output; returns the list that
    collects each step's token count."""
    fused, forward, steps = model.fused_stack, model.forward, []

    def stack(*args):
        out = fused(*args)
        assert out is not None, "the fused stack refused a step"
        return out

    def checked(ids, positions, caches, meta):
        model.fused_stack = None
        ref = forward(ids, positions, caches, meta)
        model.fused_stack = stack
        got = forward(ids, positions, caches, meta)
        assert torch.equal(ref, got), f"step {len(steps)} of {ids.numel()} tokens differs"
        steps.append(ids.numel())
        return got

    model.forward = checked
    return steps


def run_checked(engine, seed: int) -> list[int]:
    """Runs prompts of 5-40 tokens (past the test models' 12-token windows) in the steps
    ``engine``'s budget allows, then prompts that hit their cached prefixes, every step
    checked by ``check_every_forward``. Returns the steps' token counts."""
    steps = check_every_forward(engine.runner.model)
    prompts = random_prompts([5, 30, 17, 40], seed=seed)
    for i, p in enumerate(prompts):
        engine.add_request(f"a{i}", p, greedy(6))
    first = run_to_end(engine)
    for i, p in enumerate(prompts[1:3]):  # same prefix, new tails: cache hits
        engine.add_request(f"b{i}", [*p[:16], 7, 8, 9], greedy(4))
    second = run_to_end(engine)
    assert all(len(v) == 6 for v in first.values()) and all(len(v) == 4 for v in second.values())
    return steps
