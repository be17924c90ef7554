"""LLMEngine: owns model, KV cache, scheduler; ``step()`` = schedule → run → postprocess."""

from __future__ import annotations

import logging
import random
import time
from collections.abc import Sequence
from typing import Any

import torch

from kvserve.config import CacheConfig, EngineArgs, ModelConfig, SchedulerConfig
from kvserve.engine import kv_metrics
from kvserve.engine.cpu_env import tune_malloc
from kvserve.engine.errors import EngineError
from kvserve.engine.messages import FINISH_ABORT, EngineCoreOutput
from kvserve.engine.model_runner import ModelRunner
from kvserve.engine.stats import EngineStats, KVStats
from kvserve.ha.record import SessionRecord
from kvserve.kv.cache import KVCacheSpec
from kvserve.kv.hashing import model_fingerprint
from kvserve.kv.manager import KVCacheManager
from kvserve.kv.offload import KVOffloader
from kvserve.kv.quant import kv_format
from kvserve.kv.swap import SwapSpace
from kvserve.kv.tenant_ledger import Budget
from kvserve.model.attention import (
    CPU_KERNEL_HEAD_DIMS,
    AttentionMetadata,
    CpuPagedAttention,
    PrefillChunk,
    TorchPagedAttention,
)
from kvserve.model.cpu_kernels import load_cpu_kernels
from kvserve.model.llama import LlamaForCausalLM
from kvserve.model.loader import load_kv_scales, load_model, resolve_dtype
from kvserve.model.ops import CpuKernelOps, TorchOps
from kvserve.model.spec import ModelSpec, load_model_spec
from kvserve.model.tokenizer import Tokenizer, load_tokenizer
from kvserve.planner.usage import UsageRecorder
from kvserve.request import Request, RequestStatus
from kvserve.sampling import SamplingParams
from kvserve.sched.cost import PreemptionCostModel, attention_pairs
from kvserve.sched.scheduler import Scheduler
from kvserve.utils import cdiv, format_size, resolve_device

logger = logging.getLogger("kvserve")

_CPU_DEFAULT_KV_MEMORY = 4 * 1024**3


