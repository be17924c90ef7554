"""Read an HF ``config.json`` into a validated, architecture-neutral ``ModelSpec``.

Every refusal names the file and the field, so a user knows what to fix.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

SUPPORTED_ARCHITECTURES = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
    "Gemma2ForCausalLM": "gemma2",
    "Gemma3ForCausalLM": "gemma3",
    "Gemma3ForConditionalGeneration": "gemma3",  # its language model, served text-only
    "Qwen3MoeForCausalLM": "qwen3_moe",
    "Qwen2MoeForCausalLM": "qwen2_moe",
    "MixtralForCausalLM": "mixtral",
    "Phi3ForCausalLM": "phi3",
    "GptOssForCausalLM": "gpt_oss",
}
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3", "yarn", "longrope", "dynamic")
SUPPORTED_ACTIVATIONS = ("silu", "gelu_pytorch_tanh")
_LAYER_TYPES = ("full_attention", "sliding_attention")
# transformers' Gemma2Config and Gemma3TextConfig defaults: Hub configs (Gemma 3's
# multimodal text_config above all) leave out what equals them. Gemma 2 configs before
# layer_types slide every other layer, as transformers fills it in.
_GEMMA_COMMON: dict[str, Any] = {
    "hidden_size": 2304,
    "intermediate_size": 9216,
    "num_hidden_layers": 26,
    "num_attention_heads": 8,
    "num_key_value_heads": 4,
    "head_dim": 256,
    "hidden_activation": "gelu_pytorch_tanh",
    "rms_norm_eps": 1e-6,
    "bos_token_id": 2,
    "eos_token_id": 1,
    "tie_word_embeddings": True,
    "query_pre_attn_scalar": 256,
    "sliding_window": 4096,
}
_GEMMA_DEFAULTS: dict[str, dict[str, Any]] = {
    "gemma2": {
        **_GEMMA_COMMON,
        "vocab_size": 256000,
        "max_position_embeddings": 8192,
        "final_logit_softcapping": 30.0,
        "attn_logit_softcapping": 50.0,
    },
    "gemma3": {
        **_GEMMA_COMMON,
        "vocab_size": 262208,
        "max_position_embeddings": 131072,
        "rope_theta": 1_000_000.0,
        "rope_local_base_freq": 10_000.0,
    },
}
_GEMMA_FAMILIES = ("gemma2", "gemma3")


class ModelConfigError(ValueError):
    """A checkpoint's config cannot be honoured; the message names file and field."""


@dataclass(frozen=True)
class RopeSpec:
    """Rotary embedding parameters (HF ``rope_parameters`` / ``rope_scaling``)."""

    theta: float = 10000.0
    rope_type: str = "default"
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192
    # yarn: the ramp between interpolated and extrapolated frequencies (beta_fast/slow in
    # rotations, truncated to whole dims), and the cos/sin scale (None: from the factor,
    # mscale and mscale_all_dim)
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    truncate: bool = True
    mscale: float | None = None
    mscale_all_dim: float | None = None
    attention_factor: float | None = None
    # longrope: per-frequency divisors within the original context and beyond it
    short_factor: tuple[float, ...] = ()
    long_factor: tuple[float, ...] = ()


