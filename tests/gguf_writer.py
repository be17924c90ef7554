"""Write an HF test checkpoint as a GGUF file the way llama.cpp's converter does, with the
``gguf`` package's writer: its metadata keys, its tensor names (``gguf``'s own name map),
and its changes to the values (Q/K rows permuted for ``llama``, Gemma's norms stored as
``1 + w``, a MoE layer's experts stacked per projection; gpt-oss's interleaved gate/up
columns split and its experts optionally MXFP4). The tokenizer is the checkpoint's
byte-level BPE, written as ``gpt2`` with the pre-tokenizer name given. And the reference
reading of such a file: transformers' own GGUF loading (``transformers_from_gguf``).
"""

from __future__ import annotations

import json
from pathlib import Path

import gguf
import numpy as np
from safetensors.torch import load_file

from kvserve.model.kquants import quantize

_NORM_OFFSET_ARCHS = ("gemma2", "gemma3")


def _permute(w: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's ``LlamaModel.permute``: each head's halves interleaved in pairs."""
    return (
        w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)
    )


def _metadata(w: gguf.GGUFWriter, arch: str, cfg: dict) -> None:
    heads = cfg["num_attention_heads"]
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // heads
    w.add_block_count(cfg["num_hidden_layers"])
    w.add_context_length(cfg["max_position_embeddings"])
    w.add_embedding_length(cfg["hidden_size"])
    w.add_feed_forward_length(cfg["intermediate_size"])
    w.add_head_count(heads)
    w.add_head_count_kv(cfg.get("num_key_value_heads", heads))
    w.add_key_length(head_dim)
    w.add_value_length(head_dim)
    w.add_rope_dimension_count(head_dim)
    w.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    rope = cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}  # transformers 5, 4
    rope = rope.get("full_attention", rope)
    w.add_rope_freq_base(float(rope.get("rope_theta", cfg.get("rope_theta", 10000.0))))
    if arch in ("qwen3moe", "qwen2moe"):
        w.add_expert_count(cfg.get("num_experts", cfg.get("num_local_experts")))
        w.add_expert_used_count(cfg["num_experts_per_tok"])
        w.add_expert_feed_forward_length(cfg["moe_intermediate_size"])
    if arch == "gpt-oss":  # convert_hf_to_gguf's GptOssModel
        w.add_expert_count(cfg["num_local_experts"])
        w.add_expert_used_count(cfg["num_experts_per_tok"])
        w.add_expert_feed_forward_length(cfg["intermediate_size"])
        w.add_sliding_window(cfg["sliding_window"])
    if rope.get("rope_type") == "yarn":  # TextModel's YaRN keys
        w.add_rope_scaling_type(gguf.RopeScalingType.YARN)
        w.add_rope_scaling_factor(rope["factor"])
        w.add_rope_scaling_orig_ctx_len(rope["original_max_position_embeddings"])
        w.add_rope_scaling_yarn_beta_fast(float(rope.get("beta_fast", 32.0)))
        w.add_rope_scaling_yarn_beta_slow(float(rope.get("beta_slow", 1.0)))
    if arch == "qwen2moe":
        w.add_expert_shared_feed_forward_length(cfg["shared_expert_intermediate_size"])
    if arch in ("gemma2", "gemma3") or (arch == "phi3" and cfg.get("sliding_window")):
        w.add_sliding_window(cfg["sliding_window"])
    if arch == "gemma2":  # llama.cpp writes both; transformers' GGUF loading reads neither
        w.add_attn_logit_softcapping(cfg["attn_logit_softcapping"])
        w.add_final_logit_softcapping(cfg["final_logit_softcapping"])
    if arch == "phi3" and _longrope(cfg):  # LongRoPE: factors are tensors (_tensors)
        w.add_rope_scaling_orig_ctx_len(cfg["original_max_position_embeddings"])


def _longrope(cfg: dict) -> dict:
    """The config's LongRoPE parameters (transformers 5 saves them as rope_parameters)."""
    rope = cfg.get("rope_scaling") or cfg.get("rope_parameters") or {}
    return rope if rope.get("rope_type", rope.get("type")) == "longrope" else {}


def _tokenizer(w: gguf.GGUFWriter, model_dir: Path, cfg: dict, pre: str) -> None:
    data = json.loads((model_dir / "tokenizer.json").read_text())
    vocab = data["model"]["vocab"]
    tokens = [""] * len(vocab)
    for token, i in vocab.items():
        tokens[i] = token
    types = [gguf.TokenType.NORMAL] * len(tokens)
    for added in data["added_tokens"]:
        tokens[added["id"]] = added["content"]
        types[added["id"]] = (
            gguf.TokenType.CONTROL if added["special"] else gguf.TokenType.USER_DEFINED
        )
    merges = [m if isinstance(m, str) else " ".join(m) for m in data["model"]["merges"]]
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre(pre)
    w.add_token_list(tokens)
    w.add_token_types(types)
    w.add_token_merges(merges)
    w.add_bos_token_id(cfg["bos_token_id"])
    w.add_eos_token_id(cfg["eos_token_id"])
    if cfg.get("pad_token_id") is not None:  # else transformers takes its config default
        w.add_pad_token_id(cfg["pad_token_id"])
    w.add_add_bos_token(False)


def _tensors(arch: str, cfg: dict, model_dir: Path) -> dict[str, np.ndarray]:
    """HF tensors → GGUF name → float32 array, with llama.cpp's changes applied."""
    hf = {k: v.float().numpy() for k, v in load_file(str(model_dir / "model.safetensors")).items()}
    n = cfg["num_hidden_layers"]
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH[arch.upper().replace("-", "_")], n)
    out: dict[str, np.ndarray] = {}
    experts: dict[str, list[tuple[int, np.ndarray]]] = {}
    for name, value in sorted(hf.items()):
        if arch == "gpt-oss" and (".mlp.experts." in name or name.endswith(".sinks")):
            out.update(_gpt_oss(name, value, names))
            continue
        base, _, leaf = name.rpartition(".")
        if ".mlp.experts." in base:  # model.layers.N.mlp.experts.E.gate_proj
            head, e, proj = base.rsplit(".", 2)
            experts.setdefault(f"{head}.{proj}", []).append((int(e), value))
            continue
        gname = names.get_name(base)
        assert gname is not None, name
        if arch in _NORM_OFFSET_ARCHS and base.endswith("norm"):
            value = value + 1
        if base.endswith("shared_expert_gate"):
            value = value.reshape(-1)  # llama.cpp stores the shared expert's gate as 1-D
        if arch == "llama" and leaf == "weight" and base.endswith(("q_proj", "k_proj")):
            kv = "k_proj" in base
            value = _permute(value, cfg["num_key_value_heads" if kv else "num_attention_heads"])
        out[f"{gname}.{leaf}"] = value
    for key, parts in experts.items():
        gname = names.get_name(key)
        assert gname is not None, key
        out[f"{gname}.weight"] = np.stack([v for _, v in sorted(parts, key=lambda p: p[0])])
    rope = _longrope(cfg)
    if arch == "phi3" and rope:
        for kind in ("long", "short"):
            out[f"rope_factors_{kind}.weight"] = np.asarray(rope[f"{kind}_factor"], np.float32)
    return out


