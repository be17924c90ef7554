"""gpt-oss (``GptOssForCausalLM``) against transformers' own model, float32: sliding (12)
and global layers alternating, a sink logit per head, biases on every projection, YaRN
(not truncated), a biased router softmaxed over its top-k logits, experts stacked in the
checkpoint (gate/up interleaved) with a clamped SwiGLU. Not in ``ARCHS`` (the suite's
time): its parity, batch invariance and loading are checked here."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from helpers import (
    greedy,
    hf_greedy,
    hf_model,
    make_engine,
    random_prompts,
    run_to_end,
    step_logits,
)
from safetensors.torch import load_file, save_file

from kvserve.model.gpt_oss import expand, model_names
from kvserve.model.loader import WeightLoadError
from kvserve.model.mlp import ClampedSwiGLU, SparseMoE
from kvserve.model.spec import ModelConfigError, load_model_spec
from kvserve.testing.models import build_hf_model

LENGTHS = [1, 15, 40, 60]  # past the 12-token window of the sliding layers


@pytest.fixture(scope="module")
def gpt_oss_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_hf_model("gpt_oss", tmp_path_factory.mktemp("gpt_oss") / "m")


def test_spec_reads_what_gpt_oss_differs_in(gpt_oss_dir):
    spec = load_model_spec(gpt_oss_dir)
    assert spec.family == "gpt_oss" and spec.layer_windows == (12, 0)
    assert spec.attention_sinks and spec.attention_bias and spec.o_proj_bias and spec.mlp_bias
    assert spec.router_bias and spec.softmax_after_topk and spec.num_experts == 4
    assert (spec.swiglu_limit, spec.swiglu_alpha) == (0.5, 1.702)
    assert spec.rope.rope_type == "yarn" and not spec.rope.truncate


@pytest.mark.parametrize("backend", ["cpu", "torch"])
def test_logits_match_transformers_at_every_step(gpt_oss_dir, backend):
    """Chunked prefill (24-token budget), decodes and mixes; prompts past the window."""
    engine = make_engine(gpt_oss_dir, max_num_batched_tokens=24, attention_backend=backend)
    moe = engine.model.layers[0].mlp
    assert isinstance(moe, SparseMoE) and isinstance(moe.experts[0], ClampedSwiGLU)
    prompts = random_prompts(LENGTHS, seed=4)
    outputs, steps = step_logits(engine, prompts, 6)
    ref_model = hf_model(gpt_oss_dir)
    for i, p in enumerate(prompts):
        with torch.no_grad():
            ref = ref_model(torch.tensor([p + outputs[f"r{i}"]])).logits[0]
        for k, ours in enumerate(steps[f"r{i}"]):
            diff = (ours.cpu() - ref[len(p) - 1 + k]).abs().max().item()
            assert diff < 1e-4, f"prompt len {len(p)} step {k}: max |Δlogit| {diff}"
    engine.check_integrity()


def test_greedy_text_equals_transformers_generate(gpt_oss_dir):
    engine = make_engine(gpt_oss_dir, max_num_batched_tokens=16)
    prompts = random_prompts([40, 25, 9], seed=5)
    for i, p in enumerate(prompts):
        engine.add_request(f"r{i}", p, greedy(16))
    out = run_to_end(engine)
    ref = hf_model(gpt_oss_dir)
    for i, p in enumerate(prompts):
        assert out[f"r{i}"] == hf_greedy(ref, p, 16), f"prompt {i}"


def test_bf16_text_is_the_same_alone_and_in_a_batch(gpt_oss_dir):
    """Batch invariance with the sinks, the biased router and the clamped experts."""
    prompts = random_prompts([23, 40, 9, 31], seed=21)
    alone = {}
    for i, p in enumerate(prompts):
        engine = make_engine(gpt_oss_dir, dtype="bfloat16")
        engine.add_request(str(i), p, greedy(24))
        alone.update(run_to_end(engine))
    engine = make_engine(gpt_oss_dir, dtype="bfloat16", max_num_batched_tokens=48)
    for i, p in enumerate(prompts):
        engine.add_request(str(i), p, greedy(24))
    assert run_to_end(engine) == alone


def test_stacked_experts_split_into_each_experts_rows(gpt_oss_dir):
    """``expand``: expert e's gate rows are the even columns of its gate_up block, up the
    odd ones, transposed; down transposed; biases split alike; the router renamed."""
    spec = load_model_spec(gpt_oss_dir)
    state = load_file(gpt_oss_dir / "model.safetensors")
    p = "model.layers.1.mlp."
    gate_up, bias = state[p + "experts.gate_up_proj"], state[p + "experts.gate_up_proj_bias"]
    parts = dict(expand(spec, p + "experts.gate_up_proj", gate_up))
    assert len(parts) == 2 * spec.num_experts
    assert torch.equal(parts[p + "experts.2.gate_proj.weight"], gate_up[2][:, 0::2].t())
    assert torch.equal(parts[p + "experts.2.up_proj.weight"], gate_up[2][:, 1::2].t())
    biases = dict(expand(spec, p + "experts.gate_up_proj_bias", bias))
    assert torch.equal(biases[p + "experts.3.up_proj.bias"], bias[3][1::2])
    down = dict(expand(spec, p + "experts.down_proj", state[p + "experts.down_proj"]))
    assert down[p + "experts.0.down_proj.weight"].shape == (spec.hidden_size, 32)
    assert model_names(spec, p + "router.bias") == [p + "gate.bias"]


def test_a_stacked_tensor_of_the_wrong_expert_count_names_it(gpt_oss_dir, copy_model):
    bad = copy_model(gpt_oss_dir)
    state = load_file(bad / "model.safetensors")
    name = "model.layers.0.mlp.experts.down_proj"
    state[name] = state[name][:3].contiguous()
    save_file(state, str(bad / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(WeightLoadError, match=f"{name}.*4 experts"):
        make_engine(bad)


def test_a_non_positive_swiglu_limit_is_refused_by_name(gpt_oss_dir, copy_model):
    bad = copy_model(gpt_oss_dir)
    cfg = json.loads((bad / "config.json").read_text())
    (bad / "config.json").write_text(json.dumps({**cfg, "swiglu_limit": 0}))
    with pytest.raises(ModelConfigError, match="swiglu_limit"):
        load_model_spec(bad)


def _mxfp4(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A stacked expert weight ``[experts, in, out]`` as MXFP4 ``[experts, out, in / 32,
    16]`` blocks and ``[experts, out, in / 32]`` scales (rounded to the nearest code)."""
    groups = w.transpose(1, 2).reshape(*w.shape[:1], w.shape[2], -1, 32)
    amax = groups.abs().amax(-1, keepdim=True).clamp_min(1e-30)
    exp = torch.floor(torch.log2(amax)) - 2  # the largest |value| maps into [4, 8)
    x = (groups / torch.exp2(exp)).clamp(-6, 6)
    mags = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])
    codes = (x.abs().unsqueeze(-1) - mags).abs().argmin(-1) + 8 * (x < 0)
    packed = (codes[..., 0::2] | (codes[..., 1::2] << 4)).to(torch.uint8)
    return packed.contiguous(), (exp.squeeze(-1) + 127).to(torch.uint8).contiguous()


