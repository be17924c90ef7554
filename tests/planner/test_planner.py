"""Model-based capacity planner (``kvserve plan``)."""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys

import pytest
from helpers import make_engine

from kvserve.planner.capacity import PlanInput, plan, variant

MHA_13B = PlanInput(model="13b-mha", dtype="float16", concurrency=32, context=2048)


def test_13b_mha_example():
    p = plan(MHA_13B)
    assert p.kv_bytes_per_token == 819_200  # 2 × 40 layers × 40 heads × 128 × 2 bytes
    assert p.kv_bytes_total == 32 * 2048 * 819_200
    assert p.kv_bytes_total / 1e9 == pytest.approx(53.7, abs=0.05)
    assert p.kv_bytes_total > 50e9


def test_fp8_halves_and_gqa_quarters():
    base = plan(MHA_13B)
    fp8 = plan(variant(MHA_13B, "kv_cache_dtype=fp8_e4m3,kv_cache_scales=head"))
    assert fp8.kv_bytes_per_token * 2 == base.kv_bytes_per_token
    # per-token scales (the default without checkpoint scales): 2 bytes per head vector
    token = plan(variant(MHA_13B, "kv_cache_dtype=fp8_e4m3"))
    assert token.kv_bytes_per_token == fp8.kv_bytes_per_token * (128 + 2) // 128
    mha = plan(PlanInput(model="llama-2-7b", dtype="float16"))  # 32 KV heads of 32
    gqa = plan(PlanInput(model="llama-3-8b", dtype="float16"))  # 8 KV heads of 32
    assert mha.kv_bytes_per_token == 4 * gqa.kv_bytes_per_token


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_planner_bytes_per_token_equals_what_the_engine_allocates(llama_dir, dtype):
    engine = make_engine(llama_dir, dtype=dtype)
    planned = plan(PlanInput(model=str(llama_dir), dtype=dtype))
    assert planned.kv_bytes_per_token == engine.kv_spec.bytes_per_token
    assert (
        plan(PlanInput(model=str(llama_dir / "config.json"), dtype=dtype)).kv_bytes_per_token
        == engine.kv_spec.bytes_per_token
    )


def test_hybrid_layout_counts_a_sliding_layer_window_only():
    """Gemma-3-1B at 8k: 4 global layers hold every token, 22 sliding ones 33 blocks of 16
    (their 512-token window plus the block the next token goes to); bf16, 1 KV head of 256."""
    layer_token = 2 * 1 * 256 * 2
    hybrid = plan(PlanInput(model="gemma-3-1b", context=8192))
    uniform = plan(PlanInput(model="gemma-3-1b", context=8192, kv_layout="uniform"))
    assert uniform.kv_bytes_per_request == 26 * 8192 * layer_token
    assert hybrid.kv_bytes_per_request == (4 * 8192 + 22 * 33 * 16) * layer_token
    assert hybrid.kv_layout.startswith("hybrid: 13 groups of 2 layers, 2 global")
    assert hybrid.max_concurrency_per_replica >= 4 * uniform.max_concurrency_per_replica


def test_planned_hybrid_request_is_what_the_engine_holds(model_dirs):
    """The planner's bytes for one request are the pages the engine's sequence holds while
    it decodes, with room for the block its next token goes to in each sliding group."""
    from helpers import greedy, random_prompts

    engine = make_engine(model_dirs["gemma3"], dtype="bfloat16")
    assert engine.kv.hybrid
    page = engine.kv_spec.bytes_per_block
    req = engine.add_request("p", random_prompts([200], seed=5)[0], greedy(57))
    held = 0
    while not req.is_finished:
        engine.step()
        if req.output_token_ids and not req.is_finished:  # decoding
            held = max(held, engine.kv.num_live_blocks("p") * page)
    planned = plan(PlanInput(model=str(model_dirs["gemma3"]), context=200, output_len=56))
    sliding = sum(w is not None for w in engine.kv.windows)
    assert held <= planned.kv_bytes_per_request <= held + sliding * page


