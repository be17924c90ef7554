"""Assembly of an engine: device, kernels, model, KV sizing and tensors, swap space, KV
store, cluster node, scheduler — everything ``LLMEngine`` holds, built once from
``EngineArgs``. Raises ``EngineError`` (naming the flag to change) for a configuration
that cannot serve, before anything runs.
"""

from __future__ import annotations

import logging
import random

import torch

from kvserve.config import CacheConfig, EngineArgs, ModelConfig, SchedulerConfig
from kvserve.engine import kv_metrics
from kvserve.engine.cpu_env import tune_malloc
from kvserve.engine.errors import EngineError
from kvserve.kv.cache import KVCacheSpec
from kvserve.kv.hashing import model_fingerprint
from kvserve.kv.manager import KVCacheManager
from kvserve.kv.offload import KVOffloader
from kvserve.kv.quant import kv_format
from kvserve.kv.swap import SwapSpace
from kvserve.model.attention import (
    CPU_KERNEL_HEAD_DIMS,
    AttentionMetadata,
    CpuPagedAttention,
    PrefillChunk,
    TorchPagedAttention,
)
from kvserve.model.cpu_kernels import load_cpu_kernels
from kvserve.model.gguf import resolve_model
from kvserve.model.linear import prepack_linears
from kvserve.model.llama import LlamaForCausalLM
from kvserve.model.loader import load_kv_scales, load_model, resolve_dtype
from kvserve.model.ops import CpuKernelOps, TorchOps
from kvserve.model.spec import ModelSpec, load_model_spec
from kvserve.model.tokenizer import Tokenizer, load_tokenizer
from kvserve.planner.usage import UsageRecorder
from kvserve.sched.cost import PreemptionCostModel
from kvserve.sched.scheduler import Scheduler
from kvserve.utils import cdiv, format_size, resolve_device
from kvserve.worker.inputs import InputBuilder
from kvserve.worker.model_runner import ModelRunner
from kvserve.worker.offload import KVTransfer
from kvserve.worker.swap import HostSwap

logger = logging.getLogger("kvserve")

_CPU_DEFAULT_KV_MEMORY = 4 * 1024**3  # at most, without --kv-cache-memory
_CPU_DEFAULT_KV_SEQS = 32  # …and no more than this many sequences of max_model_len need

# what an engine takes over from its builder (attribute names on both)
PARTS = (
    "model_config", "cache_config", "scheduler_config", "device", "rng", "model_dir", "spec",
    "tokenizer",
    "eos_token_ids", "dtype", "max_model_len", "window", "attention_sinks", "model",
    "kv_format", "kv_spec", "model_fingerprint", "kv", "runner", "cost_model", "swap",
    "offloader", "prewarmer", "replicator", "replication_url", "scheduler", "peak_usage",
    "usage_recorder",
)  # fmt: skip


