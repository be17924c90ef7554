"""A rank's model and KV tensors: kernels, weights (its shard), KV format and capacity.

``ShardBuilder`` is what the engine builds in-process without tensor parallelism and what
each tensor-parallel worker builds for itself (with its ``TPGroup``): the choice of
attention backend and element-wise ops, the model (prepacked for oneDNN where that has
native kernels), the KV spec of this rank's KV heads, how many blocks fit
(``num_blocks``: ``kv_cache_memory``, or on CUDA a profiling pass, or the CPU default) and
the cache tensors themselves (``allocate``). Raises ``EngineError`` naming the flag to
change for what cannot run.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from kvserve.config import CacheConfig, ModelConfig
from kvserve.errors import EngineError
from kvserve.model.attention import (
    CPU_KERNEL_HEAD_DIMS,
    CpuPagedAttention,
    TorchPagedAttention,
)
from kvserve.model.cpu_kernels import load_cpu_kernels
from kvserve.model.fused_stack import FusedStack
from kvserve.model.kv_cache import TILE, KVCacheSpec
from kvserve.model.kv_groups import KVGroups
from kvserve.model.kv_quant import KVFormat, kv_format
from kvserve.model.kv_smoothing import key_means
from kvserve.model.linear import prepack_linears
from kvserve.model.llama import LlamaForCausalLM
from kvserve.model.loader import load_kv_scales, load_model
from kvserve.model.mlp import use_expert_kernels
from kvserve.model.ops import CpuKernelOps, TorchOps
from kvserve.model.parallel import ShardPlan, TPGroup
from kvserve.model.quantized import quantized_on_huge_pages, weight_bytes
from kvserve.model.spec import ModelSpec
from kvserve.model.triton_backend import TritonPagedAttention, triton_unusable
from kvserve.utils import cdiv, format_size
from kvserve.worker.cuda_graphs import CudaCapture, DecodeGraphs, capture_sizes
from kvserve.worker.gpu_memory import measure_cuda

logger = logging.getLogger("kvserve")

_CPU_DEFAULT_KV_MEMORY = 4 * 1024**3  # at most, without --kv-cache-memory
_CPU_DEFAULT_KV_SEQS = 32  # …and no more than this many sequences of max_model_len need


@dataclass(frozen=True)
class ShardInputs:
    """What a rank needs to know to build its part (plain data: sent to worker processes)."""

    model_config: ModelConfig
    cache_config: CacheConfig
    model_dir: str
    spec: ModelSpec
    dtype: torch.dtype
    max_model_len: int
    max_num_batched_tokens: int
    window: int | None
    attention_sinks: int
    calibration_ids: tuple[int, ...] = ()  # K smoothing's calibration text (model/kv_smoothing.py)
    max_num_seqs: int = 256  # sizes the CUDA graphs' buckets


def select_kernels(
    choice: str,
    device: torch.device,
    spec: ModelSpec,
    block_size: int,
    window,
    sinks: int,
    tileable_kv: bool = False,
    kv_storage: torch.dtype | None = None,
) -> tuple[TorchPagedAttention, TorchOps]:
    """Attention backend and element-wise ops for ``attention_backend`` ``choice``.

    ``triton`` (and ``auto`` on a GPU, where Triton runs) uses the Triton kernels
    (``model/triton_backend.py``; on CPU only under Triton's interpreter, for tests), else
    ``auto`` on a GPU takes the portable SDPA path. ``cpu`` (and ``auto`` on a CPU device)
    uses the C++ kernels: paged attention (for head
    dims it is built for) and the fused RMSNorm/RoPE/SiLU ops. With ``tileable_kv``
    (``kv_tiles_apply``: a bf16 model with a plain bf16 cache or an 8-bit one with per-token
    scales) the C++ backend takes the tiled cache layout where the kernels read it
    (block_size a multiple of 16; the kernel build says which head dims:
    ``tiled_kv_supported``). ``kv_storage`` (the cache's element type) rules the Triton
    backend out where it cannot read it (``triton_unusable``).
    """
    if choice == "triton" or (choice == "auto" and device.type != "cpu"):
        reason = triton_unusable(device, spec.head_dim, kv_storage)
        if reason is None:
            return TritonPagedAttention(block_size, window, sinks), TorchOps()
        if choice == "triton":
            raise EngineError(f"attention_backend 'triton': {reason}")
        logger.warning("attention: the portable SDPA path (%s)", reason)
    if choice == "torch" or (choice == "auto" and device.type != "cpu"):
        return TorchPagedAttention(block_size), TorchOps()
    if device.type != "cpu":
        raise EngineError("attention_backend 'cpu' needs device cpu")
    if not load_cpu_kernels():
        if choice == "cpu":
            raise EngineError("attention_backend 'cpu': the C++ kernels failed to build")
        return TorchPagedAttention(block_size), TorchOps()
    if spec.head_dim in CPU_KERNEL_HEAD_DIMS:
        tiled = (
            tileable_kv
            and block_size % TILE == 0
            and bool(torch.ops.kvserve.tiled_kv_supported(spec.head_dim))
        )
        return CpuPagedAttention(block_size, window, sinks, tiled), CpuKernelOps()
    if choice == "cpu":
        raise EngineError(
            f"attention_backend 'cpu' supports head_dim {CPU_KERNEL_HEAD_DIMS}, "
            f"the model has {spec.head_dim}"
        )
    return TorchPagedAttention(block_size), CpuKernelOps()


def kv_tiles_apply(model_dtype: torch.dtype, fmt: KVFormat) -> bool:
    """True when the tiled cache layout suits ``fmt`` for a model of ``model_dtype``: a
    bf16 model, and a plain bf16 cache or 8-bit codes with per-token scales (the tiled
    kernel converts them in registers; fp8 with per-head scales keeps rows)."""
    if model_dtype != torch.bfloat16:
        return False
    if fmt.quantized:
        return fmt.scale == "token"
    return fmt.storage == torch.bfloat16


def smooth_k_applies(cache: CacheConfig, fmt: KVFormat) -> bool:
    """True when ``fmt`` gets K smoothing: asked for, and per-token scales."""
    return cache.kv_cache_smooth_k and fmt.scale == "token"


def rank_kv_spec(
    inp: ShardInputs, fmt: KVFormat, rank: int, world: int, tiled: bool = False
) -> KVCacheSpec:
    """The KV spec of rank ``rank`` of ``world``: its KV heads' share of every block (in
    the tiled layout when ``tiled``; the bytes are the same)."""
    heads = ShardPlan.for_rank(inp.spec, rank, world).num_kv_heads
    groups = None
    if inp.cache_config.kv_layout == "hybrid":
        groups = KVGroups.for_layer_windows(inp.spec.layer_windows)
    return KVCacheSpec.for_format(
        inp.spec.num_layers,
        heads,
        inp.spec.head_dim,
        fmt,
        inp.cache_config.block_size,
        tiled,
        groups,
    )


class ShardBuilder:
    """Loads this rank's model on ``device``; ``num_blocks`` and ``allocate`` size and make
    its KV cache (call ``allocate`` once, with the engine's block count)."""

    def __init__(self, inp: ShardInputs, device: torch.device, tp: TPGroup | None = None):
        self.inp = inp
        self.device = device
        plan = tp.plan if tp is not None else ShardPlan.single(inp.spec)
        cache = inp.cache_config
        self.kv_format = kv_format(cache.kv_cache_dtype, inp.dtype, cache.kv_cache_scales)
        self.backend, ops = select_kernels(
            inp.model_config.attention_backend,
            device,
            inp.spec,
            cache.block_size,
            inp.window,
            inp.attention_sinks,
            tileable_kv=kv_tiles_apply(inp.dtype, self.kv_format),
            kv_storage=self.kv_format.storage,
        )
        invariant_gpu = inp.model_config.batch_invariant and not isinstance(
            self.backend, CpuPagedAttention
        )  # (the C++ kernels are batch-invariant as they are)
        if invariant_gpu:
            if not isinstance(self.backend, TritonPagedAttention):
                raise EngineError(
                    "batch_invariant needs the Triton attention backend (--attention-backend "
                    "triton, on a GPU) or, on a CPU, the C++ kernels"
                )
            from kvserve.model import triton_ops  # defined once the backend can run

            ops = triton_ops.TritonOps()
        self.model: LlamaForCausalLM = load_model(
            inp.model_dir, inp.spec, inp.dtype, device, self.backend, ops, inp.max_model_len, tp,
            inp.model_config.quantization,
        )  # fmt: skip
        if invariant_gpu:
            triton_ops.make_batch_invariant(self.model)
        elif inp.model_config.attention_backend != "torch":
            prepack_linears(self.model)  # bf16/fp16 on CPU only; a no-op elsewhere
            quantized_on_huge_pages(self.model)  # a quantized model's codes, on a CPU
            use_expert_kernels(self.model)  # a MoE's experts in one C++ call where they can
            self.model.fused_stack = FusedStack.build(self.model)  # None unless all kernels
        self.kv_spec = rank_kv_spec(
            inp, self.kv_format, plan.rank, plan.size, tiled=self.backend.tiled
        )
        self.smooth_k = smooth_k_applies(inp.cache_config, self.kv_format)

    @property
    def weight_bytes(self) -> int:
        """Bytes of this rank's weights: parameters and buffers (packed copies included)
        and quantized modules (``quantized.weight_bytes``)."""
        return weight_bytes(self.model)

    def num_blocks(self) -> int:
        """How many KV blocks this rank can hold."""
        mem = self.inp.cache_config.kv_cache_memory
        if mem is None:
            mem = self._profile_cuda_memory() if self.device.type == "cuda" else None
        if mem is None:  # CPU: a small model gets a small cache, not 4 GiB of zeroed pages
            need = _CPU_DEFAULT_KV_SEQS * self.inp.max_model_len * self.kv_spec.bytes_per_token
            mem = min(_CPU_DEFAULT_KV_MEMORY, need + self.kv_spec.bytes_per_block)
        blocks = self.kv_spec.num_blocks_for(mem)
        if blocks <= 0:
            raise EngineError(
                f"kv_cache_memory {format_size(mem)} is smaller than one KV block "
                f"({format_size(self.kv_spec.bytes_per_block)})"
            )
        return blocks

    def allocate(self, num_blocks: int) -> list:
        """Per-layer caches; fp8 caches get the checkpoint's scales or calibrate; token-scale
        caches get their K smoothing shift (a forward pass: a collective under TP)."""
        caches = self.kv_spec.allocate(num_blocks, self.device, self.kv_format)
        if self.smooth_k:
            means = key_means(
                self.model,
                self.inp.calibration_ids,
                self.kv_spec.block_size,
                self.inp.max_model_len,
                self.inp.dtype,
                self.device,
                self.kv_spec.num_kv_heads,
                self.kv_spec.head_dim,
            )
            for cache, mean in zip(caches, means, strict=True):
                cache.set_k_shift(mean)
            logger.info("K smoothing: keys stored less their mean key per layer")
        if self.kv_format.scale == "head":
            scales = load_kv_scales(self.inp.model_dir, self.inp.spec.num_layers)
            calibrate = self.inp.cache_config.calculate_kv_scales
            for i, cache in enumerate(caches):
                if scales is not None:
                    k, v = scales[i]
                    cache.set_head_scales(torch.tensor(k), torch.tensor(v))
                cache.calibrating = calibrate
            logger.info(
                "fp8 KV scales: %s",
                "calibrated on the first forward pass"
                if calibrate
                else ("from the checkpoint" if scales is not None else "1.0"),
            )
        return caches

    def _graph_sizes(self) -> list[int]:
        """The decode batch sizes to capture, or [] when steps run eagerly: graphs need a
        CUDA device, the Triton backend, no MoE routing (it reads counts on the host) and
        a cache the Triton kernels write (not fp8 with per-head scales)."""
        if (
            self.device.type != "cuda"
            or self.inp.model_config.enforce_eager
            or not isinstance(self.backend, TritonPagedAttention)
            or self.inp.spec.num_experts > 0
            or self.kv_format.scale == "head"
        ):
            return []
        return capture_sizes(self.inp.max_num_seqs)

    def decode_graphs(self, kv_caches: list, tp: TPGroup | None = None) -> DecodeGraphs | None:
        """Capture the decode steps over ``kv_caches`` (None where they run eagerly, and
        under tensor parallelism for now)."""
        sizes = self._graph_sizes()
        if not sizes or tp is not None:
            return None
        groups = self.kv_spec.groups
        return DecodeGraphs(
            self.model,
            kv_caches,
            self.device,
            sizes,
            cdiv(self.inp.max_model_len, self.kv_spec.block_size),
            1 if groups is None else len(groups.windows),
            self.inp.max_model_len - 1,
            CudaCapture(self.device),
        )

    def _profile_cuda_memory(self) -> int:
        """Bytes left for KV after a max-size forward pass, under gpu_memory_utilization
        (the plan is logged as a table)."""
        tokens = min(self.inp.max_num_batched_tokens, self.inp.max_model_len)
        plan = measure_cuda(self.model, self.kv_spec, self.kv_format, tokens, self.device,
                            self.inp.cache_config.gpu_memory_utilization, self.weight_bytes,
                            self._graph_sizes())  # fmt: skip
        logger.info("GPU memory plan:\n%s", plan.table())
        return plan.kv
