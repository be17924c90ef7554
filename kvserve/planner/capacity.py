"""Model-based capacity plan: weights, KV per token/request, concurrency per GPU.

KV bytes per token come from ``KVCacheSpec`` — the same object the engine allocates its
cache with — so the planner and the engine cannot drift apart.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path

from kvserve.model.kv_cache import KVCacheSpec
from kvserve.model.kv_groups import KVGroups
from kvserve.model.kv_quant import kv_format
from kvserve.model.parallel import kv_heads_per_rank
from kvserve.model.spec import load_model_spec
from kvserve.planner import weights
from kvserve.planner.hardware import find_accelerator
from kvserve.planner.presets import PRESETS, ModelShape
from kvserve.utils import cdiv, format_size, parse_dtype, parse_size


@dataclass(frozen=True)
class PlanInput:
    """One configuration to plan (CLI flags of ``kvserve plan`` map onto it)."""

    model: str
    dtype: str = "bfloat16"
    kv_cache_dtype: str = "auto"
    concurrency: int = 1
    context: int = 4096
    output_len: int = 0
    gpu: str = "H100-80GB"
    gpu_memory: int | None = None
    gpu_memory_utilization: float = 0.9
    overhead: int = 1024**3
    tp: int = 1
    block_size: int = 16
    kv_cache_scales: str = "auto"  # fp8: as the engine's flag; auto = token for a shape
    kv_layout: str = "auto"  # as the engine's flag: hybrid for sliding + global layers
    quantization: str = "none"  # auto / int8: weights at their CPU-served size (weights.py)


@dataclass(frozen=True)
class Plan:
    """The numbers of a plan, in bytes unless named otherwise."""

    label: str
    model: str
    weight_bytes: int
    kv_bytes_per_token: int
    tokens_per_request: int
    kv_bytes_per_request: int
    kv_bytes_total: int
    kv_bytes_per_gpu_available: int
    max_concurrency_per_replica: int
    gpus_needed: int | None  # None: the model does not fit on the GPUs of one replica
    gpu: str = ""  # the assumed GPU and its memory
    concurrency: int = 1
    fit_note: str | None = None  # with gpus_needed None: why, and the --tp that would fit
    kv_layout: str = "uniform"  # or "hybrid (…groups…)": kv_bytes_per_token is an average


def resolve_shape(model: str) -> ModelShape:
    """A preset name, an HF model directory or a ``config.json`` path → ModelShape."""
    if model.lower() in PRESETS:
        return PRESETS[model.lower()]
    path = Path(model)
    if path.name == "config.json":
        path = path.parent
    if not (path / "config.json").is_file():
        raise ValueError(
            f"{model!r} is neither a preset ({', '.join(sorted(PRESETS))}) nor a model "
            "directory / config.json"
        )
    s = load_model_spec(path)
    attention = (
        s.hidden_size * (s.num_heads + 2 * s.num_kv_heads) * s.head_dim
        + s.num_heads * s.head_dim * s.hidden_size
        + 2 * s.hidden_size
    )
    dense_mlp = 3 * s.hidden_size * s.intermediate_size
    moe_mlp = s.num_experts * (3 * s.hidden_size * s.moe_intermediate_size + s.hidden_size)
    if s.shared_expert_intermediate_size:  # Qwen2-MoE: the shared expert and its gate
        moe_mlp += 3 * s.hidden_size * s.shared_expert_intermediate_size + s.hidden_size
    mlps = sum(moe_mlp if s.is_moe_layer(i) else dense_mlp for i in range(s.num_layers))
    embed = s.vocab_size * s.hidden_size * (1 if s.tie_word_embeddings else 2)
    params = s.num_layers * attention + mlps + embed + s.hidden_size
    return ModelShape(
        path.name,
        s.num_layers,
        s.hidden_size,
        s.num_heads,
        s.num_kv_heads,
        s.head_dim,
        params,
        s.sliding_window,
        s.layer_windows,
    )


def kv_spec_for(shape: ModelShape, p: PlanInput, per_rank: bool = False) -> KVCacheSpec:
    """The engine's KV spec for this shape and ``--kv-cache-dtype`` (int8 scales included);
    with ``per_rank``, of the fullest tensor-parallel rank's KV heads (replicated ones
    counted on every rank holding them), which is what the engine sizes its pool by."""
    fmt = kv_format(p.kv_cache_dtype, parse_dtype(p.dtype), p.kv_cache_scales)
    heads = kv_heads_per_rank(shape.num_kv_heads, p.tp) if per_rank else shape.num_kv_heads
    groups = None
    if shape.layer_windows and p.kv_layout != "uniform":
        groups = KVGroups.for_layer_windows(shape.layer_windows)
    return KVCacheSpec.for_format(
        shape.num_layers, heads, shape.head_dim, fmt, p.block_size, groups=groups
    )


def _request_bytes(spec: KVCacheSpec, tokens: int) -> int:
    """KV bytes one request of ``tokens`` (whole blocks) holds: every layer's, or in the
    hybrid layout the global groups' every block and the sliding groups' windows."""
    if spec.groups is None:
        return tokens * spec.bytes_per_token
    return spec.groups.blocks_held(tokens, spec.block_size) * spec.bytes_per_block


def _layout(spec: KVCacheSpec) -> str:
    return "uniform" if spec.groups is None else spec.groups.describe()


def plan(p: PlanInput, label: str = "") -> Plan:
    """Compute one plan. Raises ValueError for inputs that make no sense."""
    if p.concurrency < 1 or p.context < 1 or p.tp < 1 or p.output_len < 0:
        raise ValueError("concurrency, context and tp must be positive; output_len >= 0")
    shape = resolve_shape(p.model)
    spec = kv_spec_for(shape, p)
    tokens = p.context + p.output_len
    if shape.sliding_window:
        tokens = min(tokens, shape.sliding_window + p.block_size)  # window + partial block
    tokens = cdiv(tokens, p.block_size) * p.block_size  # paged: whole blocks
    per_request = _request_bytes(spec, tokens)
    weight_bytes = weights.weight_bytes(p.model, shape.num_params, p.dtype, p.quantization)
    gpu_mem = p.gpu_memory or find_accelerator(p.gpu).memory_bytes
    usable = int(gpu_mem * p.gpu_memory_utilization) - p.overhead  # weights + KV
    per_gpu = usable - weight_bytes // p.tp
    per_request_gpu = _request_bytes(kv_spec_for(shape, p, per_rank=True), tokens)
    max_conc = max(0, per_gpu // per_request_gpu)
    gpus = cdiv(p.concurrency, max_conc) * p.tp if max_conc > 0 else None
    note = None
    if gpus is None:
        note = (
            f"per GPU, weights {format_size(weight_bytes // p.tp)} + one request's KV "
            f"{format_size(per_request_gpu)} exceed the usable "
            f"{format_size(max(usable, 0))}"
        )
        fit = _smallest_tp(weight_bytes, per_request, usable, p.tp)
        note += f"; try --tp {fit}" if fit else "; no tensor-parallel size up to 64 fits"
    gpu_name = p.gpu if p.gpu_memory is None else "custom"
    return Plan(
        label=label or p.model,
        model=shape.name,
        weight_bytes=weight_bytes,
        kv_bytes_per_token=per_request // tokens,
        tokens_per_request=tokens,
        kv_bytes_per_request=per_request,
        kv_bytes_total=per_request * p.concurrency,
        kv_bytes_per_gpu_available=max(per_gpu, 0),
        max_concurrency_per_replica=max_conc,
        gpus_needed=gpus,
        gpu=f"{gpu_name} ({format_size(gpu_mem)} x {p.gpu_memory_utilization:g})",
        concurrency=p.concurrency,
        fit_note=note,
        kv_layout=_layout(spec),
    )


def _smallest_tp(weights: int, per_request: int, usable: int, tp: int) -> int | None:
    """The smallest power-of-two tensor-parallel size above ``tp`` whose GPUs hold the
    weights' shards and one request's KV, or None up to 64."""
    n = tp * 2
    while n <= 64:
        if (usable - weights // n) * n >= per_request:
            return n
        n *= 2
    return None


def variant(base: PlanInput, spec: str) -> PlanInput:
    """``base`` with ``key=value[,key=value]`` overrides (``kv_cache_dtype=fp8_e4m3``)."""
    changes: dict[str, object] = {}
    fields = {f.name: f for f in dataclasses.fields(PlanInput)}
    for part in spec.split(","):
        key, sep, value = part.partition("=")
        key = key.strip().replace("-", "_")
        if not sep or key not in fields:
            raise ValueError(f"--compare {spec!r}: use key=value with keys {', '.join(fields)}")
        current = getattr(base, key)
        if key in ("gpu_memory", "overhead"):
            changes[key] = parse_size(value)
        else:
            changes[key] = type(current)(value)
    return dataclasses.replace(base, **changes)
