"""What each GGUF ``general.architecture`` means as an HF checkpoint: its ``config.json``,
its tensors' HF names, and how llama.cpp's converter changed the values on the way in.

llama.cpp's conventions (``convert_hf_to_gguf.py``), undone here:

- ``llama``: Q/K rows permuted for interleaved rotary (``unpermute``); Mistral models use
  this architecture too.
- ``qwen2``, ``qwen3``, ``qwen3moe``, ``qwen2moe``: tensors as HF has them (rotary in
  halves); a MoE layer's experts stacked into one ``[experts, rows, cols]`` tensor per
  projection, split back into ``mlp.experts.N.*``; Qwen3-MoE renormalises the top-k
  weights (llama.cpp always does), Qwen2-MoE does not and has a shared expert
  (``*_shexp``) whose gate llama.cpp stores as one row.
- ``phi3``: q/k/v and gate/up fused as HF's Phi-3 stores them (``attn_qkv``, ``ffn_up``);
  LongRoPE's factors as two tensors (``rope_factors_long``/``_short``) that become the
  config's ``rope_scaling``; the sliding window, when the file has one, for every layer.
- ``gemma3``: every RMSNorm weight stored as ``1 + w``; the sliding/global pattern (every
  6th layer global), the local rotary base (10000) and the query scale (head_dim, or
  hidden / heads for the 62-layer 27B) are llama.cpp's, not in the metadata.
- ``gemma2``: as ``gemma3`` without q/k norms or a local rotary base; every other layer
  slides (the first does), the query scale is hidden / heads for the 46-layer 27B, and the
  attention and final logit soft-capping are in the metadata.
- ``gpt-oss``: each expert projection stacked ``[experts, out, in]`` (gate and up apart,
  which HF's checkpoint interleaves; OpenAI's MXFP4 files keep them as MXFP4 blocks,
  dequantized here like any other type), biases ``[experts, out]``, the router as
  ``ffn_gate_inp`` with its bias, a sink logit per head (``attn_sinks``); every other layer
  slides (the first does); YaRN from the metadata, untruncated, and the clamped SwiGLU's
  limit (7) are gpt-oss's, not in the metadata. The experts become each expert's rows.
- any architecture: ``rope.scaling.type`` ``linear`` or ``yarn`` (its factor, original
  context and, when present, beta_fast/beta_slow).

Anything else raises ``GGUFError`` naming the architecture and the supported ones.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from kvserve.model.gguf_tokenizer import GGUFError

HF_ARCHITECTURES = {
    "llama": "LlamaForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "qwen3moe": "Qwen3MoeForCausalLM",
    "qwen2moe": "Qwen2MoeForCausalLM",
    "gemma2": "Gemma2ForCausalLM",
    "gemma3": "Gemma3ForCausalLM",
    "phi3": "Phi3ForCausalLM",
    "gpt-oss": "GptOssForCausalLM",
}
_GEMMA3_PATTERN = 6  # llama.cpp: every 6th layer attends globally
_GEMMA_NORMS = ("gemma2", "gemma3")  # RMSNorm weights stored as 1 + w
_GEMMA3_LOCAL_THETA = 10000.0

# GGUF tensor name (per layer after ``blk.N.``, without .weight/.bias) → HF (after
# ``model.layers.N.``); architecture-specific entries in _LAYER_NAMES_BY_ARCH
_LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_GEMMA_LAYER_NAMES = {
    "ffn_norm": "pre_feedforward_layernorm",
    "post_attention_norm": "post_attention_layernorm",
    "post_ffw_norm": "post_feedforward_layernorm",
}
_LAYER_NAMES_BY_ARCH = {
    "gemma2": _GEMMA_LAYER_NAMES,
    "gemma3": _GEMMA_LAYER_NAMES,
    "qwen3moe": {"ffn_gate_inp": "mlp.gate"},
    "gpt-oss": {
        "post_attention_norm": "post_attention_layernorm",
        "ffn_gate_inp": "mlp.router",
        "attn_sinks": "self_attn.sinks",
    },
    "phi3": {"attn_qkv": "self_attn.qkv_proj", "ffn_up": "mlp.gate_up_proj"},
    "qwen2moe": {
        "ffn_gate_inp": "mlp.gate",
        "ffn_gate_inp_shexp": "mlp.shared_expert_gate",
        "ffn_gate_shexp": "mlp.shared_expert.gate_proj",
        "ffn_up_shexp": "mlp.shared_expert.up_proj",
        "ffn_down_shexp": "mlp.shared_expert.down_proj",
    },
}
_EXPERTS = {"ffn_gate_exps": "gate_proj", "ffn_up_exps": "up_proj", "ffn_down_exps": "down_proj"}
_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}


def field(reader: Any, key: str, default: Any = ...) -> Any:
    """Metadata value ``key`` (GGUFError when missing and no ``default``)."""
    f = reader.fields.get(key)
    if f is None:
        if default is ...:
            raise GGUFError(f"metadata lacks {key!r}")
        return default
    return f.contents()


def architecture(reader: Any) -> str:
    """The file's ``general.architecture``, if kvserve serves it (else GGUFError)."""
    arch = field(reader, "general.architecture")
    if arch not in HF_ARCHITECTURES:
        raise GGUFError(
            f"general.architecture {arch!r} is not supported "
            f"(supported: {', '.join(HF_ARCHITECTURES)})"
        )
    return arch


