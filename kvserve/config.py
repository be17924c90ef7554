"""Engine configuration: one small frozen dataclass per concern.

Each component receives only the part it needs. ``EngineArgs`` is the flat, user-facing
bundle (Python keyword arguments and CLI flags map one-to-one to its fields); it validates
and splits itself into the per-concern configs. Validation raises ``ValueError``.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from typing import Any

from kvserve.flags import add_flags, flag, from_flags
from kvserve.model.kv_quant import KV_CACHE_DTYPES, KV_CACHE_SCALES
from kvserve.model_config import ATTENTION_BACKENDS, QUANTIZATION_MODES, ModelConfig, check_choice
from kvserve.parallel_config import ParallelConfig, host_port, torchrun_env
from kvserve.utils import DTYPE_NAMES, parse_size

__all__ = ["ModelConfig", "ParallelConfig", "host_port"]  # re-exported: one import for all

PREFIX_CACHE_ISOLATION = ("none", "tenant")
PREEMPTION_MODES = ("auto", "swap", "recompute")
PREEMPTION_VICTIMS = ("cost", "latest")
KV_LAYOUTS = ("auto", "hybrid", "uniform")


@dataclass(frozen=True)
class CacheConfig:
    """Paged KV cache shape and capacity.

    Capacity comes from ``kv_cache_memory`` (bytes) when set; otherwise, on CUDA, from
    ``gpu_memory_utilization`` after a profiling forward pass, and on CPU room for 32
    sequences of ``max_model_len``, at most 4 GiB.
    ``kv_cache_dtype``: ``auto`` (the model dtype), a 16/32-bit float, ``int8`` (per-token
    scales) or ``fp8``/``fp8_e4m3``/``fp8_e5m2``, whose scales ``kv_cache_scales`` chooses:
    ``token`` (per token and KV head, as int8), ``head`` (per layer and KV head: the
    checkpoint's, or 1.0, or with ``calculate_kv_scales`` from the first forward pass);
    ``auto`` is ``head`` when the checkpoint has scales or they are calculated, else
    ``token``.
    ``enable_prefix_caching`` shares full blocks between requests with the same prefix;
    ``prefix_cache_isolation`` ``tenant`` shares them only within a tenant.
    ``sliding_window`` (tokens) overrides the model's window, or applies one to any model;
    ``attention_sinks`` first tokens then stay visible (default 4 with a user window, 0 for
    a model's own window). Blocks outside the window are freed as a sequence grows.
    ``swap_space`` (bytes) bounds the host memory holding swapped-out requests' K/V; it is
    taken only while requests are swapped out (0 disables swapping).
    ``kv_cache_smooth_k``: an int8 or token-scale fp8 cache stores keys less their layer's
    mean key, calibrated at start (``kvserve.model.kv_smoothing``); no effect on other caches.
    ``kv_layout``: ``hybrid`` gives a model with sliding and global layers one block table
    per group of layers (``kvserve.model.kv_groups``), so sliding layers hold only their window;
    ``uniform`` one table for every layer; ``auto`` is hybrid for such a model unless a
    feature not yet wired for it is on (a cluster).
    """

    block_size: int = 16
    kv_cache_memory: int | None = None
    gpu_memory_utilization: float = 0.9
    kv_cache_dtype: str = "auto"
    calculate_kv_scales: bool = False
    enable_prefix_caching: bool = True
    prefix_cache_isolation: str = "none"
    sliding_window: int | None = None
    attention_sinks: int | None = None
    swap_space: int = 4 * 1024**3
    kv_cache_scales: str = "auto"
    kv_cache_smooth_k: bool = True
    kv_layout: str = "auto"

    def __post_init__(self) -> None:
        check_choice("kv_layout", self.kv_layout, KV_LAYOUTS)
        check_choice("kv_cache_scales", self.kv_cache_scales, KV_CACHE_SCALES)
        if self.swap_space < 0:
            raise ValueError(f"swap_space must be non-negative, got {self.swap_space}")
        if self.block_size <= 0 or self.block_size & (self.block_size - 1):
            raise ValueError(f"block_size must be a positive power of two, got {self.block_size}")
        if self.kv_cache_memory is not None and self.kv_cache_memory <= 0:
            raise ValueError(f"kv_cache_memory must be positive, got {self.kv_cache_memory}")
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ValueError(
                f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}"
            )
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(
                f"kv_cache_dtype {self.kv_cache_dtype!r} is not supported; "
                f"choose one of {', '.join(KV_CACHE_DTYPES)}"
            )
        check_choice("prefix_cache_isolation", self.prefix_cache_isolation, PREFIX_CACHE_ISOLATION)
        if self.sliding_window is not None and self.sliding_window <= 0:
            raise ValueError(f"sliding_window must be positive, got {self.sliding_window}")
        if self.attention_sinks is not None and self.attention_sinks < 0:
            raise ValueError(f"attention_sinks must be non-negative, got {self.attention_sinks}")
        if self.calculate_kv_scales and not self.kv_cache_dtype.startswith("fp8"):
            raise ValueError("calculate_kv_scales applies to an fp8 kv_cache_dtype only")
        if self.calculate_kv_scales and self.kv_cache_scales == "token":
            raise ValueError(
                "calculate_kv_scales calculates per-head scales: drop it or "
                "use --kv-cache-scales head"
            )


@dataclass(frozen=True)
class SchedulerConfig:
    """Continuous-batching limits per engine step, and preemption.

    ``preemption_mode``: ``swap`` (copy a victim's K/V to the host swap space while it has
    room), ``recompute`` (free it, re-prefill later) or ``auto`` (per victim, whichever the
    measured-cost model says is cheaper). ``preemption_victim``: ``cost`` (cheapest to
    restore per freed block) or ``latest`` (latest arrival, vLLM's rule) among requests
    of equal reservation standing and priority.
    """

    max_num_batched_tokens: int = 2048
    max_num_seqs: int = 256
    enable_chunked_prefill: bool = True
    preemption_mode: str = "auto"
    preemption_victim: str = "cost"

    def __post_init__(self) -> None:
        if self.max_num_batched_tokens <= 0:
            raise ValueError(
                f"max_num_batched_tokens must be positive, got {self.max_num_batched_tokens}"
            )
        if self.max_num_seqs <= 0:
            raise ValueError(f"max_num_seqs must be positive, got {self.max_num_seqs}")
        check_choice("preemption_mode", self.preemption_mode, PREEMPTION_MODES)
        check_choice("preemption_victim", self.preemption_victim, PREEMPTION_VICTIMS)


@dataclass(frozen=True)
class ObservabilityConfig:
    """KV usage samples appended as JSON lines to ``kv_usage_log`` every
    ``kv_usage_interval`` seconds (input of ``kvserve plan --usage``); None disables."""

    kv_usage_log: str | None = None
    kv_usage_interval: float = 10.0

    def __post_init__(self) -> None:
        if self.kv_usage_interval <= 0:
            raise ValueError(f"kv_usage_interval must be positive, got {self.kv_usage_interval}")


@dataclass(frozen=True)
class StoreConfig:
    """KV store tiers (``--kv-store URL``, repeatable, fastest first; see
    ``kvserve.store.url``). Full blocks are saved to them and prefixes restored from them;
    the first tier is written synchronously, the others through a bounded queue of
    ``kv_store_queue_size`` batches, every put (``write-through``) or when the first tier
    evicts a block (``write-back``). Stored sessions expire after ``session_ttl`` seconds.
    Needs prefix caching."""

    urls: tuple[str, ...] = ()
    write_policy: str = "write-through"
    queue_size: int = 1024
    session_ttl: float = 86400.0

    def __post_init__(self) -> None:
        if self.write_policy not in ("write-through", "write-back"):
            raise ValueError(
                f"kv_store_write_policy must be write-through or write-back, "
                f"got {self.write_policy!r}"
            )
        if self.queue_size < 1:
            raise ValueError(f"kv_store_queue_size must be positive, got {self.queue_size}")
        if self.session_ttl <= 0:
            raise ValueError(f"kv_store_session_ttl must be positive, got {self.session_ttl}")


@dataclass(frozen=True)
class ReplicationConfig:
    """Session replication to a cluster's Redis (``cluster`` URL; None: off). This engine
    is ``node_id`` (default: host:pid) and publishes each session's state every
    ``replicate_every`` generated tokens and when it finishes."""

    cluster: str | None = None
    node_id: str | None = None
    replicate_every: int = 16
    # where deltas go besides the coordinator's record: "store" (the shared KV tier, always
    # on in a cluster), "standby" (pushed straight to the session's standby worker), "s3"
    # (session checkpoints every checkpoint_interval seconds into the S3 tier)
    replicate_to: tuple[str, ...] = ("store",)
    checkpoint_interval: float = 30.0

    def __post_init__(self) -> None:
        if self.replicate_every < 1:
            raise ValueError(f"replicate_every must be positive, got {self.replicate_every}")
        bad = [t for t in self.replicate_to if t not in ("store", "standby", "s3")]
        if bad:
            raise ValueError(f"--replicate-to {bad[0]!r}: expected store, standby or s3")
        if self.checkpoint_interval < 0:
            raise ValueError("checkpoint_interval must be >= 0")


STORE_WRITE_POLICIES = ("write-through", "write-back")


def _arg(
    default: Any,
    help: str,
    choices: tuple[str, ...] | None = None,
    serve: bool = False,
    **spec: Any,
) -> Any:
    """An ``EngineArgs`` field that is a flag (``kvserve.flags``): its help, choices,
    whether only ``kvserve serve`` takes it (cluster flags mean nothing to
    ``generate``/``eval``) and ``FlagSpec``'s other keywords."""
    return flag(default, help, choices=choices, serve_only=serve, **spec)


@dataclass(frozen=True)
class EngineArgs:
    """Every engine option in one flat place; ``kvserve`` CLI flags are its field names.

    ``kv_cache_memory`` accepts a size string (``4GiB``) or bytes.
    """

    model: str = flag(
        help="HF model directory (config.json + safetensors) or a .gguf file",
        metavar="DIR",
        required=False,
    )
    dtype: str = _arg(
        "auto", "weights and activations; auto takes the checkpoint's", ("auto", *DTYPE_NAMES)
    )
    max_model_len: int | None = _arg(
        None, "longest prompt + output (default: the model's)", kind=int
    )
    device: str = _arg("auto", "auto (CUDA when available, else CPU), cpu, cuda, cuda:N")
    seed: int = _arg(0, "seed of the weights' random init (tests) and of default seeds")
    attention_backend: str = _arg(
        "auto",
        "cpu: C++ kernels; triton: Triton kernels (GPU); torch: portable SDPA; auto: cpu/triton",
        ATTENTION_BACKENDS,
    )
    enforce_eager: bool = _arg(False, "CUDA: no CUDA graphs; every step runs eagerly")
    batch_invariant: bool = _arg(
        False, "GPU: Triton GEMMs and norms, so output does not depend on the batch (slower)"
    )
    quantization: str = _arg(
        "auto",
        "auto: GGUF Q4_0/Q4_1/Q4_K/Q5_K/Q6_K/Q8_0 weights stay quantized on CPU; none: "
        "dequantize to --dtype; int8: also quantize a float checkpoint's matrices at load "
        "to int8 with a scale per output row, CPU only",
        QUANTIZATION_MODES,
    )
    block_size: int = _arg(16, "tokens per KV block")
    kv_cache_memory: int | str | None = _arg(
        None,
        "KV cache size (e.g. 4GiB); default: on CPU room for 32 sequences of max_model_len "
        "(at most 4 GiB), on CUDA what --gpu-memory-utilization leaves",
        kind=str,
    )
    gpu_memory_utilization: float = _arg(
        0.9, "on CUDA without --kv-cache-memory: the share of GPU memory to use"
    )
    kv_cache_dtype: str = _arg("auto", "KV cache element type", KV_CACHE_DTYPES)
    calculate_kv_scales: bool = _arg(False, "fp8 KV: per-head scales from the first batch")
    kv_cache_scales: str = _arg(
        "auto",
        "fp8 KV scales: token (per token and head), head (checkpoint / calculated / 1.0), "
        "auto: head when the checkpoint has scales or --calculate-kv-scales, else token",
        KV_CACHE_SCALES,
    )
    kv_cache_smooth_k: bool = _arg(
        True,
        "int8 / token-scale fp8 KV: store keys less their layer's mean key (calibrated at "
        "start on a text shipped with kvserve; softmax ignores the shift)",
    )
    enable_prefix_caching: bool = _arg(
        True, "share full KV blocks between equal prefixes", negative="--no-prefix-caching"
    )
    prefix_cache_isolation: str | None = _arg(
        None,
        "tenant: share prefix blocks only within a tenant; none: across tenants too (a "
        "shared cache tells, through TTFT, whether another tenant sent a prompt); default: "
        "tenant with --tenants, else none",
        PREFIX_CACHE_ISOLATION,
    )
    sliding_window: int | None = _arg(
        None, "attend to the last N tokens only (frees blocks)", kind=int
    )
    attention_sinks: int | None = _arg(
        None,
        "with a sliding window: first tokens always attended (default 4 with the flag)",
        kind=int,
    )
    swap_space: int | str = _arg("4GiB", "host memory for swapped-out KV (0: off)")
    kv_layout: str = _arg(
        "auto",
        "hybrid: a model with sliding and global layers keeps only the window's KV for the "
        "sliding ones (one block table per layer group); uniform: one table for all layers; "
        "auto: hybrid for such a model, else uniform",
        KV_LAYOUTS,
    )
    max_num_batched_tokens: int = _arg(2048, "token budget of one engine step")
    max_num_seqs: int = _arg(256, "most running sequences")
    enable_chunked_prefill: bool = _arg(True, "split long prompts over steps")
    preemption_mode: str = _arg(
        "auto", "swap, recompute, or auto (the measured cheaper one)", PREEMPTION_MODES
    )
    preemption_victim: str = _arg(
        "cost", "cost (cheapest to bring back) or latest (newest request)", PREEMPTION_VICTIMS
    )
    kv_usage_log: str | None = _arg(None, "append KV usage samples (JSONL) for kvserve plan")
    kv_usage_interval: float = _arg(10.0, "seconds between KV usage samples")
    kv_store: tuple[str, ...] = _arg(
        (),
        "a KV store tier (host://, file://, redis://, s3://); repeat in tier order",
        repeat=True,
        metavar="URL",
    )
    kv_store_write_policy: str = _arg(
        "write-through", "when full blocks go to the store", STORE_WRITE_POLICIES
    )
    kv_store_queue_size: int = _arg(1024, "blocks waiting for the store writer at most")
    kv_store_session_ttl: float = _arg(86400.0, "seconds a stored session (its tokens) lives")
    cluster: str | None = _arg(None, "the cluster's Redis (HA: registry, sessions)", serve=True)
    node_id: str | None = _arg(
        None, "this worker's id in the cluster (default host:pid)", serve=True
    )
    replicate_every: int = _arg(16, "tokens between session state replications", serve=True)
    replicate_to: tuple[str, ...] = _arg(
        (),
        "extra replication targets: standby, s3 (store is always on); repeat",
        serve=True,
        repeat=True,
        metavar="URL",
    )
    checkpoint_interval: float = _arg(30.0, "seconds between S3 checkpoints", serve=True)
    prewarm_device_fraction: float = _arg(
        0.1,
        "share of the KV pool that blocks pushed from other workers (standby push, a "
        "prefill worker's hand-over) may take as pre-warmed prefix blocks, evicted first; "
        "0: they go to the host tier only",
        serve=True,
    )
    kv_events_port: int | None = _arg(
        None,
        "publish KV events (block hashes stored/removed) on this ZeroMQ port, 0: any free "
        "one (default: any free one with --cluster, else off)",
        serve=True,
        kind=int,
    )
    tensor_parallel_size: int = _arg(1, "ranks (worker processes) that each hold a shard")
    distributed_init_method: str | None = _arg(
        None,
        "tcp://HOST:PORT of node 0 for the ranks' rendezvous (default: a local port)",
        serve=True,
    )
    nnodes: int = _arg(1, "machines the tensor-parallel ranks span", serve=True)
    node_rank: int = _arg(0, "this machine's index (0 runs the engine and API server)", serve=True)
    distributed_timeout: float = _arg(120.0, "seconds before a collective gives up")

    @property
    def kv_events_enabled(self) -> bool:
        """Does this engine log KV events (for the routers' prefix index)?"""
        return self.cluster is not None or self.kv_events_port is not None

    def model_config(self) -> ModelConfig:
        return ModelConfig(
            self.model,
            self.dtype,
            self.max_model_len,
            self.device,
            self.seed,
            self.attention_backend,
            self.enforce_eager,
            self.batch_invariant,
            self.quantization,
        )

    def cache_config(self) -> CacheConfig:
        mem = None if self.kv_cache_memory is None else parse_size(self.kv_cache_memory)
        return CacheConfig(
            self.block_size,
            mem,
            self.gpu_memory_utilization,
            self.kv_cache_dtype,
            self.calculate_kv_scales,
            self.enable_prefix_caching,
            self.prefix_cache_isolation or "none",
            self.sliding_window,
            self.attention_sinks,
            parse_size(self.swap_space),
            self.kv_cache_scales,
            self.kv_cache_smooth_k,
            self.kv_layout,
        )

    def scheduler_config(self) -> SchedulerConfig:
        return SchedulerConfig(
            self.max_num_batched_tokens,
            self.max_num_seqs,
            self.enable_chunked_prefill,
            self.preemption_mode,
            self.preemption_victim,
        )

    def store_config(self) -> StoreConfig:
        """The KV store tiers; in a cluster without ``--kv-store`` the cluster's Redis is
        the shared tier (replicated blocks must be reachable by the standbys)."""
        urls = tuple(self.kv_store) or ((self.cluster,) if self.cluster else ())
        return StoreConfig(
            urls,
            self.kv_store_write_policy,
            self.kv_store_queue_size,
            self.kv_store_session_ttl,
        )

    def replication_config(self) -> ReplicationConfig:
        targets = tuple(dict.fromkeys(("store", *self.replicate_to)))
        return ReplicationConfig(
            self.cluster, self.node_id, self.replicate_every, targets, self.checkpoint_interval
        )

    def parallel_config(self) -> ParallelConfig:
        """Flags win over torchrun-style environment variables where both are given."""
        values: dict[str, Any] = torchrun_env()
        given = {
            "distributed_init_method": self.distributed_init_method,
            "nnodes": self.nnodes if self.nnodes != 1 else None,
            "node_rank": self.node_rank if self.node_rank != 0 else None,
        }
        values.update({k: v for k, v in given.items() if v is not None})
        return ParallelConfig(
            tensor_parallel_size=self.tensor_parallel_size,
            distributed_timeout=self.distributed_timeout,
            **values,
        )

    def observability_config(self) -> ObservabilityConfig:
        return ObservabilityConfig(self.kv_usage_log, self.kv_usage_interval)

    @classmethod
    def add_cli_args(cls, parser: argparse.ArgumentParser, *, serve: bool = False) -> None:
        """One ``--flag`` per field (``max_num_seqs`` → ``--max-num-seqs``) with its help,
        default and choices (``kvserve.flags``); serve-only fields (the cluster's) only
        when ``serve``."""
        add_flags(parser, cls, serve=serve)

    @classmethod
    def from_cli(cls, ns: argparse.Namespace) -> EngineArgs:
        """The engine options of parsed flags (a command without the serve-only flags
        keeps their defaults)."""
        return from_flags(cls, ns)
