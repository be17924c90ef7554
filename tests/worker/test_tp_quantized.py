"""Quantized weights under tensor parallelism (issue 49): each rank keeps its own part of
every quantized matrix as whole blocks (GGUF Q8_0 and Q4_K files, ``--quantization
int8``), never a dequantized copy; ``kvserve plan --quantization`` counts the bytes the
engine holds.

A rank's part is checked against the one-rank model module by module: a row-split
(column-parallel) module gives exactly its rows of the one-rank output, a column-split
(row-parallel: O, down) one gives the one-rank output when the ranks' outputs are summed.
Through the engine, two real ranks give the tokens of one rank whose O and down
projections sum the two ranks' parts in rank order, as the all-reduce does. (Not the
plain one-rank tokens: with int8 activations a different summation order can move an
activation across a rounding boundary of the next layer's quantization, so quantized TP
is exact against that order, not against every order.)"""

from __future__ import annotations

from pathlib import Path

import gguf
import pytest
import torch
from gguf_writer import write_gguf
from helpers import greedy, make_engine, random_prompts, run_to_end

from kvserve.model.attention import TorchPagedAttention
from kvserve.model.gguf import convert
from kvserve.model.loader import load_model
from kvserve.model.ops import TorchOps
from kvserve.model.parallel import ShardPlan
from kvserve.model.quantized import GGUFEmbedding, GGUFLinear, weight_bytes
from kvserve.model.spec import ModelSpec, RopeSpec, load_model_spec
from kvserve.planner.capacity import PlanInput, plan
from kvserve.testing.models import VOCAB, build_hf_model

F32 = {"dtype": "float32"}
# (source, hidden, architecture); hidden 512: a rank's O columns are whole Q4_K blocks (256)
SOURCES = [("Q8_0", 256, "llama"), ("Q4_K", 512, "llama"), ("int8", 256, "llama"),
           ("Q8_0", 256, "qwen2")]  # fmt: skip


def _checkpoint(tmp_path: Path, source: str, hidden: int, arch: str) -> tuple[Path, dict]:
    """4 query heads over 2 KV heads (a rank holds 2): an untied Llama, or a tied Qwen2
    (Q/K/V biases; the quantized embedding is the LM head), as a GGUF file of ``source``
    converted, or as a float checkpoint served ``--quantization int8``."""
    from transformers import LlamaConfig, Qwen2Config

    config = (LlamaConfig if arch == "llama" else Qwen2Config)(
        vocab_size=VOCAB, hidden_size=hidden, intermediate_size=512, num_attention_heads=4,
        num_key_value_heads=2, num_hidden_layers=2, max_position_embeddings=256,
        initializer_range=0.1, bos_token_id=0, eos_token_id=1,
        tie_word_embeddings=arch != "llama",
    )  # fmt: skip
    model_dir = build_hf_model(config, tmp_path / "hf")
    if source == "int8":
        return model_dir, {"quantization": "int8"}
    qt = gguf.GGMLQuantizationType[source]
    return convert(write_gguf(model_dir, tmp_path / f"{source}.gguf", arch, qt)), {}


class _Stub:
    """A rank's view of a two-rank group, in this process (no collective is called)."""

    def __init__(self, plan: ShardPlan):
        self.plan, self.rank, self.size = plan, plan.rank, plan.size


def _models(model_dir: Path, kw: dict) -> list:
    """The one-rank model, then rank 0's and rank 1's of two, as the engine loads them."""
    spec = load_model_spec(model_dir)
    q = kw.get("quantization", "auto")

    def load(tp):
        args = (spec, torch.float32, torch.device("cpu"), TorchPagedAttention(16), TorchOps(), 64)
        return load_model(model_dir, *args, tp, q)

    return [load(None)] + [load(_Stub(ShardPlan.for_rank(spec, r, 2))) for r in range(2)]


class _RankSum(torch.nn.Module):
    """A row-parallel projection as two ranks compute it: each rank's columns, summed in
    rank order (the all-reduce's)."""

    def __init__(self, parts: list[GGUFLinear]):
        super().__init__()
        self.parts = parts

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        k = self.parts[0].in_features
        return self.parts[0](x[..., :k]) + self.parts[1](x[..., k:])


