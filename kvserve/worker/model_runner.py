"""Runs one step on a rank: its request deltas, its copies, the forward pass over the
paged cache, the logits, and (on rank 0) sampling.

``ModelRunner`` is a rank's side of the door: it keeps its own copy of the requests
(``worker.requests``), applies each ``SchedulerOutput``'s deltas to it, and builds its
inputs from it (``worker.inputs``). In-process (without tensor parallelism) the engine
calls ``step`` directly; under tensor parallelism every rank's runner executes the same
published ``SchedulerOutput`` (``worker.executor``); the collectives inside the model
keep them in lockstep, and only rank 0 samples.
"""

from __future__ import annotations

import torch

from kvserve.model.llama import LlamaForCausalLM
from kvserve.sampling import argmax_only, sample, token_logprobs
from kvserve.sched.output import SchedulerOutput, StepResult
from kvserve.store.offloader import KVSave
from kvserve.store.tiered import TieredStore
from kvserve.worker.cuda_graphs import DecodeGraphs
from kvserve.worker.inputs import InputBuilder, StepInputs
from kvserve.worker.offload import KVTransfer
from kvserve.worker.requests import RankRequests
from kvserve.worker.swap import HostSwap


class ModelRunner:
    """Owns the KV tensors (and, through ``host_swap``, their host copies) and this
    rank's copy of the requests; executes ``SchedulerOutput``s: deltas, swaps and KV store
    loads, then the forward pass and sampling; after the step, ``save_blocks``.
    ``graphs`` runs the decode steps it can replay (``worker.cuda_graphs``)."""

    def __init__(
        self,
        model: LlamaForCausalLM,
        kv_caches: list[torch.Tensor],
        device: torch.device,
        builder: InputBuilder,
        graphs: DecodeGraphs | None = None,
        host_swap: HostSwap | None = None,
        kv_transfer: KVTransfer | None = None,
    ):
        """``builder``: this rank's inputs (on ``device``); ``host_swap``: copies of
        swapped-out blocks (with a swap space); ``kv_transfer``: block bytes to and from
        the KV store (with one)."""
        self.model = model
        self.kv_caches = kv_caches
        self.device = device
        self.builder = builder
        self.requests = RankRequests()
        self.graphs = graphs  # captured decode steps over kv_caches (CUDA)
        self.is_driver = model.tp is None or model.tp.rank == 0  # samples, returns results
        self.host_swap = host_swap
        self.kv_transfer = kv_transfer
        self.keep_logits = False  # tests set this to inspect raw logits
        self.last_logits: dict[str, torch.Tensor] = {}
        self.prompt_logits: dict[str, list[torch.Tensor]] = {}  # with keep_logits

    # ---- the engine side (in-process) -----------------------------------------------
    def step(self, out: SchedulerOutput) -> StepResult | None:
        """Execute ``out`` here (the in-process door); None when it schedules no tokens."""
        return self.execute(out)

    def swap_held(self) -> set[str]:
        """Request ids whose KV has a host copy here."""
        return set() if self.host_swap is None else self.host_swap.held()

    def request_copies(self) -> int:
        """How many requests this rank keeps a copy of (``check_integrity``)."""
        return len(self.requests)

    def close(self) -> None:
        """Nothing to release in-process (the executor's counterpart stops processes)."""

    def check_health(self) -> None:
        """Nothing can fail between steps in-process (the executor checks its ranks)."""

    # ---- the worker side --------------------------------------------------------------
    @torch.inference_mode()
    def execute(self, out: SchedulerOutput) -> StepResult | None:
        """The step's request deltas (``RankRequests.apply``), swap lists
        (``worker.swap.HostSwap``) and KV store loads (``worker.offload.KVTransfer``),
        then the forward pass of the inputs this rank builds. Returns the sampled tokens
        on the driver (rank 0); None on other ranks or when no tokens are scheduled."""
        self.requests.apply(out)
        if out.swap_out or out.swap_in or out.swap_drop:
            if self.host_swap is None:
                raise RuntimeError("swaps scheduled without a swap space")
            self.host_swap.apply(out)
        if out.kv_loads:
            if self.kv_transfer is None:
                raise RuntimeError("KV store loads scheduled without a KV store")
            self.kv_transfer.load(out.kv_loads)
        if out.is_empty:
            return None
        return self.run(self.builder.build(out, self.requests, self.is_driver))

    @torch.inference_mode()
    def save_blocks(self, saves: list[KVSave], store: TieredStore) -> int:
        """Serialize and store ``saves`` (blocks full after this step); returns their count."""
        if not saves or self.kv_transfer is None:
            return 0
        return self.kv_transfer.save(saves, store)

    @torch.inference_mode()
    def run(self, inputs: StepInputs) -> StepResult | None:
        """Forward ``inputs`` and sample (on the driver); does not modify any request."""
        if self.graphs is not None and self.graphs.eligible(inputs.input_ids, inputs.meta):
            hidden = self.graphs.run(inputs.input_ids, inputs.positions, inputs.meta)
        else:
            hidden = self.model(inputs.input_ids, inputs.positions, self.kv_caches, inputs.meta)
        logits = None
        if inputs.logit_rows.numel():
            argmax = self.is_driver and not inputs.prompt and not self.keep_logits
            argmax = argmax and argmax_only(inputs.rows)
            logits = self.model.compute_logits(hidden[inputs.logit_rows], argmax)
        if not self.is_driver:
            return None
        prompt_lps: dict[str, list[dict]] = {}
        for p in inputs.prompt:
            assert logits is not None
            rows = logits[p.offset : p.offset + len(p.targets)]
            if self.keep_logits:
                self.prompt_logits.setdefault(p.request_id, []).append(rows.clone())
            prompt_lps[p.request_id] = token_logprobs(rows, p.targets, p.num_logprobs)
        if not inputs.sampled:
            return StepResult({}, {}, prompt_lps)
        assert logits is not None
        sample_logits = logits[logits.shape[0] - len(inputs.sampled) :]
        result = sample(sample_logits, inputs.rows)
        ids = inputs.sampled
        if self.keep_logits:
            self.last_logits = {r: sample_logits[i].clone() for i, r in enumerate(ids)}
        tokens = dict(zip(ids, result.token_ids, strict=True))
        logprobs = {r: lp for r, lp in zip(ids, result.logprobs, strict=True) if lp is not None}
        return StepResult(tokens, logprobs, prompt_lps)