@dataclass(frozen=True)
class ModelSpec:
    """What the model code needs to know about an architecture instance."""

    architecture: str
    family: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    max_position_embeddings: int
    rope: RopeSpec
    tie_word_embeddings: bool
    attention_bias: bool
    o_proj_bias: bool
    mlp_bias: bool
    qk_norm: bool
    sliding_window: int | None
    torch_dtype: str | None
    bos_token_id: int | None
    eos_token_ids: tuple[int, ...]
    hidden_act: str = "silu"
    # per layer, the window its attention slides over (0: the whole context), when some
    # layers slide and others do not (Gemma 3, Qwen with max_window_layers); () when every
    # layer does as ``sliding_window`` says
    layer_windows: tuple[int, ...] = ()
    local_rope: RopeSpec | None = None  # the sliding layers' rotary parameters, if their own
    query_pre_attn_scalar: float | None = None  # queries scaled by its -1/2 power, not head_dim's
    final_logit_softcap: float | None = None  # logits = cap * tanh(logits / cap)
    attn_logit_softcap: float | None = None  # attention scores = cap * tanh(scores / cap)
    # Gemma's layer: (1 + w) RMSNorms, norms after attention and around the MLP, and
    # embeddings scaled by sqrt(hidden_size)
    gemma_norms: bool = False
    multimodal: bool = False  # a vision-language checkpoint served text-only (loader)
    # a mixture of experts (model/mlp.py: SparseMoE): experts per MoE layer, how many each
    # token is routed to, their intermediate size, whether the top-k weights are
    # renormalised; the layers that keep a dense MLP
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = True
    # Qwen2-MoE: one shared expert every token goes through, scaled by a sigmoid gate
    shared_expert_intermediate_size: int = 0
    dense_layers: tuple[int, ...] = ()
    # gpt-oss: a router with a bias whose top-k logits are softmaxed (not all of them),
    # experts with biases and a clamped SwiGLU (gate clamped above, up to ±limit,
    # gate·sigmoid(alpha·gate)·(up + 1)), and a learned sink logit per attention head
    router_bias: bool = False
    softmax_after_topk: bool = False
    swiglu_limit: float | None = None
    swiglu_alpha: float = 1.0
    attention_sinks: bool = False

    def is_moe_layer(self, layer: int) -> bool:
        """Layer ``layer``'s MLP is a routed mixture of experts."""
        return self.num_experts > 0 and layer not in self.dense_layers

    @property
    def fused_checkpoint(self) -> bool:
        """The checkpoint stores q/k/v and gate/up fused, as kvserve runs them (Phi-3)."""
        return self.family == "phi3"

    def layer_window(self, layer: int) -> int | None:
        """The sliding window of layer ``layer`` in tokens, or None when it sees everything."""
        if self.layer_windows:
            return self.layer_windows[layer] or None
        return self.sliding_window

    @property
    def hybrid(self) -> bool:
        """Some layers slide over a window and others attend to the whole context."""
        return bool(self.layer_windows)

    @property
    def attention_scale(self) -> float:
        return (self.query_pre_attn_scalar or self.head_dim) ** -0.5


def _get(cfg: dict[str, Any], key: str, path: Path, default: Any = ..., kind: type = int) -> Any:
    if key not in cfg or cfg[key] is None:
        if default is ...:
            raise ModelConfigError(f"{path}: required field {key!r} is missing")
        return default
    value = cfg[key]
    if kind is float and isinstance(value, int):
        value = float(value)
    if not isinstance(value, kind) or (isinstance(value, bool) and kind is int):
        raise ModelConfigError(
            f"{path}: field {key!r} must be {kind.__name__}, got {type(value).__name__} {value!r}"
        )
    return value


def _rope(cfg: dict[str, Any], path: Path) -> RopeSpec:
    params = cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}
    field_name = "rope_parameters" if cfg.get("rope_parameters") else "rope_scaling"
    if "full_attention" in params:  # per layer type (Gemma 3): the global layers' here
        params, field_name = params["full_attention"] or {}, f"{field_name}.full_attention"
    return _rope_params(cfg, params, field_name, path, cfg.get("rope_theta", 10000.0))


def _local_rope(cfg: dict[str, Any], path: Path) -> RopeSpec | None:
    """Gemma 3's sliding layers' rotary parameters: ``rope_parameters.sliding_attention``,
    or ``rope_local_base_freq`` in configs written before per-type parameters."""
    params = cfg.get("rope_parameters") or {}
    if "sliding_attention" in params:
        field_name = "rope_parameters.sliding_attention"
        return _rope_params(cfg, params["sliding_attention"] or {}, field_name, path, 10000.0)
    theta = cfg.get("rope_local_base_freq", 10000.0)
    return _rope_params(cfg, {}, "rope_local_base_freq", path, theta)


