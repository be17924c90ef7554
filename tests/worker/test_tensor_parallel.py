"""Tensor parallelism (issue 15): two ranks give the tokens one rank gives.

float32 (where a different summation order is far below the greedy margins of these
tiny random models): the four architectures' checkpoints — GQA with Llama-3 rope
scaling, MQA with a sliding window shorter than the prompts (its one KV head replicated),
QKV bias, q/k norms — with chunked prefill and prefix-cache hits; swap and recompute
preemption; int8 KV; a vocabulary that does not split evenly; two "nodes" (separate
processes joined over loopback TCP). Also each rank's weight bytes, the planner's
per-GPU capacity, and refusals at start. Every engine here is real: ranks are worker
processes joined by gloo.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch
from helpers import ARCHS, UNSPLIT_ARCHS, greedy, make_engine, random_prompts, run_to_end

from kvserve.errors import EngineError
from kvserve.model.parallel import ShardingError, ShardPlan, check_shardable
from kvserve.model.spec import load_model_spec
from kvserve.planner.capacity import PlanInput, plan
from kvserve.testing.procs import free_port, kill_process

F32 = {"dtype": "float32"}


def _waves(engine, vocab: int = 512) -> tuple[dict[str, list[int]], dict[str, int]]:
    """Two waves: prompts longer than the 32-token step budget (chunked, and longer than
    Mistral's 12-token window), then prompts sharing 48 tokens with the first wave
    (prefix-cache hits). Outputs and cached-token counts per request."""
    first = random_prompts([40, 70, 9, 33], vocab=vocab, seed=3)
    for i, p in enumerate(first):
        engine.add_request(f"a{i}", p, greedy(10))
    out = run_to_end(engine)
    cached = {}
    tails = random_prompts([5, 20], vocab=vocab, seed=4)
    reqs = [engine.add_request(f"b{i}", first[1][:48] + t, greedy(10)) for i, t in enumerate(tails)]
    out |= run_to_end(engine)
    for r in reqs:
        cached[r.request_id] = r.num_cached_tokens
    engine.check_integrity()
    return out, cached


def _run(model_dir: Path, tp: int, **kwargs) -> tuple[dict, dict]:
    engine = make_engine(model_dir, tensor_parallel_size=tp, max_num_batched_tokens=32, **kwargs)
    try:
        return _waves(engine, load_model_spec(model_dir).vocab_size)
    finally:
        engine.close()


@pytest.mark.parametrize("arch", [a for a in ARCHS if a not in UNSPLIT_ARCHS])
def test_two_ranks_match_one(model_dirs, arch):
    ref, ref_cached = _run(model_dirs[arch], 1, **F32)
    got, cached = _run(model_dirs[arch], 2, **F32)
    assert got == ref
    assert cached == ref_cached and all(n >= 48 for n in cached.values())


@pytest.mark.parametrize("mode", ["swap", "recompute"])
def test_preemption_under_tp(model_dirs, mode):
    model = model_dirs["llama"]
    prompts = random_prompts([30, 28, 35, 31], seed=5)

    def run(tp: int, **kw) -> tuple[dict, object]:
        engine = make_engine(
            model, tensor_parallel_size=tp, enable_prefix_caching=False, max_model_len=128, **kw
        )
        for i, p in enumerate(prompts):
            engine.add_request(f"r{i}", p, greedy(40))
        try:
            out = run_to_end(engine)
            engine.check_integrity()
            return out, engine
        finally:
            engine.close()

    ref, _ = run(1, **F32)
    # a rank's share of a block: 2 layers x 1 KV head x 16 dims x 4 B x (K, V) x 16 tokens
    block = 2 * 1 * 16 * 4 * 2 * 16
    got, engine = run(2, kv_cache_memory=12 * block, preemption_mode=mode, **F32)
    assert engine.kv.num_blocks == 12
    assert engine.scheduler.num_preemptions > 0
    assert {m for (m, _, _) in engine.scheduler.preemptions} == {mode}
    assert got == ref


@pytest.mark.parametrize("kv", ["int8", "fp8"])
def test_quantized_kv_under_tp(model_dirs, kv):
    """int8 (per-token scales) and fp8 (per-head scales calibrated on the first batch):
    each rank quantizes its own heads as one rank quantizes all."""
    kw = dict(kv_cache_dtype=kv, calculate_kv_scales=kv == "fp8", **F32)
    ref, _ = _run(model_dirs["qwen2"], 1, **kw)
    got, _ = _run(model_dirs["qwen2"], 2, **kw)
    assert got == ref


@pytest.fixture(scope="module")
def odd_vocab_dir(tmp_path_factory) -> Path:
    """A Llama whose vocabulary (509) does not split over two ranks."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(7)
    cfg = LlamaConfig(
        vocab_size=509, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
        initializer_range=0.1, bos_token_id=0, eos_token_id=1, tie_word_embeddings=True,
    )  # fmt: skip
    out = tmp_path_factory.mktemp("odd") / "llama509"
    LlamaForCausalLM(cfg).save_pretrained(out)
    return out


def test_vocab_not_divisible_and_weight_bytes(odd_vocab_dir):
    ref, _ = _run(odd_vocab_dir, 1, **F32)
    engine = make_engine(odd_vocab_dir, tensor_parallel_size=2, max_num_batched_tokens=32, **F32)
    try:
        got, _ = _waves(engine, 509)
        per_rank = engine.runner.weight_bytes
    finally:
        engine.close()
    assert got == ref
    one = make_engine(odd_vocab_dir, **F32)
    total = sum(p.numel() * p.element_size() for p in one.model.parameters())
    norms = sum(
        p.numel() * p.element_size() for n, p in one.model.named_parameters() if "norm" in n
    )
    one.close()
    pad = 1 * 64 * 4  # the last rank's one zero embedding row (255 + 254 -> 255 + 255)
    assert sum(per_rank) == total + norms + pad  # norms replicated, nothing else
    for b in per_rank:
        assert abs(b - (total - norms) / 2 - norms) <= pad


def test_two_nodes_on_loopback(model_dirs, tmp_path):
    """Node 1 is a separate ``kvserve serve --node-rank 1`` process (its ranks only);
    node 0 is this engine, which serves the rendezvous."""
    model = model_dirs["qwen3"]
    ref, _ = _run(model, 1, **F32)
    init = f"tcp://127.0.0.1:{free_port()}"
    log = (tmp_path / "node1.log").open("w")
    flags = ["--tensor-parallel-size", "2", "--nnodes", "2", "--distributed-init-method", init]
    node1 = subprocess.Popen(
        [sys.executable, "-m", "kvserve.cli", "serve", "--model", str(model), *flags,
         "--node-rank", "1", "--dtype", "float32"],
        stdout=log, stderr=subprocess.STDOUT,
    )  # fmt: skip
    try:
        got, _ = _run(model, 2, nnodes=2, node_rank=0, distributed_init_method=init, **F32)
        assert node1.wait(30) == 0  # the engine's close shut node 1's rank down
    finally:
        kill_process(node1)
        log.close()
    assert got == ref


def test_shard_plans():
    spec = load_model_spec(Path(__file__).parents[2] / "kvserve" / "models" / "default")
    import dataclasses

    smol = dataclasses.replace(spec, num_heads=9, num_kv_heads=3, intermediate_size=1536)
    a, b = (ShardPlan.for_rank(smol, r, 2) for r in range(2))
    assert (a.num_kv_heads, a.num_heads, b.kv_head_start, b.num_heads) == (2, 6, 2, 3)
    assert a.intermediate_size + b.intermediate_size == 1536
    mqa = dataclasses.replace(spec, num_heads=4, num_kv_heads=1)
    plans = [ShardPlan.for_rank(mqa, r, 4) for r in range(4)]
    assert [(p.kv_head_start, p.num_kv_heads, p.q_head_start) for p in plans] == [
        (0, 1, 0), (0, 1, 1), (0, 1, 2), (0, 1, 3)
    ]  # fmt: skip
    with pytest.raises(ShardingError, match=r"3 KV heads and 9 query heads.*try 1, 2, 3"):
        check_shardable(smol, 4)


@pytest.mark.parametrize(
    ("arch", "kv"), [("llama", "auto"), ("llama", "int8"), ("llama", "fp8"), ("gemma3", "auto")]
)
def test_kv_store_under_tp(model_dirs, tmp_path, arch, kv):
    """A restarted TP=2 engine restores the prefixes from the file tier (each stored block
    holds both ranks' shards) with TP=1's tokens; a TP=1 engine on the same store finds
    nothing (a block stored at another TP size is a miss, never misread). Gemma 3 in the
    hybrid KV layout: each rank writes and reads its groups' pages."""
    model, url = model_dirs[arch], f"file://{tmp_path}?capacity=64MiB"
    kw = dict(kv_cache_dtype=kv, max_num_batched_tokens=32, kv_store=(url,), **F32)
    ref, _ = _run(model, 1, kv_cache_dtype=kv, **F32)
    loaded = []
    for tp in (2, 2, 1):
        engine = make_engine(model, tensor_parallel_size=tp, **kw)
        try:
            got, _ = _waves(engine)
            engine.offloader.store.flush()
            loaded.append(engine.offloader.num_loaded_blocks)
        finally:
            engine.close()
        assert got == ref
    assert loaded[0] == 0 and loaded[1] >= 6 and loaded[2] == 0


def test_unshardable_and_unsupported_configs_are_refused_at_start(model_dirs, tmp_path):
    with pytest.raises(EngineError, match="2 KV heads and 4 query heads"):
        make_engine(model_dirs["llama"], tensor_parallel_size=3)
    with pytest.raises(EngineError, match=r"fp8 KV cache and --kv-store.*not supported yet"):
        make_engine(
            model_dirs["llama"],
            tensor_parallel_size=2,
            kv_cache_dtype="fp8",
            kv_cache_scales="head",
            kv_store=(f"file://{tmp_path}?capacity=1MiB",),
        )
    with pytest.raises(ValueError, match="not a multiple of nnodes"):
        make_engine(model_dirs["llama"], tensor_parallel_size=3, nnodes=2)


def test_capacity_matches_the_planner(model_dirs):
    """``kvserve plan --tp 2``'s per-GPU KV budget gives the engine exactly the
    concurrency the plan promises (MQA: the one KV head is on both ranks)."""
    for arch in ("llama", "mistral"):
        model = model_dirs[arch]
        p = plan(
            PlanInput(
                model=str(model), dtype="float32", gpu_memory=2 * 1024**2,
                gpu_memory_utilization=1.0, overhead=0, tp=2, context=64,
            )
        )  # fmt: skip
        engine = make_engine(
            model, tensor_parallel_size=2, kv_cache_memory=p.kv_bytes_per_gpu_available, **F32
        )
        try:
            tokens = engine.kv.num_blocks * engine.kv.block_size
            assert tokens // p.tokens_per_request == p.max_concurrency_per_replica > 0
        finally:
            engine.close()


def test_tp_is_batch_invariant_in_bf16(model_dirs):
    """The determinism rule holds under TP: sampled tokens of a request are the same alone
    and among others (the shared-memory all-reduce sums elementwise in rank order)."""
    from kvserve.sampling import SamplingParams

    model = model_dirs["qwen2"]
    prompts = random_prompts([30, 50, 12, 41, 25, 64], seed=9)
    engine = make_engine(
        model, tensor_parallel_size=2, dtype="bfloat16", enable_prefix_caching=False
    )
    params = SamplingParams(temperature=0.9, top_p=0.95, max_tokens=20, ignore_eos=True)
    try:
        alone = {}
        for i, p in enumerate(prompts):
            engine.add_request(f"s{i}", p, params, seed=i)
            alone |= run_to_end(engine)
        for i, p in enumerate(prompts):
            engine.add_request(f"t{i}", p, params, seed=i)
        together = run_to_end(engine)
    finally:
        engine.close()
    assert [alone[f"s{i}"] for i in range(6)] == [together[f"t{i}"] for i in range(6)]
