"""EngineParts: everything an engine is made of, typed, in one place.

``engine.builder.EngineBuilder(args).parts()`` builds them once, in dependency order, and
``LLMEngine`` is an ``EngineParts`` (it adds the request doors and the step loop), so
"where is ``engine.kv`` set?" has one answer: the field here, filled by the builder's
``parts()``. Each part receives its collaborators in its constructor; nothing is wired
into a part after it is built. The metrics (``engine.kv_metrics``) read an engine through
this type.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from kvserve.config import CacheConfig, ModelConfig, SchedulerConfig

if TYPE_CHECKING:
    from kvserve.engine.peak import PeakTracker
    from kvserve.ha.prewarm import Prewarmer
    from kvserve.ha.replicator import Replicator
    from kvserve.kv.events import KVEventLog
    from kvserve.kv.manager import KVCacheManager
    from kvserve.kv.swap import SwapSpace
    from kvserve.model.kv_cache import KVCacheSpec
    from kvserve.model.kv_quant import KVFormat
    from kvserve.model.llama import LlamaForCausalLM
    from kvserve.model.spec import ModelSpec
    from kvserve.model.tokenizer import Tokenizer
    from kvserve.planner.usage import UsageRecorder
    from kvserve.sched.cost import PreemptionCostModel
    from kvserve.sched.scheduler import Scheduler
    from kvserve.store.offloader import KVOffloader
    from kvserve.worker.executor import MultiprocExecutor
    from kvserve.worker.model_runner import ModelRunner


@dataclass(eq=False, kw_only=True)
class EngineParts:
    """The configuration as resolved at start, the model, the KV cache and its managers,
    the runner, the scheduler and the optional cluster parts (None when off)."""

    # configuration, as resolved at start
    model_config: ModelConfig
    cache_config: CacheConfig  # kv_cache_scales and kv_layout resolved from "auto"
    scheduler_config: SchedulerConfig
    device: torch.device
    rng: random.Random  # seeds of requests that bring none
    model_dir: str  # an HF directory (a GGUF file's converted one)
    spec: ModelSpec
    tokenizer: Tokenizer | None  # None: token ids in, token ids out
    eos_token_ids: tuple[int, ...]
    dtype: torch.dtype
    max_model_len: int
    window: int | None  # sliding-window tokens (None: full attention)
    attention_sinks: int  # leading tokens a sliding window always keeps
    batch_invariant: bool  # a row's result depends on its own inputs only
    # the model and its KV cache
    model: LlamaForCausalLM | None  # None under tensor parallelism (the ranks hold it)
    kv_format: KVFormat
    kv_spec: KVCacheSpec
    model_fingerprint: str  # names stored blocks: another model's are a miss
    kv: KVCacheManager
    runner: ModelRunner | MultiprocExecutor
    scheduler: Scheduler
    cost_model: PreemptionCostModel
    swap: SwapSpace | None  # host swap space (None: preemption recomputes)
    # KV store, cluster, observation
    offloader: KVOffloader | None  # the KV store's engine side (None: no --kv-store)
    prewarmer: Prewarmer | None  # warm replicas of other nodes' sessions
    replicator: Replicator | None  # session records to the cluster (None: no --cluster)
    replication_url: str | None
    kv_events: KVEventLog | None  # block hashes stored / removed (None: not published)
    peak_usage: PeakTracker
    usage_recorder: UsageRecorder | None  # --kv-usage-log
    # time inside step() and inside the runner (forward + sampling), kept by the engine
    step_seconds: float = 0.0
    forward_seconds: float = 0.0