def _rope_params(
    cfg: dict[str, Any], params: dict[str, Any], field_name: str, path: Path, theta_default: float
) -> RopeSpec:
    theta = params.get("rope_theta", theta_default)
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise ModelConfigError(
            f"{path}: field {field_name}.rope_type={rope_type!r} is not supported "
            f"(supported: {', '.join(SUPPORTED_ROPE_TYPES)})"
        )
    if cfg.get("partial_rotary_factor", 1.0) != 1.0:
        raise ModelConfigError(f"{path}: field 'partial_rotary_factor' != 1.0 is not supported")
    max_pos = cfg.get("max_position_embeddings", 8192)
    original = params.get("original_max_position_embeddings")
    original = int(original or cfg.get("original_max_position_embeddings") or max_pos)
    if rope_type == "dynamic":  # transformers scales past the config's own length
        original = int(max_pos)
    factor = params.get("factor")
    if factor is None:  # yarn and longrope: the ratio of the contexts
        factor = max_pos / original if rope_type in ("yarn", "longrope") else 1.0

    def optional(key: str) -> float | None:
        value = params.get(key)
        return None if value is None else float(value)

    short, long = tuple(params.get("short_factor") or ()), tuple(params.get("long_factor") or ())
    if rope_type == "longrope" and (not short or len(short) != len(long)):
        raise ModelConfigError(
            f"{path}: field {field_name} needs 'short_factor' and 'long_factor' of one length"
        )
    return RopeSpec(
        theta=float(theta),
        rope_type=rope_type,
        factor=float(factor),
        low_freq_factor=float(params.get("low_freq_factor", 1.0)),
        high_freq_factor=float(params.get("high_freq_factor", 4.0)),
        original_max_position_embeddings=original,
        beta_fast=float(params.get("beta_fast") or 32.0),
        beta_slow=float(params.get("beta_slow") or 1.0),
        truncate=bool(params.get("truncate", True)),
        mscale=optional("mscale"),
        mscale_all_dim=optional("mscale_all_dim"),
        attention_factor=optional("attention_factor"),
        short_factor=tuple(float(x) for x in short),
        long_factor=tuple(float(x) for x in long),
    )


def _windows(cfg: dict[str, Any], family: str, path: Path) -> tuple[int | None, tuple[int, ...]]:
    """``(sliding_window, layer_windows)``: one window for every layer (or None), or a
    window per layer (0: full attention) when only some layers slide."""
    if family in ("mistral", "mixtral", "phi3"):
        window = cfg.get("sliding_window")
        return (int(window) if window else None), ()
    if family == "llama":
        if cfg.get("sliding_window"):
            raise ModelConfigError(f"{path}: field 'sliding_window' is not supported for Llama")
        return None, ()
    n = _get(cfg, "num_hidden_layers", path)
    window = cfg.get("sliding_window")
    if family in ("qwen2", "qwen2_moe", "qwen3", "qwen3_moe") and not cfg.get("use_sliding_window"):
        window = None  # as transformers reads these configs: the field is a default
    types = cfg.get("layer_types")
    if types is None and family in (*_GEMMA_FAMILIES, "gpt_oss"):
        pattern = _get(cfg, "sliding_window_pattern", path, 6 if family == "gemma3" else 2)
        types = [
            "full_attention" if (i + 1) % pattern == 0 else "sliding_attention" for i in range(n)
        ]
    elif types is None:
        first = _get(cfg, "max_window_layers", path, n)
        types = [
            "sliding_attention" if window and i >= first else "full_attention" for i in range(n)
        ]
    if not isinstance(types, list) or len(types) != n or any(t not in _LAYER_TYPES for t in types):
        raise ModelConfigError(
            f"{path}: field 'layer_types' must list {n} of {_LAYER_TYPES}, got {types!r}"
        )
    sliding = [t == "sliding_attention" for t in types]
    if not any(sliding) or (window is None and family != "gemma3"):
        return None, ()  # transformers: a sliding layer without a window sees everything
    if not isinstance(window, int) or isinstance(window, bool) or window <= 0:
        raise ModelConfigError(
            f"{path}: field 'sliding_window'={window!r} must be a positive int "
            "for the layers 'layer_types' makes sliding"
        )
    if all(sliding):
        return window, ()
    return None, tuple(window if s else 0 for s in sliding)


