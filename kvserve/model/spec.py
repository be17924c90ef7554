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
}
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")


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
    theta = params.get("rope_theta", cfg.get("rope_theta", 10000.0))
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise ModelConfigError(
            f"{path}: field {field_name}.rope_type={rope_type!r} is not supported "
            f"(supported: {', '.join(SUPPORTED_ROPE_TYPES)})"
        )
    if cfg.get("partial_rotary_factor", 1.0) != 1.0:
        raise ModelConfigError(f"{path}: field 'partial_rotary_factor' != 1.0 is not supported")
    return RopeSpec(
        theta=float(theta),
        rope_type=rope_type,
        factor=float(params.get("factor", 1.0)),
        low_freq_factor=float(params.get("low_freq_factor", 1.0)),
        high_freq_factor=float(params.get("high_freq_factor", 4.0)),
        original_max_position_embeddings=int(
            params.get("original_max_position_embeddings", cfg.get("max_position_embeddings", 8192))
        ),
    )


def _sliding_window(cfg: dict[str, Any], family: str, path: Path) -> int | None:
    if family == "mistral":
        window = cfg.get("sliding_window")
        return int(window) if window else None
    if family in ("qwen2", "qwen3") and cfg.get("use_sliding_window"):
        raise ModelConfigError(
            f"{path}: field 'use_sliding_window'=true (per-layer windows) is not supported yet"
        )
    if family == "llama" and cfg.get("sliding_window"):
        raise ModelConfigError(f"{path}: field 'sliding_window' is not supported for Llama")
    return None


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
    act = cfg.get("hidden_act", "silu")
    if act != "silu":
        raise ModelConfigError(f"{path}: field 'hidden_act'={act!r} is not supported (silu only)")
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
    attention_bias = family == "qwen2" or bool(cfg.get("attention_bias", False))
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
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        attention_bias=attention_bias,
        o_proj_bias=family in ("llama", "mistral", "qwen3") and attention_bias,
        mlp_bias=bool(cfg.get("mlp_bias", False)),
        qk_norm=family == "qwen3",
        sliding_window=_sliding_window(cfg, family, path),
        torch_dtype=cfg.get("dtype") or cfg.get("torch_dtype"),
        bos_token_id=cfg.get("bos_token_id"),
        eos_token_ids=eos_ids,
    )