def test_an_mxfp4_checkpoint_serves_its_dequantized_weights(gpt_oss_dir, tmp_path):
    """OpenAI's checkpoint layout (expert weights as MXFP4 blocks and scales): kvserve
    gives the logits and text of the same model with the experts dequantized by
    transformers' own MXFP4 conversion, saved as a bf16-style stacked checkpoint."""
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    state = load_file(gpt_oss_dir / "model.safetensors")
    quantized, dense = dict(state), dict(state)
    for name in [n for n in state if n.endswith(("experts.gate_up_proj", "experts.down_proj"))]:
        blocks, scales = _mxfp4(state[name])
        del quantized[name]
        quantized[name + "_blocks"], quantized[name + "_scales"] = blocks, scales
        dense[name] = convert_moe_packed_tensors(blocks, scales, dtype=torch.float32)
        assert not torch.equal(dense[name], state[name])  # rounded: a model of its own
    dirs = {}
    for kind, tensors in (("mxfp4", quantized), ("dense", dense)):
        d = tmp_path / kind
        d.mkdir()
        for f in gpt_oss_dir.iterdir():
            if f.name != "model.safetensors":
                (d / f.name).write_bytes(f.read_bytes())
        save_file(tensors, str(d / "model.safetensors"), metadata={"format": "pt"})
        dirs[kind] = d
    prompts = random_prompts([30, 13], seed=9)
    mx_out, mx_logits = step_logits(make_engine(dirs["mxfp4"]), prompts, 8)
    out, logits = step_logits(make_engine(dirs["dense"]), prompts, 8)
    assert mx_out == out
    for rid, steps in logits.items():
        assert torch.allclose(torch.stack(mx_logits[rid]), torch.stack(steps), atol=1e-5)


def test_two_ranks_give_one_ranks_logprobs(gpt_oss_dir):
    """Tensor parallelism: each rank its heads' sink logits and every expert's slice of
    the intermediate size (the stacked tensors split per expert, then per rank): the text
    and the top-5 logprobs of every step as one rank's."""
    from kvserve.sampling.params import SamplingParams

    runs = []
    for tp in (1, 2):
        engine = make_engine(gpt_oss_dir, tensor_parallel_size=tp, max_num_batched_tokens=24)
        try:
            params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True, logprobs=5)
            reqs = [
                engine.add_request(f"r{i}", p, params)
                for i, p in enumerate(random_prompts([40, 9], seed=12))
            ]
            done = run_to_end(engine)
            top = [
                [(t, lp.logprob) for step in r.output_logprobs for t, lp in sorted(step.items())]
                for r in reqs
            ]
            runs.append((done, top))
        finally:
            engine.close()
    assert runs[0][0] == runs[1][0]
    for one, two in zip(runs[0][1], runs[1][1], strict=True):
        assert [t for t, _ in one] == [t for t, _ in two]
        assert max(abs(a - b) for (_, a), (_, b) in zip(one, two, strict=True)) < 1e-4