def _gpt_oss(name: str, value: np.ndarray, names: gguf.TensorNameMap) -> dict[str, np.ndarray]:
    """A gpt-oss tensor as llama.cpp's converter writes it: a sink logit per head as
    ``attn_sinks.weight``; the stacked experts ``[experts, in, out]`` as ``[experts, out,
    in]``, gate/up's interleaved columns (and bias entries) split into two tensors."""
    if name.endswith(".sinks"):
        return {f"{names.get_name(name)}.weight": value}
    head, _, stacked = name.rpartition(".")  # model.layers.N.mlp.experts, gate_up_proj…
    leaf = "bias" if stacked.endswith("_bias") else "weight"
    if leaf == "weight":
        value = value.swapaxes(1, 2)  # [experts, out, in]
    parts = {"down_proj": value}
    if stacked.startswith("gate_up"):
        parts = {"gate_proj": value[:, 0::2], "up_proj": value[:, 1::2]}
    return {f"{names.get_name(f'{head}.{p}')}.{leaf}": v for p, v in parts.items()}


def write_gguf(
    model_dir: Path,
    path: Path,
    arch: str,
    quant: gguf.GGMLQuantizationType = gguf.GGMLQuantizationType.F32,
    pre: str = "default",
    overrides: dict[str, gguf.GGMLQuantizationType] | None = None,
) -> Path:
    """``model_dir`` (an HF checkpoint of ``arch``'s family) as GGUF file ``path``; weight
    matrices whose rows suit ``quant`` stored in it, the rest float32. ``overrides``: a
    type per tensor kind (``attn_v``, ``ffn_down``, ``token_embd`` …) instead of
    ``quant``, as llama.cpp's mixes (Q4_K_M) do."""
    cfg = json.loads((model_dir / "config.json").read_text())
    w = gguf.GGUFWriter(str(path), arch)
    _metadata(w, arch, cfg)
    _tokenizer(w, model_dir, cfg, pre)
    for name, value in _tensors(arch, cfg, model_dir).items():
        value = np.ascontiguousarray(value, dtype=np.float32)
        kind = name.split(".")[-2]
        qt = (overrides or {}).get(kind, quant)
        if (
            qt != gguf.GGMLQuantizationType.F32
            and name.endswith(".weight")  # biases stay float32, as llama.cpp keeps them
            and value.ndim >= 2
            and value.shape[-1] % gguf.GGML_QUANT_SIZES[qt][0] == 0
        ):
            if qt == gguf.GGMLQuantizationType.MXFP4:  # the gguf package's own quantizer
                w.add_tensor(name, gguf.quants.quantize(value, qt), raw_dtype=qt)
            else:
                w.add_tensor(name, quantize(value, qt.name), raw_dtype=qt)
        else:
            w.add_tensor(name, value)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def transformers_from_gguf(path: Path):
    """``(tokenizer, model)`` as HF transformers loads GGUF file ``path`` (float32)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    kw = dict(gguf_file=path.name)
    tok = AutoTokenizer.from_pretrained(path.parent, **kw)
    model = AutoModelForCausalLM.from_pretrained(path.parent, dtype=torch.float32, **kw)
    return tok, model.eval()