_ROPE_FACTORS = ("rope_factors_long.weight", "rope_factors_short.weight")


def _tensor(reader: Any, name: str) -> np.ndarray | None:
    """A small float32 tensor of the file (LongRoPE's factors), or None."""
    for t in reader.tensors:
        if t.name == name:
            return np.asarray(t.data, dtype=np.float32).reshape(-1)
    return None


def hf_config(reader: Any, has_output: bool) -> dict[str, Any]:
    """``config.json`` of the file's model, as transformers would write it."""
    arch = architecture(reader)

    def get(key: str, default: Any = ...) -> Any:
        return field(reader, f"{arch}.{key}", default)

    heads = int(get("attention.head_count"))
    hidden = int(get("embedding_length"))
    head_dim = int(get("attention.key_length", hidden // heads))
    rope_dim = int(get("rope.dimension_count", head_dim))
    if rope_dim != head_dim:
        raise GGUFError("partial rotary (rope.dimension_count) is not supported")
    layers = int(get("block_count"))
    tokens = field(reader, "tokenizer.ggml.tokens")
    config: dict[str, Any] = {
        "architectures": [HF_ARCHITECTURES[arch]],
        "model_type": arch,
        "hidden_act": "silu",
        "hidden_size": hidden,
        "intermediate_size": int(get("feed_forward_length")),
        "num_hidden_layers": layers,
        "num_attention_heads": heads,
        "num_key_value_heads": int(get("attention.head_count_kv", heads)),
        "head_dim": head_dim,
        "rms_norm_eps": float(get("attention.layer_norm_rms_epsilon")),
        "max_position_embeddings": int(get("context_length")),
        "rope_theta": float(get("rope.freq_base", 10000.0)),
        "vocab_size": int(get("vocab_size", len(tokens))),
        "tie_word_embeddings": not has_output,
        "bos_token_id": field(reader, "tokenizer.ggml.bos_token_id", None),
        "eos_token_id": field(reader, "tokenizer.ggml.eos_token_id", None),
        "dtype": "bfloat16",  # the serving default; the tensors themselves are float32
    }
    scaling = get("rope.scaling.type", "none")
    if scaling not in ("none", "linear", "yarn"):
        raise GGUFError(f"{arch}.rope.scaling.type {scaling!r} is not supported")
    if scaling != "none":
        config["rope_scaling"] = {
            "rope_type": scaling,
            "factor": float(get("rope.scaling.factor")),
        }
    if scaling == "yarn":
        yarn = config["rope_scaling"]
        original = get("rope.scaling.original_context_length", None)
        # absent: the context length, as llama.cpp takes it
        yarn["original_max_position_embeddings"] = int(original or get("context_length"))
        for key in ("beta_fast", "beta_slow"):
            value = get(f"rope.scaling.yarn_{key}", None)
            if value:
                yarn[key] = float(value)
        if arch == "gpt-oss":
            yarn["truncate"] = False  # OpenAI's config: the ramp's ends are not rounded
    if arch == "qwen2":
        config["attention_bias"] = True  # Qwen2's q/k/v biases (the files carry them)
    elif arch in ("qwen3moe", "qwen2moe"):
        config.update(
            num_experts=int(get("expert_count")),
            num_experts_per_tok=int(get("expert_used_count")),
            moe_intermediate_size=int(get("expert_feed_forward_length")),
            norm_topk_prob=arch == "qwen3moe",
        )
    if arch == "qwen2moe":
        config.update(
            qkv_bias=True,
            shared_expert_intermediate_size=int(get("expert_shared_feed_forward_length")),
            decoder_sparse_step=1,
            mlp_only_layers=[],
        )
    elif arch == "phi3":
        window = get("attention.sliding_window", None)
        config["sliding_window"] = int(window) if window else None
        long, short = (_tensor(reader, n) for n in _ROPE_FACTORS)
        if (long is None) != (short is None):
            raise GGUFError("LongRoPE needs both rope_factors_long and rope_factors_short")
        if long is not None and short is not None:
            original = int(get("rope.scaling.original_context_length"))
            config["original_max_position_embeddings"] = original
            config["rope_scaling"] = {
                "rope_type": "longrope",
                "long_factor": long.tolist(),
                "short_factor": short.tolist(),
            }
    elif arch == "gemma3":
        del config["hidden_act"]
        pattern = int(get("attention.sliding_window_pattern", _GEMMA3_PATTERN))
        full = {"rope_type": "default", "rope_theta": config.pop("rope_theta")}
        full.update(config.pop("rope_scaling", {}))
        config.update(
            hidden_activation="gelu_pytorch_tanh",
            sliding_window=int(get("attention.sliding_window")),
            layer_types=[
                "full_attention" if (i + 1) % pattern == 0 else "sliding_attention"
                for i in range(layers)
            ],
            rope_parameters={
                "full_attention": full,
                "sliding_attention": {"rope_type": "default", "rope_theta": _GEMMA3_LOCAL_THETA},
            },
            query_pre_attn_scalar=hidden // heads if layers == 62 else head_dim,
        )
    elif arch == "gpt-oss":
        del config["hidden_act"]
        config.update(
            model_type="gpt_oss",
            intermediate_size=int(get("expert_feed_forward_length")),
            num_local_experts=int(get("expert_count")),
            num_experts_per_tok=int(get("expert_used_count")),
            sliding_window=int(get("attention.sliding_window")),
            layer_types=[
                "sliding_attention" if i % 2 == 0 else "full_attention" for i in range(layers)
            ],
            attention_bias=True,
            swiglu_limit=7.0,
        )
    elif arch == "gemma2":
        del config["hidden_act"]
        window = get("attention.sliding_window", None)
        config.update(
            hidden_activation="gelu_pytorch_tanh",
            sliding_window=int(window) if window else None,
            layer_types=[
                "sliding_attention" if i % 2 == 0 else "full_attention" for i in range(layers)
            ],
            query_pre_attn_scalar=hidden // heads if layers == 46 else head_dim,
            attn_logit_softcapping=_cap(get("attn_logit_softcapping", None)),
            final_logit_softcapping=_cap(get("final_logit_softcapping", None)),
        )
    return config


def _cap(value: Any) -> float | None:
    """A soft-capping value from the metadata: None when absent or 0 (no capping)."""
    return float(value) if value else None


def hf_tensors(
    arch: str, name: str, data: np.ndarray, config: dict[str, Any]
) -> list[tuple[str, np.ndarray]]:
    """The HF tensors GGUF tensor ``name`` (dequantized, in HF's dimension order) holds,
    with llama.cpp's changes undone; GGUFError for a name the architecture lacks. Stacked
    experts become each expert's ``[out, in]`` rows (kvserve's layout; for gpt-oss not the
    stacked tensors HF's own checkpoint has)."""
    if name in _GLOBAL_NAMES:
        hf = _GLOBAL_NAMES[name]
        return [(hf, data - 1 if arch in _GEMMA_NORMS and name == "output_norm.weight" else data)]
    if name == "rope_freqs.weight":
        raise GGUFError("rope scaling factors (rope_freqs) are not supported")
    if arch == "phi3" and name in _ROPE_FACTORS:
        return []  # in the config's rope_scaling (hf_config)
    parts = name.split(".")
    if len(parts) != 4 or parts[0] != "blk" or parts[3] not in ("weight", "bias"):
        raise GGUFError(f"tensor {name!r} is not part of a {arch} model")
    layer, base, leaf = parts[1], parts[2], parts[3]
    prefix = f"model.layers.{layer}."
    if arch in ("qwen3moe", "qwen2moe", "gpt-oss") and base in _EXPERTS:
        return [
            (f"{prefix}mlp.experts.{e}.{_EXPERTS[base]}.{leaf}", np.ascontiguousarray(data[e]))
            for e in range(data.shape[0])
        ]
    names = {**_LAYER_NAMES, **_LAYER_NAMES_BY_ARCH.get(arch, {})}
    if base not in names:
        raise GGUFError(f"tensor {name!r} is not part of a {arch} model")
    if arch in _GEMMA_NORMS and base.endswith("norm"):
        data = data - 1  # stored as 1 + w
    elif base == "ffn_gate_inp_shexp":
        data = data.reshape(1, -1)  # one row: [1, hidden]
    elif arch == "llama" and base in ("attn_q", "attn_k") and leaf == "weight":
        heads = config["num_attention_heads" if base == "attn_q" else "num_key_value_heads"]
        data = unpermute(data, heads)
    elif base == "attn_sinks":
        return [(f"{prefix}{names[base]}", data)]  # a parameter of its own, no .weight
    return [(f"{prefix}{names[base]}.{leaf}", data)]


def unpermute(w: np.ndarray, heads: int) -> np.ndarray:
    """Undo llama.cpp's rotary reordering of Q/K rows (each head's pairs interleaved back
    into HF's two halves)."""
    rows = w.shape[0]
    return w.reshape(heads, rows // heads // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)