def load_model_spec(model_dir: str | Path) -> ModelSpec:
    """Parse ``model_dir/config.json``; raise ``ModelConfigError`` for what we can't honour."""
    path = Path(model_dir) / "config.json"
    if not path.is_file():
        raise ModelConfigError(f"{path}: not found (is {model_dir!s} an HF model directory?)")
    try:
        cfg = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise ModelConfigError(f"{path}: invalid JSON ({e})") from None
    archs = cfg.get("architectures") or []
    arch = next((a for a in archs if a in SUPPORTED_ARCHITECTURES), None)
    if arch is None:
        raise ModelConfigError(
            f"{path}: field 'architectures'={archs!r} names no supported architecture "
            f"(supported: {', '.join(SUPPORTED_ARCHITECTURES)})"
        )
    family = SUPPORTED_ARCHITECTURES[arch]
    multimodal = arch == "Gemma3ForConditionalGeneration"
    if multimodal:  # the language model's config, with the ids and dtype of the whole
        text = cfg.get("text_config")
        if not isinstance(text, dict):
            raise ModelConfigError(f"{path}: field 'text_config' must be an object")
        top = {k: cfg.get(k) for k in ("bos_token_id", "eos_token_id", "dtype", "torch_dtype")}
        cfg = {**text, **{k: v for k, v in top.items() if v is not None}}
    gemma = family in _GEMMA_FAMILIES
    if gemma:
        cfg = {**_GEMMA_DEFAULTS[family], **cfg}
    act_field = "hidden_activation" if gemma else "hidden_act"
    act = cfg.get(act_field) or ("gelu_pytorch_tanh" if gemma else "silu")
    if act not in SUPPORTED_ACTIVATIONS:
        raise ModelConfigError(
            f"{path}: field {act_field!r}={act!r} is not supported "
            f"(supported: {', '.join(SUPPORTED_ACTIVATIONS)})"
        )
    if cfg.get("use_bidirectional_attention"):
        raise ModelConfigError(
            f"{path}: field 'use_bidirectional_attention'="
            f"{cfg['use_bidirectional_attention']!r} is not supported"
        )
    if cfg.get("attn_logit_softcapping") and not gemma:
        raise ModelConfigError(
            f"{path}: field 'attn_logit_softcapping' is not read for {arch} (Gemma 2 and 3 only)"
        )
    window, layer_windows = _windows(cfg, family, path)
    hidden = _get(cfg, "hidden_size", path)
    heads = _get(cfg, "num_attention_heads", path)
    kv_heads = _get(cfg, "num_key_value_heads", path, heads)
    if heads % kv_heads:
        raise ModelConfigError(
            f"{path}: field 'num_key_value_heads'={kv_heads} must divide "
            f"'num_attention_heads'={heads}"
        )
    head_dim = _get(cfg, "head_dim", path, None)
    if head_dim is None:
        if hidden % heads:
            raise ModelConfigError(
                f"{path}: field 'hidden_size'={hidden} is not a multiple of "
                f"'num_attention_heads'={heads} and 'head_dim' is not given"
            )
        head_dim = hidden // heads
    if head_dim % 2:
        raise ModelConfigError(f"{path}: field 'head_dim'={head_dim} must be even for rotary")
    eos = cfg.get("eos_token_id")
    eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (int(eos),))
    qwen2 = family in ("qwen2", "qwen2_moe")  # q/k/v biases, none on o_proj
    attention_bias = family == "qwen2" or bool(cfg.get("attention_bias", family == "gpt_oss"))
    if family == "qwen2_moe":
        attention_bias = bool(cfg.get("qkv_bias", True))
    return ModelSpec(
        architecture=arch,
        family=family,
        vocab_size=_get(cfg, "vocab_size", path),
        hidden_size=hidden,
        intermediate_size=_get(cfg, "intermediate_size", path),
        num_layers=_get(cfg, "num_hidden_layers", path),
        num_heads=heads,
        num_kv_heads=kv_heads,
        head_dim=head_dim,
        rms_norm_eps=_get(cfg, "rms_norm_eps", path, 1e-6, float),
        max_position_embeddings=_get(cfg, "max_position_embeddings", path, 2048),
        rope=_rope(cfg, path),
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", gemma)),
        attention_bias=attention_bias,
        o_proj_bias=not qwen2 and attention_bias,
        mlp_bias=family == "gpt_oss" or bool(cfg.get("mlp_bias", False)),
        qk_norm=family in ("qwen3", "qwen3_moe", "gemma3"),
        sliding_window=window,
        torch_dtype=cfg.get("dtype") or cfg.get("torch_dtype"),
        bos_token_id=cfg.get("bos_token_id"),
        eos_token_ids=eos_ids,
        hidden_act=act,
        layer_windows=layer_windows,
        local_rope=_local_rope(cfg, path) if family == "gemma3" else None,
        query_pre_attn_scalar=(
            float(_get(cfg, "query_pre_attn_scalar", path, 256, float)) if gemma else None
        ),
        final_logit_softcap=(
            _get(cfg, "final_logit_softcapping", path, None, float) if gemma else None
        ),
        attn_logit_softcap=(
            _get(cfg, "attn_logit_softcapping", path, None, float) if gemma else None
        ),
        gemma_norms=gemma,
        multimodal=multimodal,
        **_moe(cfg, family, path),
    )