@pytest.mark.parametrize(("source", "hidden", "arch"), SOURCES)
def test_each_rank_holds_its_part_of_every_quantized_matrix(tmp_path, source, hidden, arch):
    model_dir, kw = _checkpoint(tmp_path, source, hidden, arch)
    one, *ranks = _models(model_dir, kw)
    spec = load_model_spec(model_dir)
    x = torch.randn(5, hidden)
    for name, module in one.named_modules():
        if isinstance(module, GGUFEmbedding):  # vocabulary rows, exactly
            ids = torch.arange(VOCAB)
            parts = [r.get_submodule(name)(ids[: VOCAB // 2]) for r in ranks]
            assert torch.equal(torch.cat(parts), module(ids)), name
        if not isinstance(module, GGUFLinear):
            continue
        parts = [r.get_submodule(name) for r in ranks]
        assert all(isinstance(p, GGUFLinear) for p in parts), name  # kept quantized
        if name.endswith(("o_proj", "down_proj")):
            inp = torch.randn(5, module.in_features)
            want = module(inp)
            got = _RankSum(parts)(inp)
            assert (got - want).abs().max() <= 1e-5 * want.abs().max(), name
        elif name in ("lm_head", "lm_head_packed"):  # vocabulary rows (tied: the embedding's)
            assert torch.equal(torch.cat([p(x) for p in parts], -1), module(x))
        else:  # each rank's rows of the fused Q/K/V or gate/up, exactly
            whole, leaf = module(x), name.rpartition(".")[2]
            for r, part in enumerate(parts):
                rows = ShardPlan.for_rank(spec, r, 2)._fused_rows(leaf)
                want = torch.cat([whole[:, a:b] for a, b in rows], -1)
                assert torch.equal(part(x), want), (name, r)
    single = weight_bytes(one)
    norms = 4 * hidden * 5  # replicated on both ranks: 2 layers x 2 norms + the final one
    # a column-split matrix's scales per row are on both ranks (int8: 4 bytes a row)
    assert sum(weight_bytes(r) for r in ranks) <= 1.01 * single + norms
    mode = "int8" if source == "int8" else "auto"
    planned = plan(PlanInput(model=str(model_dir), dtype="float32", quantization=mode))
    assert abs(planned.weight_bytes - single) <= 0.02 * single
    assert plan(PlanInput(model=str(model_dir), dtype="float32")).weight_bytes > 2 * single


def _tokens(engine) -> dict[str, list[int]]:
    try:
        for i, p in enumerate(random_prompts([40, 9, 33], seed=3)):
            engine.add_request(f"r{i}", p, greedy(12))
        out = run_to_end(engine)
        engine.check_integrity()
        return out
    finally:
        engine.close()


@pytest.mark.parametrize(("source", "hidden", "arch"), SOURCES)
def test_two_ranks_give_one_ranks_tokens_summed_in_rank_order(tmp_path, source, hidden, arch):
    model_dir, kw = _checkpoint(tmp_path, source, hidden, arch)
    engine = make_engine(model_dir, tensor_parallel_size=2, max_num_batched_tokens=32, **F32, **kw)
    per_rank = engine.runner.weight_bytes
    got = _tokens(engine)
    _, *ranks = _models(model_dir, kw)
    ref = make_engine(model_dir, max_num_batched_tokens=32, **F32, **kw)
    ref.model.fused_stack = None  # the loop, so its projections can be swapped
    for name, _ in list(ref.model.named_modules()):
        if name.endswith(("o_proj", "down_proj")):
            parent, _, leaf = name.rpartition(".")
            rank_sum = _RankSum([r.get_submodule(name) for r in ranks])
            ref.model.get_submodule(parent).register_module(leaf, rank_sum)
    assert got == _tokens(ref)
    assert per_rank == [weight_bytes(r) for r in ranks]


def test_a_rank_split_off_block_boundaries_stays_dense():
    """hidden 256, 4 heads: a rank's O columns are 128 values, half a Q4_K block (256),
    whole Q8_0 blocks (32); the down projection's 256 are whole blocks of both."""
    s = ModelSpec(
        architecture="LlamaForCausalLM", family="llama", vocab_size=VOCAB, hidden_size=256,
        intermediate_size=512, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=64,
        rms_norm_eps=1e-6, max_position_embeddings=256, rope=RopeSpec(),
        tie_word_embeddings=False, attention_bias=False, o_proj_bias=False, mlp_bias=False,
        qk_norm=False, sliding_window=None, torch_dtype=None, bos_token_id=0,
        eos_token_ids=(1,),
    )  # fmt: skip
    plan_ = ShardPlan.for_rank(s, 1, 2)
    o, down = "model.layers.0.self_attn.o_proj.weight", "model.layers.0.mlp.down_proj.weight"
    assert plan_.k_slice(o) == (128, 128) and plan_.k_slice(down) == (256, 256)
    assert plan_.k_slice("model.layers.0.self_attn.q_proj.weight") is None
    assert plan_.splits_blocks(o, 32) and not plan_.splits_blocks(o, 256)
    assert plan_.splits_blocks(down, 256)
    raw = torch.arange(4 * 8 * 18, dtype=torch.uint8).view(4, 8 * 18)  # 4 rows of Q4_0 K=256
    assert torch.equal(plan_.read_blocks(o, raw, 32, 18), raw[:, 4 * 18 :])  # blocks 4..7
