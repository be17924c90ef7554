"""Assembly of an engine: device, kernels, model, KV sizing and tensors, swap space, KV
store, cluster node, scheduler — everything ``LLMEngine`` holds, built once from
``EngineArgs``. Raises ``EngineError`` (naming the flag to change) for a configuration
that cannot serve, before anything runs.
"""

from __future__ import annotations

import dataclasses
import logging
import random
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from kvserve.config import CacheConfig, EngineArgs, ModelConfig, SchedulerConfig
from kvserve.engine import tcmalloc
from kvserve.engine.cpu_env import tune_malloc
from kvserve.engine.parts import EngineParts
from kvserve.engine.peak import PeakTracker
from kvserve.errors import EngineError
from kvserve.kv.events import KVEventLog
from kvserve.kv.hashing import model_fingerprint
from kvserve.kv.manager import KVCacheManager
from kvserve.kv.swap import SwapSpace
from kvserve.model.gguf import resolve_model
from kvserve.model.kv_quant import kv_format
from kvserve.model.kv_smoothing import calibration_ids
from kvserve.model.llama import LlamaForCausalLM
from kvserve.model.loader import has_kv_scales, resolve_dtype
from kvserve.model.parallel import ShardingError, check_shardable
from kvserve.model.spec import ModelSpec, load_model_spec
from kvserve.model.tokenizer import Tokenizer, load_tokenizer
from kvserve.planner.usage import UsageRecorder
from kvserve.request import Request
from kvserve.sched.cost import PreemptionCostModel
from kvserve.sched.scheduler import Scheduler
from kvserve.store.offloader import KVOffloader
from kvserve.utils import format_size, resolve_device
from kvserve.worker.executor import MultiprocExecutor
from kvserve.worker.inputs import InputBuilder
from kvserve.worker.loading import ShardBuilder, ShardInputs, smooth_k_applies
from kvserve.worker.model_runner import ModelRunner
from kvserve.worker.offload import KVTransfer
from kvserve.worker.swap import HostSwap

if TYPE_CHECKING:
    from kvserve.ha.prewarm import Prewarmer
    from kvserve.ha.replicator import Replicator
    from kvserve.store.serde import BlockFormat

logger = logging.getLogger("kvserve")


@dataclass(frozen=True)
class StoreSaves:
    """The KV store's saves after a step (``Scheduler.on_blocks_full``): the newly full
    blocks of the step's requests, serialized by the runner and queued to the store."""

    offloader: KVOffloader
    runner: ModelRunner | MultiprocExecutor

    def __call__(self, requests: list[Request]) -> None:
        self.runner.save_blocks(self.offloader.saves_for(requests), self.offloader.store)