def _moe(cfg: dict[str, Any], family: str, path: Path) -> dict[str, Any]:
    """``ModelSpec``'s mixture-of-experts fields for ``family`` (none for dense ones)."""
    if family not in ("qwen3_moe", "qwen2_moe", "mixtral", "gpt_oss"):
        return {}
    key = "num_local_experts" if "num_local_experts" in cfg else "num_experts"
    experts = _get(cfg, key, path)
    top_k = _get(cfg, "num_experts_per_tok", path)
    if not 0 < top_k <= experts:
        raise ModelConfigError(
            f"{path}: field 'num_experts_per_tok'={top_k} must be in 1..{key}={experts}"
        )
    n = _get(cfg, "num_hidden_layers", path)
    if family in ("mixtral", "gpt_oss"):
        inter, norm, dense = _get(cfg, "intermediate_size", path), True, ()
    else:
        inter = _get(cfg, "moe_intermediate_size", path)
        norm = bool(cfg.get("norm_topk_prob", False))
        step = _get(cfg, "decoder_sparse_step", path, 1)
        only = cfg.get("mlp_only_layers") or []
        if step < 1 or not isinstance(only, list):
            raise ModelConfigError(
                f"{path}: fields 'decoder_sparse_step'={step!r} (>= 1) and "
                f"'mlp_only_layers'={only!r} (a list) do not say which layers are MoE"
            )
        dense = tuple(i for i in range(n) if i in only or (i + 1) % step)
    return {
        "num_experts": experts,
        "num_experts_per_tok": top_k,
        "moe_intermediate_size": inter,
        "norm_topk_prob": norm,
        "dense_layers": dense,
        "shared_expert_intermediate_size": (
            _get(cfg, "shared_expert_intermediate_size", path) if family == "qwen2_moe" else 0
        ),
        **(_gpt_oss(cfg, path) if family == "gpt_oss" else {}),
    }


def _gpt_oss(cfg: dict[str, Any], path: Path) -> dict[str, Any]:
    """gpt-oss's fields of ``ModelSpec`` (transformers' ``GptOssConfig`` defaults)."""
    limit = _get(cfg, "swiglu_limit", path, 7.0, float)
    if limit <= 0:
        raise ModelConfigError(f"{path}: field 'swiglu_limit'={limit} must be > 0")
    return {
        "router_bias": True,
        "softmax_after_topk": True,
        "swiglu_limit": limit,
        "swiglu_alpha": _get(cfg, "swiglu_alpha", path, 1.702, float),
        "attention_sinks": True,
    }