class LLMEngine:
    """Synchronous engine. Not thread-safe: one caller drives ``add_request``/``step``."""

    def __init__(self, args: EngineArgs):
        self.model_config: ModelConfig = args.model_config()
        self.cache_config: CacheConfig = args.cache_config()
        self.scheduler_config: SchedulerConfig = args.scheduler_config()
        self.device = resolve_device(self.model_config.device)
        if self.device.type == "cpu":
            tune_malloc()
        torch.manual_seed(self.model_config.seed)
        self._rng = random.Random(self.model_config.seed)
        self.spec: ModelSpec = load_model_spec(self.model_config.model)
        self.tokenizer: Tokenizer | None = load_tokenizer(self.model_config.model)
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
            self.model_config.model,
            self.spec,
            self.dtype,
            self.device,
            backend,
            ops,
            self.max_model_len,
        )
        self.kv_format = kv_format(self.cache_config.kv_cache_dtype, self.dtype)
        self.kv_spec = KVCacheSpec.for_format(
            self.spec.num_layers,
            self.spec.num_kv_heads,
            self.spec.head_dim,
            self.kv_format,
            self.cache_config.block_size,
        )
        num_blocks = self._num_blocks()
        self.model_fingerprint = model_fingerprint(self.model_config.model)
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
        self.runner = ModelRunner(
            self.model,
            self._allocate_kv(num_blocks),
            self.kv,
            self.device,
            self.window,
            self.attention_sinks,
        )
        self.cost_model = PreemptionCostModel(self.kv_spec.bytes_per_token)
        self.cost_model.calibrate_copy(self.device)
        self.swap = None
        if self.cache_config.swap_space and self.scheduler_config.preemption_mode != "recompute":
            self.swap = SwapSpace(
                self.runner.kv_caches,
                self.kv.block_size,
                self.kv_spec.bytes_per_block,
                self.cache_config.swap_space,
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
        self.requests: dict[str, Request] = {}
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
        return KVOffloader(
            store,
            self.runner.kv_caches,
            self.kv,
            self.model_fingerprint,
            self.kv_format.name,
            store_config.session_ttl,
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

    def close(self) -> None:
        """Flush and close the KV store and replication (if any). The engine is unusable
        afterwards."""
        if self.replicator is not None:
            self.replicator.close()
        if self.prewarmer is not None:
            self.prewarmer.close()
        if self.offloader is not None:
            self.offloader.close()

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
            scales = load_kv_scales(self.model_config.model, self.spec.num_layers)
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
        if mem is None:
            mem = _CPU_DEFAULT_KV_MEMORY
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

    # ---- requests -------------------------------------------------------------------
    def tokenize(self, prompt: str) -> list[int]:
        if self.tokenizer is None:
            raise EngineError(
                f"{self.model_config.model} has no tokenizer.json; pass prompt token ids"
            )
        return self.tokenizer.encode(prompt)

    def _eos_token_ids(self) -> tuple[int, ...]:
        """EOS ids from config.json and the tokenizer (computed once at start)."""
        ids = set(self.spec.eos_token_ids)
        if self.tokenizer is not None and self.tokenizer.eos_token_id is not None:
            ids.add(self.tokenizer.eos_token_id)
        return tuple(sorted(ids))

    def add_request(
        self,
        request_id: str,
        prompt: str | Sequence[int],
        params: SamplingParams,
        seed: int | None = None,
        *,
        tenant: str = "default",
        cache_salt: str | None = None,
        priority: int = 0,
        session_id: str | None = None,
        session_epoch: int | None = None,
        ephemeral_session: bool = False,
        standby: str | None = None,
    ) -> Request:
        """Validate and queue one sequence. Raises EngineError for what can never be served.

        ``cache_salt`` restricts prefix-cache sharing to requests with the same salt; with
        ``prefix_cache_isolation`` ``tenant`` the tenant name is part of the salt too.
        In a cluster the session is claimed for this node, only if still at
        ``session_epoch`` when given (the epoch the router saw; else the request is
        fenced and aborted). An ``ephemeral_session`` (an id a router made up for a request
        that had none) is replicated while it runs and released when it ends. ``standby``:
        the node that would continue the session (it is told to pre-warm its KV).
        """
        req = self._build_request(
            request_id, prompt, params, seed, tenant, self._salt(tenant, cache_salt), priority
        )
        req.session_id = session_id
        req.session_ephemeral = ephemeral_session and session_id is not None
        req.standby = standby
        self._queue(req, session_epoch)
        return req

    def resume_request(
        self,
        request_id: str,
        record: SessionRecord,
        delivered: Sequence[int],
        seen_epoch: int | None = None,
    ) -> Request:
        """Continue a stream another node started (failover). ``record`` is the session
        state the primary replicated (``ha.record.SessionRecord``); ``delivered`` are
        the output tokens the client already has. They become this request's output so
        far: generation continues at the next position with the same (seed, position)
        draws. The prefix whose KV was stored is restored from the KV store (bit-exact
        copies of the primary's blocks) and the rest recomputed the way the primary
        computed it — the prompt's remainder in one prefill chunk, each delivered token in
        a decode step — so the stream goes on exactly as it would have (with batch-
        invariant matmuls, as bf16 on CPU is; float32 matmuls may round differently at
        different batch sizes). With a cluster the
        session is taken over (conditionally on ``seen_epoch``). Raises EngineError when
        the record does not fit this engine or another node took the session first."""
        req = self._build_request(
            request_id,
            record.prompt_token_ids,
            record.params,
            record.seed,
            record.tenant,
            record.cache_salt,
            0,
        )
        bad = [t for t in delivered if not 0 <= int(t) < self.spec.vocab_size]
        if bad or len(delivered) >= req.max_tokens:
            raise EngineError("delivered tokens outside the vocabulary or past max_tokens")
        req.output_token_ids = [int(t) for t in delivered]
        # recompute like the primary did (see Request.replay): restore stored blocks only
        # if they cover the prompt's end, else exactly the prefix it had from its cache
        req.replay = True
        if record.prefill_from is not None:
            stored, prompt = record.stored_tokens, req.num_prompt_tokens
            bs = self.kv.block_size
            req.restore_limit = stored if stored >= prompt else record.prefill_from // bs * bs
        req.session_id = record.session_id
        req.session_ephemeral = record.ephemeral
        self._queue(req, seen_epoch, claim_now=True)
        return req

    def _queue(self, req: Request, seen_epoch: int | None = None, claim_now: bool = False) -> None:
        replicated = self.replicator is not None and req.session_id is not None
        if replicated:
            try:
                won = self.replicator.start(req, seen_epoch, claim_now)
            except Exception as e:  # the coordinator (Redis) is unreachable
                raise EngineError(f"cannot take session {req.session_id!r} over: {e}") from None
            if not won:
                raise EngineError(f"session {req.session_id!r} was taken over by another node")
        self.requests[req.request_id] = req
        self.scheduler.add(req)

    def _build_request(
        self,
        request_id: str,
        prompt: str | Sequence[int],
        params: SamplingParams,
        seed: int | None,
        tenant: str,
        salt: str | None,
        priority: int,
    ) -> Request:
        """A validated request (not queued); raises EngineError."""
        if request_id in self.requests:
            raise EngineError(f"request id {request_id!r} is already in use")
        text = prompt if isinstance(prompt, str) else None
        ids = self.tokenize(prompt) if isinstance(prompt, str) else [int(t) for t in prompt]
        if not ids:
            raise EngineError("the prompt is empty")
        bad = [t for t in ids if not 0 <= t < self.spec.vocab_size]
        if bad:
            raise EngineError(
                f"prompt token id {bad[0]} is outside the vocabulary [0, {self.spec.vocab_size})"
            )
        room = self.max_model_len - len(ids)
        max_tokens = params.max_tokens if params.max_tokens is not None else room
        if len(ids) + max_tokens > self.max_model_len:
            raise EngineError(
                f"this model's maximum context length is {self.max_model_len} tokens; the "
                f"request has {len(ids)} prompt tokens + max_tokens {max_tokens} = "
                f"{len(ids) + max_tokens}"
            )
        if not self.kv.can_ever_fit(len(ids) + max_tokens):
            raise EngineError(
                f"the request needs {self.kv.blocks_needed(len(ids) + max_tokens)} KV blocks, "
                f"the whole cache has {self.kv.num_blocks}"
            )
        tenant_limit = self.kv.ledger.limit(tenant)
        if self.kv.blocks_needed(len(ids) + max_tokens) > tenant_limit:
            raise EngineError(
                f"the request needs {self.kv.blocks_needed(len(ids) + max_tokens)} KV blocks "
                f"({len(ids)} prompt tokens + max_tokens {max_tokens}), more than tenant "
                f"{tenant!r}'s limit of {tenant_limit} blocks"
            )
        req_seed = seed if seed is not None else params.seed
        if req_seed is None:
            req_seed = self._rng.getrandbits(63)
        req = Request(
            request_id=request_id,
            prompt_token_ids=ids,
            params=params,
            seed=req_seed,
            max_tokens=max_tokens,
            eos_token_ids=self.eos_token_ids,
            prompt=text,
            cache_salt=salt,
            tenant=tenant,
            priority=priority,
        )
        return req

    def _salt(self, tenant: str, cache_salt: str | None) -> str | None:
        parts = []
        if self.cache_config.prefix_cache_isolation == "tenant":
            parts.append(f"tenant={tenant}")
        if cache_salt is not None:
            parts.append(f"salt={cache_salt}")
        return "|".join(parts) or None

    def abort_request(self, request_id: str) -> None:
        """Stop a request and free its blocks at once; no-op for unknown/finished ids."""
        req = self.requests.pop(request_id, None)
        if req is not None and not req.is_finished:
            self.scheduler.finish(req, RequestStatus.FINISHED_ABORTED)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished()

    # ---- the loop -------------------------------------------------------------------
    def step(self) -> list[EngineCoreOutput]:
        """Run one batch. Returns a delta for every request that got a token or finished
        (text is the client's job: ``engine.output.OutputProcessor``)."""
        fenced = self._drop_fenced()
        sched = self.scheduler.schedule()
        self.peak_usage.record(self.kv.pool.num_used / self.kv.num_blocks)
        if self.usage_recorder is not None and self.usage_recorder.due():
            self.usage_recorder.maybe_record(
                self.kv.pool.num_used,
                self.kv.num_blocks,
                self.kv_spec.bytes_per_block,
                self.tenant_blocks(),
            )
        if sched.is_empty:
            return fenced
        t0 = time.perf_counter()
        result = self.runner.run(sched.scheduled)
        self.cost_model.observe_step(
            sched.num_tokens,
            attention_pairs(
                [(s.request.num_computed_tokens, s.num_new_tokens) for s in sched.scheduled]
            ),
            time.perf_counter() - t0,
        )
        outputs = fenced
        starts = []
        for s in sched.scheduled:
            starts.append(s.request.num_computed_tokens)
            s.request.num_computed_tokens += s.num_new_tokens
            self.kv.cache_full_blocks(s.request)
        if self.offloader is not None:  # before a sliding window frees any block
            self.offloader.save([s.request for s in sched.scheduled])
        for s, start in zip(sched.scheduled, starts, strict=True):
            req = s.request
            if self.window is not None:
                self.kv.free_outside_window(req, self.window, self.attention_sinks)
            plp = result.prompt_logprobs.get(req.request_id)
            if plp is not None:  # entries for positions start+1 …; a recompute overwrites
                if not req.prompt_logprobs:
                    req.prompt_logprobs.append(None)  # the first token has no context
                req.prompt_logprobs[start + 1 : start + 1 + len(plp)] = plp
            token = result.tokens.get(req.request_id)
            if token is None:
                continue
            first = not req.output_token_ids
            req.output_token_ids.append(token)
            lp = result.logprobs.get(req.request_id)
            if lp is not None:
                req.output_logprobs.append(lp)
            self._check_stop(req, token)
            self._after_token(req)
            outputs.append(
                EngineCoreOutput(
                    req.request_id,
                    [token],
                    [lp] if lp is not None else None,
                    req.status.value if req.is_finished else None,
                    req.stop_reason,
                    req.num_cached_tokens,
                    req.prompt_logprobs
                    if first and req.params.prompt_logprobs is not None
                    else None,
                )
            )
        return outputs

    def _after_token(self, req: Request) -> None:
        """Session bookkeeping after ``req`` got a token (or finished)."""
        if req.is_finished and req.session_id is not None and self.offloader is not None:
            self.offloader.record_session(req)
        if self.replicator is not None and req.session_id is not None:
            self.replicator.after_step(req)
        if req.is_finished:
            self.requests.pop(req.request_id, None)

    def finish_request(self, request_id: str, num_output_tokens: int) -> None:
        """A stop string ended the request after ``num_output_tokens`` output tokens (the
        client saw it in the text): drop any tokens generated past them and finish it as
        stopped — its session record and replication end as for a stop token. No-op for
        unknown or finished ids."""
        req = self.requests.get(request_id)
        if req is None or req.is_finished:
            return
        del req.output_token_ids[num_output_tokens:]
        del req.output_logprobs[num_output_tokens:]
        req.num_computed_tokens = min(req.num_computed_tokens, req.num_tokens)
        self.scheduler.finish(req, RequestStatus.FINISHED_STOPPED)
        self._after_token(req)

    def _drop_fenced(self) -> list[EngineCoreOutput]:
        """Abort requests whose session another node took over; their final deltas."""
        if self.replicator is None or not self.replicator.any_fenced():
            return []
        out = []
        for req in list(self.requests.values()):
            if req.session_id is not None and self.replicator.fenced(req.session_id):
                logger.warning(
                    "request %s: session %s fenced; dropped", req.request_id, req.session_id
                )
                self.scheduler.finish(req, RequestStatus.FINISHED_ABORTED)
                self.requests.pop(req.request_id, None)
                out.append(EngineCoreOutput(req.request_id, [], finish_reason=FINISH_ABORT))
        return out

    def _check_stop(self, req: Request, token: int) -> None:
        """Token-level stops (stop token ids, EOS after ``min_tokens``) and length; stop
        strings are checked on the text by the client."""
        p = req.params
        n_out = len(req.output_token_ids)
        status: RequestStatus | None = None
        if n_out >= p.min_tokens:
            if token in p.stop_token_ids:
                status, req.stop_reason = RequestStatus.FINISHED_STOPPED, token
            elif not p.ignore_eos and token in req.eos_token_ids:
                status = RequestStatus.FINISHED_STOPPED
        if status is None and (n_out >= req.max_tokens or req.num_tokens >= self.max_model_len):
            status = RequestStatus.FINISHED_LENGTH
        if status is not None:
            self.scheduler.finish(req, status)

    def tenant_blocks(self) -> dict[str, int]:
        """KV blocks charged to each tenant (the ledger's rule: every distinct block its
        requests hold, a block shared across tenants counting for each), so the tenants
        may sum to more than the pool's used blocks."""
        return {t: n for t, n in self.kv.ledger.usages().items() if n}

    def set_tenant_budgets(self, budgets: dict[str, Budget]) -> None:
        """Apply tenants' reservations and limits (at start or on a reload). Running
        requests keep their blocks; a tenant above a lowered limit takes no more until it
        is back under it (its own requests are preempted as they need blocks)."""
        self.kv.ledger.set_budgets(budgets)

    def check_integrity(self) -> None:
        """Raise AssertionError if KV bookkeeping is inconsistent (tests call this)."""
        self.kv.check_integrity()
        if self.swap is not None:
            self.swap.check_integrity()
        live = {r.request_id for r in self.scheduler.running + self.scheduler.loading}
        if self.kv.num_requests() > len(live):
            raise AssertionError("blocks are held by requests that are not running")

    def metrics_snapshot(self) -> KVStats:
        """KV metrics (watermarks, fragmentation, tenants, preemptions, swap, store,
        replication); call on the engine's thread."""
        return kv_metrics.snapshot(self)

    def stats(self) -> EngineStats:
        """Queue lengths, pool occupancy and prefix-cache counters (cheap: every step)."""
        kv, sched = self.kv, self.scheduler
        return EngineStats(
            running=len(sched.running),
            waiting=len(sched.waiting),
            kv_blocks_used=kv.pool.num_used,
            kv_blocks_total=kv.num_blocks,
            kv_blocks_cached_free=kv.pool.num_cached_free,
            kv_block_bytes=self.kv_spec.bytes_per_block,
            prefix_cache_queries=kv.stats.queries,
            prefix_cache_hits=kv.stats.hits,
            num_preemptions=sched.num_preemptions,
        )

    def info(self) -> dict[str, Any]:
        return {
            "bytes_per_token": self.kv_spec.bytes_per_token,
            "num_blocks": self.kv.num_blocks,
            "block_size": self.kv.block_size,
            "max_model_len": self.max_model_len,
            "kv_cache_dtype": self.kv_format.name,
            "sliding_window": self.window,
            "attention_sinks": self.attention_sinks,
            "prefix_cache_queries": self.kv.stats.queries,
            "prefix_cache_hits": self.kv.stats.hits,
            "prefix_cache_hit_rate": self.kv.stats.hit_rate,
        }