def test_concurrency_and_gpu_count():
    p = plan(dataclasses.replace(MHA_13B, gpu_memory=80 * 1024**3, overhead=0))
    room = int(80 * 1024**3 * 0.9) - p.weight_bytes
    assert p.kv_bytes_per_gpu_available == room
    assert p.max_concurrency_per_replica == room // p.kv_bytes_per_request
    assert p.gpus_needed == -(-32 // p.max_concurrency_per_replica)
    huge = plan(PlanInput(model="llama-2-70b", gpu="L4-24GB"))
    assert huge.gpus_needed is None and huge.max_concurrency_per_replica == 0
    tp4 = plan(PlanInput(model="llama-2-70b", gpu="L4-24GB", tp=8, concurrency=4))
    assert tp4.gpus_needed is not None and tp4.gpus_needed % 8 == 0


def test_bad_inputs_are_clear_errors():
    with pytest.raises(ValueError, match="neither a preset"):
        plan(PlanInput(model="no-such-model"))
    with pytest.raises(ValueError, match="unknown GPU"):
        plan(PlanInput(model="llama-3-8b", gpu="TPU"))
    with pytest.raises(ValueError, match="key=value"):
        variant(MHA_13B, "colour=blue")
    with pytest.raises(ValueError, match="kv_cache_dtype"):
        plan(PlanInput(model="llama-3-8b", kv_cache_dtype="fp4"))


def test_cli_json_and_table():
    cmd = [
        sys.executable,
        "-m",
        "kvserve.cli",
        "plan",
        "--model",
        "13b-mha",
        "--dtype",
        "float16",
        "--concurrency",
        "32",
        "--context",
        "2048",
        "--compare",
        "kv_cache_dtype=fp8_e4m3,kv_cache_scales=head",
    ]
    out = subprocess.run([*cmd, "--json"], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    plans = json.loads(out.stdout)
    assert [p["kv_bytes_per_token"] for p in plans] == [819_200, 409_600]
    table = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
    assert table.returncode == 0 and "819,200" in table.stdout
    bad = subprocess.run([*cmd[:5], "nope"], capture_output=True, text=True, timeout=60)
    assert bad.returncode == 2 and "neither a preset" in bad.stderr


def test_gpu_names_take_the_model_alone_when_it_has_one_size():
    from kvserve.planner.hardware import find_accelerator

    assert find_accelerator("L40S").name == "L40S-48GB"  # as the README lists it
    assert find_accelerator("h100").name == "H100-80GB"
    with pytest.raises(ValueError, match=r"ambiguous GPU 'A100'.*A100-40GB, A100-80GB"):
        find_accelerator("A100")
    with pytest.raises(ValueError, match="unknown GPU"):
        find_accelerator("TPU")


def test_does_not_fit_says_why_and_which_tp_would():
    p = plan(PlanInput(model="llama-3-70b", gpu="L40S", concurrency=8))
    assert p.gpus_needed is None
    assert "exceed the usable" in p.fit_note and "try --tp 4" in p.fit_note
    assert plan(PlanInput(model="llama-3-70b", gpu="L40S", tp=4, concurrency=8)).gpus_needed
    assert p.gpu.startswith("L40S (48.00 GiB x 0.9)") and p.concurrency == 8
    out = subprocess.run(
        [sys.executable, "-m", "kvserve.cli", "plan", "--model", "llama-3-70b", "--gpu", "L40S"],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert out.returncode == 0 and "try --tp 4" in out.stdout and "L40S" in out.stdout


@pytest.mark.parametrize("arch", ["qwen3_moe", "gpt_oss"])
def test_int8_plan_counts_a_mixture_of_experts_as_the_engine_holds_it(model_dirs, arch, tmp_path):
    """``--quantization int8`` quantizes every expert's projections (each an ``nn.Linear``
    of the model, whatever the checkpoint stacks), not the routers: the planner counts
    the bytes the engine holds."""
    from kvserve.model.quantized import weight_bytes
    from kvserve.testing.models import build_hf_model

    model = model_dirs.get(arch) or build_hf_model(arch, tmp_path / arch)
    engine = make_engine(model, quantization="int8", dtype="float32")
    held = weight_bytes(engine.model)
    planned = plan(PlanInput(model=str(model), dtype="float32", quantization="int8"))
    assert abs(planned.weight_bytes - held) <= 0.03 * held, (planned.weight_bytes, held)