class EngineBuilder:
    """Builds every part of an engine (in dependency order) in ``__init__``; ``parts()``
    hands them over as ``EngineParts``."""

    def __init__(self, args: EngineArgs, cluster_secret: str | None = None):
        """``cluster_secret``: authenticates this node's pushes to a standby (a cluster's
        ``/internal/*`` endpoints); None outside one."""
        self.model_config: ModelConfig = args.model_config()
        self.cache_config: CacheConfig = args.cache_config()
        self.scheduler_config: SchedulerConfig = args.scheduler_config()
        self.device = resolve_device(self.model_config.device)
        if self.device.type == "cpu":
            tune_malloc()
            tcmalloc.hint_in_process(self.device.type)
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
        if self.spec.hybrid and self.cache_config.sliding_window:
            slide = sum(1 for w in self.spec.layer_windows if w)
            raise EngineError(
                f"sliding_window: {self.spec.architecture} has its own windows ({slide} of "
                f"{self.spec.num_layers} layers slide over {max(self.spec.layer_windows)} "
                "tokens, the others see everything); a model-wide window cannot replace them"
            )
        self.window = self.cache_config.sliding_window or self.spec.sliding_window
        sinks = self.cache_config.attention_sinks
        if sinks is None:
            sinks = 4 if self.cache_config.sliding_window else 0
        self.attention_sinks = sinks if self.window is not None else 0
        self.cache_config = self._resolve_kv_scales(self.cache_config)
        self.cache_config = self._resolve_kv_layout(self.cache_config)
        self.parallel = args.parallel_config()
        shard_inputs = ShardInputs(
            self.model_config,
            self.cache_config,
            self.model_dir,
            self.spec,
            self.dtype,
            self.max_model_len,
            self.scheduler_config.max_num_batched_tokens,
            self.window,
            self.attention_sinks,
            self._calibration_ids(),
            self.scheduler_config.max_num_seqs,
        )
        shard: ShardBuilder | None = None
        executor: MultiprocExecutor | None = None
        if self.parallel.tensor_parallel_size == 1:
            shard = ShardBuilder(shard_inputs, self.device)
            self.model: LlamaForCausalLM | None = shard.model
            self.kv_format, self.kv_spec = shard.kv_format, shard.kv_spec
            num_blocks = shard.num_blocks()
            dense = shard.backend.dense_masks
        else:  # the ranks load their shards in worker processes
            self._check_parallel(args)
            self.model = None
            executor = MultiprocExecutor(shard_inputs, self.parallel)
            self.kv_format, self.kv_spec = executor.kv_format, executor.kv_spec
            num_blocks, dense = executor.num_blocks, executor.dense_masks
        try:
            self._assemble(args, shard, executor, num_blocks, dense, cluster_secret)
        except BaseException:
            if executor is not None:  # no worker processes left behind
                executor.close()
            raise

    def _assemble(
        self,
        args: EngineArgs,
        shard: ShardBuilder | None,
        executor: MultiprocExecutor | None,
        num_blocks: int,
        dense: bool,
        cluster_secret: str | None,
    ) -> None:
        """Everything after the model: KV manager, runner, swap, store, scheduler."""
        # a row's result depends on nothing but its own inputs (benchmarks/history/notebook.md,
        # "Determinism"): the C++ paged attention and oneDNN GEMMs, in bf16/fp16 on CPU.
        # A resumed stream then restores every stored block (ha/resume.restore_limit)
        self.batch_invariant = self.model_config.batch_invariant or (
            self.device.type == "cpu"
            and not dense
            and self.dtype in (torch.bfloat16, torch.float16)
        )
        self.model_fingerprint = model_fingerprint(self.model_dir)
        if not 0.0 <= args.prewarm_device_fraction <= 1.0:
            raise EngineError(
                f"prewarm_device_fraction must be in [0, 1], got {args.prewarm_device_fraction}"
            )
        self.kv_events = self._kv_events(args)
        reserve_null = self.window is not None or self.kv_spec.groups is not None
        self.kv = KVCacheManager(
            num_blocks,
            self.cache_config.block_size,
            enable_caching=self.cache_config.enable_prefix_caching,
            cache_keys=(self.model_fingerprint, f"kv={self.kv_format.name}"),
            reserve_null_block=reserve_null,
            groups=self.kv_spec.groups,
            max_step_tokens=self.scheduler_config.max_num_batched_tokens,
            warm_limit=int(args.prewarm_device_fraction * (num_blocks - reserve_null)),
            events=self.kv_events,
        )
        if not self.kv.can_ever_fit(self.max_model_len):
            raise EngineError(
                f"the KV cache holds {self.kv.capacity_tokens} tokens, fewer than max_model_len "
                f"{self.max_model_len}; raise kv_cache_memory or lower max_model_len"
            )
        swap_on = bool(
            self.cache_config.swap_space and self.scheduler_config.preemption_mode != "recompute"
        )
        # bytes a block copies per token: every layer's, or a hybrid layout's group's
        self.cost_model = PreemptionCostModel(self.kv_spec.bytes_per_block // self.kv.block_size)
        self.cost_model.calibrate_copy(self.device)
        self.swap = None
        if swap_on:
            self.swap = SwapSpace(self.kv_spec.bytes_per_block, self.cache_config.swap_space)
        store_names = (
            (self.model_fingerprint, self.kv_format.name) if self._store_on(args) else None
        )
        if executor is not None:  # the ranks make their own inputs, swap and transfer
            executor.start_cache(num_blocks, swap_on, store_names)
            self.runner: ModelRunner | MultiprocExecutor = executor
            block_format = executor.block_format if store_names is not None else None
        else:
            assert shard is not None and self.model is not None
            caches = shard.allocate(num_blocks)
            host_swap = transfer = None
            if swap_on:
                host_swap = HostSwap(
                    caches,
                    self.kv.block_size,
                    self.kv_spec.bytes_per_block,
                    on_copy=self.cost_model.observe_copy,
                )
            if store_names is not None:
                groups = self.kv_spec.groups
                transfer = KVTransfer(
                    caches,
                    self.kv.block_size,
                    *store_names,
                    groups.layer_group if groups is not None else None,
                )
            graphs = shard.decode_graphs(caches)
            inputs = InputBuilder(
                self.kv.block_size, self.device, self.window, self.attention_sinks, dense
            )
            self.runner = ModelRunner(
                self.model, caches, self.device, inputs, graphs, host_swap, transfer
            )
            block_format = transfer.block_format if transfer is not None else None
        self.offloader = self._offloader(args, block_format)
        self.prewarmer, self.replicator = self._replicator(args, cluster_secret)
        self.scheduler = Scheduler(
            self.scheduler_config,
            self.kv,
            swap=self.swap,
            cost=self.cost_model,
            offloader=self.offloader,
            max_model_len=self.max_model_len,
            window=self.window,
            attention_sinks=self.attention_sinks,
            on_blocks_full=(
                StoreSaves(self.offloader, self.runner) if self.offloader is not None else None
            ),
        )
        self.peak_usage = PeakTracker()
        obs = args.observability_config()
        self.usage_recorder = (
            UsageRecorder(obs.kv_usage_log, obs.kv_usage_interval) if obs.kv_usage_log else None
        )
        self._log_capacity()

    def parts(self) -> EngineParts:
        """What was built, for the engine to hold."""
        return EngineParts(
            model_config=self.model_config,
            cache_config=self.cache_config,
            scheduler_config=self.scheduler_config,
            device=self.device,
            rng=self.rng,
            model_dir=self.model_dir,
            spec=self.spec,
            tokenizer=self.tokenizer,
            eos_token_ids=self.eos_token_ids,
            dtype=self.dtype,
            max_model_len=self.max_model_len,
            window=self.window,
            attention_sinks=self.attention_sinks,
            batch_invariant=self.batch_invariant,
            model=self.model,
            kv_format=self.kv_format,
            kv_spec=self.kv_spec,
            model_fingerprint=self.model_fingerprint,
            kv=self.kv,
            runner=self.runner,
            scheduler=self.scheduler,
            cost_model=self.cost_model,
            swap=self.swap,
            offloader=self.offloader,
            prewarmer=self.prewarmer,
            replicator=self.replicator,
            replication_url=self.replication_url,
            kv_events=self.kv_events,
            peak_usage=self.peak_usage,
            usage_recorder=self.usage_recorder,
        )

    def _store_on(self, args: EngineArgs) -> bool:
        """Whether blocks go to a KV store (``--kv-store``); refuses (EngineError) one
        without prefix caching."""
        if not args.store_config().urls:
            return False
        if not self.cache_config.enable_prefix_caching:
            raise EngineError("--kv-store needs prefix caching (drop --no-prefix-caching)")
        return True

    def _offloader(
        self, args: EngineArgs, block_format: Callable[[], BlockFormat] | None
    ) -> KVOffloader | None:
        """The KV store's engine side over the tiers of ``--kv-store``; None without one
        (``block_format``: the runner's, None then)."""
        if block_format is None:
            return None
        from kvserve.store.url import open_tiered

        store_config = args.store_config()

        store = open_tiered(
            store_config.urls,
            write_policy=store_config.write_policy,
            queue_size=store_config.queue_size,
            namespace=self._namespace(),
            events=self.kv_events,
        )
        logger.info("KV store tiers: %s", " → ".join(t.name for t in store.tiers))
        return KVOffloader(store, self.kv, block_format, store_config.session_ttl)

    def _kv_events(self, args: EngineArgs) -> KVEventLog | None:
        """The log of block hashes stored and removed (device pool, host tier) when this
        engine publishes KV events (in a cluster, or with ``--kv-events-port``)."""
        if not args.kv_events_enabled or not self.cache_config.enable_prefix_caching:
            return None
        return KVEventLog()

    def _namespace(self) -> str:
        """The store's key prefix: model, KV format, block size (and TP size above 1:
        a block stored at another tensor-parallel size is a miss, not a misread)."""
        tp = self.parallel.tensor_parallel_size
        base = f"{self.model_fingerprint[:16]}-{self.kv_format.name}-bs{self.kv.block_size}"
        return base if tp == 1 else f"{base}-tp{tp}"

    def _replicator(
        self, args: EngineArgs, cluster_secret: str | None
    ) -> tuple[Prewarmer | None, Replicator | None]:
        """This node's pre-warmer (when it can hold warm replicas: a KV store) and
        replicator; (None, None) outside a cluster. ``cluster_secret`` authenticates the
        standby pushes."""
        config = args.replication_config()
        self.replication_url = config.cluster
        if config.cluster is None:
            return None, None
        import os
        import socket

        from kvserve.ha.coordination import Coordinator
        from kvserve.ha.replicator import Replicator

        node = config.node_id or f"{socket.gethostname()}:{os.getpid()}"
        coord = Coordinator.from_url(config.cluster)
        pusher = prewarmer = None
        if self.offloader is not None:
            from kvserve.ha.prewarm import Prewarmer

            prewarmer = Prewarmer(coord, node, self.kv, self.offloader.store)
            if "standby" in config.replicate_to:
                from kvserve.ha.push import StandbyPusher

                pusher = StandbyPusher(coord, self.offloader, secret=cluster_secret)
        checkpointer = None
        if "s3" in config.replicate_to:
            from kvserve.ha.checkpoint import Checkpointer

            if self.offloader is None:
                raise EngineError("--replicate-to s3 needs an s3:// --kv-store tier")
            try:
                checkpointer = Checkpointer(self.offloader.store, config.checkpoint_interval)
            except ValueError as e:
                raise EngineError(str(e)) from None
        return prewarmer, Replicator(
            coord, node, config.replicate_every, self.kv.block_size, pusher, checkpointer
        )

    def _calibration_ids(self) -> tuple[int, ...]:
        """K smoothing's calibration tokens when this engine's KV format takes it, else ()."""
        cache = self.cache_config
        fmt = kv_format(cache.kv_cache_dtype, self.dtype, cache.kv_cache_scales)
        if not smooth_k_applies(cache, fmt):
            return ()
        return calibration_ids(self.tokenizer, self.spec.vocab_size)

    def _resolve_kv_scales(self, cache: CacheConfig) -> CacheConfig:
        """``kv_cache_scales`` ``auto`` → ``head`` for an fp8 cache whose checkpoint has
        scales or that calculates them, else ``token``."""
        if cache.kv_cache_scales != "auto" or not cache.kv_cache_dtype.startswith("fp8"):
            return cache
        head = cache.calculate_kv_scales or has_kv_scales(self.model_dir)
        return dataclasses.replace(cache, kv_cache_scales="head" if head else "token")

    def _resolve_kv_layout(self, cache: CacheConfig) -> CacheConfig:
        """``kv_layout`` ``auto`` → ``hybrid`` for a model with sliding and global layers,
        else ``uniform``. Refuses (EngineError) ``hybrid`` where it cannot apply."""
        if cache.kv_layout == "hybrid" and not self.spec.hybrid:
            raise EngineError(
                f"kv_layout hybrid: every layer of {self.spec.architecture} attends "
                "alike; the hybrid layout is for models with sliding and global layers"
            )
        hybrid = self.spec.hybrid and cache.kv_layout != "uniform"
        return dataclasses.replace(cache, kv_layout="hybrid" if hybrid else "uniform")

    def _check_parallel(self, args: EngineArgs) -> None:
        """Refuse, at start, what tensor parallelism does not support yet."""
        try:
            check_shardable(self.spec, self.parallel.tensor_parallel_size)
        except ShardingError as e:
            raise EngineError(str(e)) from None
        cache = self.cache_config
        fmt = kv_format(cache.kv_cache_dtype, self.dtype, cache.kv_cache_scales)
        if args.store_config().urls and fmt.scale == "head":
            raise EngineError(
                "--tensor-parallel-size > 1 with an fp8 KV cache and --kv-store (or --cluster) "
                "and per-head scales is not supported yet (they differ by rank); use "
                "--kv-cache-scales token, int8 or bf16 KV"
            )

    # ---- capacity -------------------------------------------------------------------
    def _log_capacity(self) -> None:
        tokens = self.kv.capacity_tokens
        tp = self.parallel.tensor_parallel_size
        groups = self.kv_spec.groups
        logger.info(
            "KV cache: %d bytes/token%s, %d blocks × %d tokens = %d tokens (%s, %s, %s); "
            "max concurrency at max_model_len %d: %.2fx",
            self.kv_spec.bytes_per_token,
            "" if tp == 1 else f" on each of {tp} ranks (the fullest rank's shard)",
            self.kv.num_blocks,
            self.kv.block_size,
            tokens,
            format_size(self.kv.num_blocks * self.kv_spec.bytes_per_block),
            str(self.kv_spec.dtype).removeprefix("torch."),
            "uniform layout" if groups is None else groups.describe(),
            self.max_model_len,
            self.kv.num_blocks / self.kv.blocks_needed(self.max_model_len),
        )

    def _eos_token_ids(self) -> tuple[int, ...]:
        """EOS ids from config.json and the tokenizer (computed once at start)."""
        ids = set(self.spec.eos_token_ids)
        if self.tokenizer is not None and self.tokenizer.eos_token_id is not None:
            ids.add(self.tokenizer.eos_token_id)
        return tuple(sorted(ids))