class EngineBuilder:
    """Builds every part in ``PARTS`` (in dependency order) in ``__init__``."""

    def __init__(self, args: EngineArgs):
        self.model_config: ModelConfig = args.model_config()
        self.cache_config: CacheConfig = args.cache_config()
        self.scheduler_config: SchedulerConfig = args.scheduler_config()
        self.device = resolve_device(self.model_config.device)
        if self.device.type == "cpu":
            tune_malloc()
        torch.manual_seed(self.model_config.seed)
        self.rng = random.Random(self.model_config.seed)
        # an HF directory as given; a GGUF file's converted directory (model/gguf.py)
        self.model_dir: str = resolve_model(self.model_config.model)
        self.spec: ModelSpec = load_model_spec(self.model_dir)
        self.tokenizer: Tokenizer | None = load_tokenizer(self.model_dir)
        self.eos_token_ids = self._eos_token_ids()
        self.dtype = resolve_dtype(self.model_config.dtype, self.spec, self.device)
        self.max_model_len = self.model_config.max_model_len or self.spec.max_position_embeddings
        if self.max_model_len > self.spec.max_position_embeddings:
            logger.warning(
                "max_model_len %d exceeds the model's max_position_embeddings %d",
                self.max_model_len,
                self.spec.max_position_embeddings,
            )
        self.window = self.cache_config.sliding_window or self.spec.sliding_window
        sinks = self.cache_config.attention_sinks
        if sinks is None:
            sinks = 4 if self.cache_config.sliding_window else 0
        self.attention_sinks = sinks if self.window is not None else 0
        backend, ops = self._kernels()
        self.model: LlamaForCausalLM = load_model(
            self.model_dir,
            self.spec,
            self.dtype,
            self.device,
            backend,
            ops,
            self.max_model_len,
        )
        if self.model_config.attention_backend != "torch":
            prepack_linears(self.model)  # bf16/fp16 on CPU only; a no-op elsewhere
        self.kv_format = kv_format(self.cache_config.kv_cache_dtype, self.dtype)
        self.kv_spec = KVCacheSpec.for_format(
            self.spec.num_layers,
            self.spec.num_kv_heads,
            self.spec.head_dim,
            self.kv_format,
            self.cache_config.block_size,
        )
        num_blocks = self._num_blocks()
        self.model_fingerprint = model_fingerprint(self.model_dir)
        self.kv = KVCacheManager(
            num_blocks,
            self.cache_config.block_size,
            enable_caching=self.cache_config.enable_prefix_caching,
            cache_keys=(self.model_fingerprint, f"kv={self.kv_format.name}"),
            reserve_null_block=self.window is not None,
        )
        if not self.kv.can_ever_fit(self.max_model_len):
            raise EngineError(
                f"the KV cache holds {self.kv.capacity_tokens} tokens, fewer than max_model_len "
                f"{self.max_model_len}; raise kv_cache_memory or lower max_model_len"
            )
        dense = getattr(backend, "dense_masks", True)
        self.runner = ModelRunner(
            self.model,
            self._allocate_kv(num_blocks),
            self.device,
            InputBuilder(self.kv, self.device, self.window, self.attention_sinks, dense),
        )
        self.cost_model = PreemptionCostModel(self.kv_spec.bytes_per_token)
        self.cost_model.calibrate_copy(self.device)
        self.swap = None
        if self.cache_config.swap_space and self.scheduler_config.preemption_mode != "recompute":
            self.swap = SwapSpace(self.kv_spec.bytes_per_block, self.cache_config.swap_space)
            self.runner.host_swap = HostSwap(
                self.runner.kv_caches,
                self.kv.block_size,
                self.kv_spec.bytes_per_block,
                on_copy=self.cost_model.observe_copy,
            )
        self.offloader = self._offloader(args)
        self.prewarmer = None  # set by _replicator when this node can hold warm replicas
        self.replicator = self._replicator(args)
        self.scheduler = Scheduler(
            self.scheduler_config,
            self.kv,
            swap=self.swap,
            cost=self.cost_model,
            offloader=self.offloader,
        )
        self.peak_usage = kv_metrics.PeakTracker()
        obs = args.observability_config()
        self.usage_recorder = (
            UsageRecorder(obs.kv_usage_log, obs.kv_usage_interval) if obs.kv_usage_log else None
        )
        self._log_capacity()

    def _offloader(self, args: EngineArgs) -> KVOffloader | None:
        store_config = args.store_config()
        if not store_config.urls:
            return None
        if not self.cache_config.enable_prefix_caching:
            raise EngineError("--kv-store needs prefix caching (drop --no-prefix-caching)")
        from kvserve.store.url import open_tiered

        store = open_tiered(
            store_config.urls,
            write_policy=store_config.write_policy,
            queue_size=store_config.queue_size,
            namespace=f"{self.model_fingerprint[:16]}-{self.kv_format.name}-bs{self.kv.block_size}",
        )
        logger.info("KV store tiers: %s", " → ".join(t.name for t in store.tiers))
        self.runner.kv_transfer = KVTransfer(
            self.runner.kv_caches, self.kv.block_size, self.model_fingerprint, self.kv_format.name
        )
        return KVOffloader(
            store, self.kv, self.runner.kv_transfer.block_format, store_config.session_ttl
        )

    def _replicator(self, args: EngineArgs):
        config = args.replication_config()
        self.replication_url = config.cluster
        if config.cluster is None:
            return None
        import os
        import socket

        from kvserve.ha.coordination import Coordinator
        from kvserve.ha.replicator import Replicator

        node = config.node_id or f"{socket.gethostname()}:{os.getpid()}"
        coord = Coordinator.from_url(config.cluster)
        pusher = None
        if self.offloader is not None:
            from kvserve.ha.prewarm import Prewarmer

            self.prewarmer = Prewarmer(coord, node, self.kv, self.offloader.store)
            if "standby" in config.replicate_to:
                from kvserve.ha.push import StandbyPusher

                pusher = StandbyPusher(coord, self.offloader, secret=None)  # server sets it
        checkpointer = None
        if "s3" in config.replicate_to:
            from kvserve.ha.checkpoint import Checkpointer

            if self.offloader is None:
                raise EngineError("--replicate-to s3 needs an s3:// --kv-store tier")
            try:
                checkpointer = Checkpointer(self.offloader.store, config.checkpoint_interval)
            except ValueError as e:
                raise EngineError(str(e)) from None
        return Replicator(
            coord, node, config.replicate_every, self.kv.block_size, pusher, checkpointer
        )

    def _kernels(self) -> tuple[TorchPagedAttention, TorchOps]:
        """Attention backend and element-wise ops for ``attention_backend`` on this device.

        ``cpu`` (and ``auto`` on a CPU device) uses the C++ kernels: paged decode attention
        (for head dims it is built for) and the fused RMSNorm/RoPE/SiLU ops.
        """
        choice = self.model_config.attention_backend
        block_size = self.cache_config.block_size
        if choice == "torch" or (choice == "auto" and self.device.type != "cpu"):
            return TorchPagedAttention(block_size), TorchOps()
        if self.device.type != "cpu":
            raise EngineError("attention_backend 'cpu' needs device cpu")
        if not load_cpu_kernels():
            if choice == "cpu":
                raise EngineError("attention_backend 'cpu': the C++ kernels failed to build")
            return TorchPagedAttention(block_size), TorchOps()
        if self.spec.head_dim in CPU_KERNEL_HEAD_DIMS:
            return CpuPagedAttention(block_size, self.window, self.attention_sinks), CpuKernelOps()
        if choice == "cpu":
            raise EngineError(
                f"attention_backend 'cpu' supports head_dim {CPU_KERNEL_HEAD_DIMS}, "
                f"the model has {self.spec.head_dim}"
            )
        return TorchPagedAttention(block_size), CpuKernelOps()

    # ---- capacity -------------------------------------------------------------------
    def _allocate_kv(self, num_blocks: int) -> list:
        """Per-layer caches; fp8 caches get the checkpoint's scales or calibrate."""
        caches = self.kv_spec.allocate(num_blocks, self.device, self.kv_format)
        if self.kv_format.scale == "head":
            scales = load_kv_scales(self.model_dir, self.spec.num_layers)
            for i, cache in enumerate(caches):
                if scales is not None:
                    k, v = scales[i]
                    cache.set_head_scales(torch.tensor(k), torch.tensor(v))
                cache.calibrating = self.cache_config.calculate_kv_scales
            logger.info(
                "fp8 KV scales: %s",
                "calibrated on the first forward pass"
                if self.cache_config.calculate_kv_scales
                else ("from the checkpoint" if scales is not None else "1.0"),
            )
        return caches

    def _num_blocks(self) -> int:
        mem = self.cache_config.kv_cache_memory
        if mem is None:
            mem = self._profile_cuda_memory() if self.device.type == "cuda" else None
        if mem is None:  # CPU: a small model gets a small cache, not 4 GiB of zeroed pages
            need = _CPU_DEFAULT_KV_SEQS * self.max_model_len * self.kv_spec.bytes_per_token
            mem = min(_CPU_DEFAULT_KV_MEMORY, need + self.kv_spec.bytes_per_block)
        blocks = self.kv_spec.num_blocks_for(mem)
        if blocks <= 0:
            raise EngineError(
                f"kv_cache_memory {format_size(mem)} is smaller than one KV block "
                f"({format_size(self.kv_spec.bytes_per_block)})"
            )
        return blocks

    def _profile_cuda_memory(self) -> int:
        """Bytes left for KV after a max-size forward pass, under gpu_memory_utilization."""
        n = min(self.scheduler_config.max_num_batched_tokens, self.max_model_len)
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(self.device)
        caches = self.kv_spec.allocate(
            cdiv(n, self.kv_spec.block_size), self.device, self.kv_format
        )
        ids = torch.zeros(n, dtype=torch.long, device=self.device)
        pos = torch.arange(n, device=self.device)
        meta = AttentionMetadata(
            slot_mapping=pos.clone(),
            max_position=n - 1,
            prefills=[PrefillChunk(0, n, n, None, None)],
        )
        with torch.inference_mode():
            hidden = self.model(ids, pos, caches, meta)
            self.model.compute_logits(hidden[-1:])
        torch.cuda.synchronize(self.device)
        peak = torch.cuda.max_memory_allocated(self.device)
        del caches, hidden
        torch.cuda.empty_cache()
        total = torch.cuda.get_device_properties(self.device).total_memory
        return int(total * self.cache_config.gpu_memory_utilization) - peak

    def _log_capacity(self) -> None:
        tokens = self.kv.capacity_tokens
        logger.info(
            "KV cache: %d bytes/token, %d blocks × %d tokens = %d tokens (%s, %s); "
            "max concurrency at max_model_len %d: %.2fx",
            self.kv_spec.bytes_per_token,
            self.kv.num_blocks,
            self.kv.block_size,
            tokens,
            format_size(self.kv.num_blocks * self.kv_spec.bytes_per_block),
            str(self.kv_spec.dtype).removeprefix("torch."),
            self.max_model_len,
            tokens / self.max_model_len,
        )

    def _eos_token_ids(self) -> tuple[int, ...]:
        """EOS ids from config.json and the tokenizer (computed once at start)."""
        ids = set(self.spec.eos_token_ids)
        if self.tokenizer is not None and self.tokenizer.eos_token_id is not None:
            ids.add(self.tokenizer.eos_token_id)
        return tuple(sorted(ids))
