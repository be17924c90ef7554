"""Turns a scheduled batch into tensors, runs the model over the paged cache, samples.

Batch token order: every request with exactly one new token (decodes) first, then the
prefill chunks. ``run`` returns one sampled token per request whose chunk reaches the end
of its known tokens; a partial prefill chunk samples nothing. Requests that asked for
``prompt_logprobs`` also get the log-probabilities of the prompt tokens their chunk covers.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from kvserve.kv.manager import KVCacheManager
from kvserve.kv.offload import KVSave
from kvserve.model.attention import AttentionMetadata, PrefillChunk
from kvserve.model.llama import LlamaForCausalLM
from kvserve.request import Request
from kvserve.sampling import SampleRow, sample, token_logprobs
from kvserve.sched.scheduler import ScheduledRequest, SchedulerOutput
from kvserve.store.tiered import TieredStore
from kvserve.worker.offload import KVTransfer
from kvserve.worker.swap import HostSwap


@dataclass
class BatchInputs:
    """Model inputs for one step; ``sample_rows[i]`` is the hidden row of ``sampled[i]``."""

    input_ids: torch.Tensor
    positions: torch.Tensor
    meta: AttentionMetadata
    sample_rows: list[int]
    sampled: list[Request]
    # prompt logprobs: (request, first row, targets) — rows first..first+len(targets)-1
    prompt_rows: list[tuple[Request, int, list[int]]]


@dataclass
class StepResult:
    """Sampled tokens (and optional logprobs) keyed by request id."""

    tokens: dict[str, int]
    logprobs: dict[str, dict]
    prompt_logprobs: dict[str, list[dict]] = field(default_factory=dict)


class ModelRunner:
    """Owns the KV tensors (and, through ``host_swap``, their host copies); executes a
    ``SchedulerOutput``: its swaps and KV store loads (``apply_copies``), then its batch
    (``run``: metadata, forward, sampling); after the step, ``save_blocks``."""

    def __init__(
        self,
        model: LlamaForCausalLM,
        kv_caches: list[torch.Tensor],
        kv: KVCacheManager,
        device: torch.device,
        sliding_window: int | None,
        attention_sinks: int = 0,
    ):
        self.model = model
        self.kv_caches = kv_caches
        self.kv = kv
        self.device = device
        self.block_size = kv.block_size
        self.window = sliding_window
        self.sinks = attention_sinks if sliding_window is not None else 0
        self.host_swap: HostSwap | None = None  # with a swap space (the builder sets it)
        self.kv_transfer: KVTransfer | None = None  # with a KV store (the builder sets it)
        # dense masks for the SDPA backend; the paged kernel reads the sequence fields only
        self.dense_masks = getattr(model.layers[0].self_attn.backend, "dense_masks", True)
        self.keep_logits = False  # tests set this to inspect raw logits
        self.last_logits: dict[str, torch.Tensor] = {}
        self.prompt_logits: dict[str, list[torch.Tensor]] = {}  # with keep_logits

    def _slots(self, table: torch.Tensor, start: int, end: int) -> torch.Tensor:
        pos = torch.arange(start, end)
        return table[pos // self.block_size] * self.block_size + pos % self.block_size

    def _prefill_mask(self, computed: int, n: int) -> torch.Tensor | None:
        if computed == 0 and self.window is None:
            return None
        q_pos = torch.arange(computed, computed + n).unsqueeze(1)
        k_pos = torch.arange(computed + n).unsqueeze(0)
        mask = k_pos <= q_pos
        if self.window is not None:
            mask &= (k_pos > q_pos - self.window) | (k_pos < self.sinks)
        return mask.view(1, 1, n, computed + n).to(self.device)

    def build(self, batch: list[ScheduledRequest]) -> BatchInputs:
        """Tensors and metadata for ``batch`` (already in decodes-first order)."""
        ids: list[int] = []
        # decodes (first in the batch) as plain ints; prefill chunks as tensors
        decode_pos: list[int] = []
        decode_slots: list[int] = []
        prefill_pos: list[torch.Tensor] = []
        prefill_slots: list[torch.Tensor] = []
        tables: list[list[int]] = []  # every sequence's, decodes first (the batch order)
        seq_lens: list[int] = []
        query_start = [0]
        prefills: list[PrefillChunk] = []
        sample_rows: list[int] = []
        sampled: list[Request] = []
        prompt_rows: list[tuple[Request, int, list[int]]] = []
        bs = self.block_size
        for s in batch:
            req, n = s.request, s.num_new_tokens
            start = req.num_computed_tokens
            table_list = self.kv.block_table(req.request_id)
            tok_start = len(ids)
            ids.extend(req.token_slice(start, start + n))
            tables.append(table_list)
            seq_lens.append(start + n)
            query_start.append(len(ids))
            if n == 1:
                decode_pos.append(start)
                decode_slots.append(table_list[start // bs] * bs + start % bs)
            else:
                table = torch.tensor(table_list, dtype=torch.long)
                prefill_pos.append(torch.arange(start, start + n))
                prefill_slots.append(self._slots(table, start, start + n))
                if self.dense_masks:  # the SDPA backend's per-chunk description
                    prefills.append(
                        PrefillChunk(
                            tok_start,
                            tok_start + n,
                            start + n,
                            None if start == 0 else table.to(self.device),
                            self._prefill_mask(start, n),
                        )
                    )
            if req.params.prompt_logprobs is not None and start < req.num_prompt_tokens - 1:
                last = min(start + n, req.num_prompt_tokens - 1)
                prompt_rows.append((req, tok_start, req.prompt_token_ids[start + 1 : last + 1]))
            if start + n == req.num_tokens:
                sample_rows.append(len(ids) - 1)
                sampled.append(req)
        positions = torch.cat([torch.tensor(decode_pos, dtype=torch.long), *prefill_pos])
        meta = AttentionMetadata(
            slot_mapping=torch.cat(
                [torch.tensor(decode_slots, dtype=torch.long), *prefill_slots]
            ).to(self.device),
            max_position=int(positions.max()),
            num_decodes=len(decode_pos),
        )
        if not self.dense_masks:
            meta.seq_block_tables = self._padded(tables)
            meta.seq_lens = torch.tensor(seq_lens, dtype=torch.long, device=self.device)
            meta.query_start = torch.tensor(query_start, dtype=torch.long, device=self.device)
        elif decode_pos:
            decode_lens = [p + 1 for p in decode_pos]
            meta.decode_block_tables, meta.decode_mask = self._decode_meta(
                tables[: len(decode_pos)], decode_lens
            )
            meta.decode_lens = torch.tensor(decode_lens, dtype=torch.long, device=self.device)
        meta.prefills = prefills
        return BatchInputs(
            torch.tensor(ids, dtype=torch.long, device=self.device),
            positions.to(self.device),
            meta,
            sample_rows,
            sampled,
            prompt_rows,
        )

    def _padded(self, tables: list[list[int]]) -> torch.Tensor:
        """``[len(tables), longest]`` int64 block tables, 0-padded, on the device."""
        width = max(len(t) for t in tables)
        rows = [t + [0] * (width - len(t)) for t in tables]
        return torch.tensor(rows, dtype=torch.long, device=self.device)

    def _decode_meta(
        self, tables: list[list[int]], lens: list[int]
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        padded = self._padded(tables)
        max_len = padded.shape[1] * self.block_size
        pos = torch.arange(max_len).unsqueeze(0)
        lens_t = torch.tensor(lens).unsqueeze(1)
        mask = pos < lens_t
        if self.window is not None:
            mask &= (pos > (lens_t - 1 - self.window)) | (pos < self.sinks)
        need_mask = self.window is not None or any(n != max_len for n in lens)
        mask_t = mask.view(len(lens), 1, 1, max_len).to(self.device) if need_mask else None
        return padded, mask_t

    @torch.inference_mode()
    def apply_copies(self, out: SchedulerOutput) -> None:
        """The swap lists of ``out`` (``worker.swap.HostSwap``), then its KV store loads
        (``worker.offload.KVTransfer``), before its batch runs."""
        if out.swap_out or out.swap_in or out.swap_drop:
            if self.host_swap is None:
                raise RuntimeError("swaps scheduled without a swap space")
            self.host_swap.apply(out)
        if out.kv_loads:
            if self.kv_transfer is None:
                raise RuntimeError("KV store loads scheduled without a KV store")
            self.kv_transfer.load(out.kv_loads)

    @torch.inference_mode()
    def save_blocks(self, saves: list[KVSave], store: TieredStore) -> int:
        """Serialize and store ``saves`` (blocks full after this step); returns their count."""
        if not saves or self.kv_transfer is None:
            return 0
        return self.kv_transfer.save(saves, store)

    @torch.inference_mode()
    def run(self, batch: list[ScheduledRequest]) -> StepResult:
        """Forward ``batch`` and sample; does not modify the requests."""
        inputs = self.build(sorted(batch, key=lambda s: s.num_new_tokens != 1))
        hidden = self.model(inputs.input_ids, inputs.positions, self.kv_caches, inputs.meta)
        prompt_lps = self._prompt_logprobs(hidden, inputs.prompt_rows)
        sampled = inputs.sampled
        if not sampled:
            return StepResult({}, {}, prompt_lps)
        logits = self.model.compute_logits(hidden[inputs.sample_rows])
        result = sample(logits, [self._row(r) for r in sampled])
        if self.keep_logits:
            self.last_logits = {r.request_id: logits[i].clone() for i, r in enumerate(sampled)}
        tokens = {r.request_id: t for r, t in zip(sampled, result.token_ids, strict=True)}
        logprobs = {
            r.request_id: lp
            for r, lp in zip(sampled, result.logprobs, strict=True)
            if lp is not None
        }
        return StepResult(tokens, logprobs, prompt_lps)

    def _prompt_logprobs(
        self, hidden: torch.Tensor, rows: list[tuple[Request, int, list[int]]]
    ) -> dict[str, list[dict]]:
        out: dict[str, list[dict]] = {}
        for req, first, targets in rows:
            logits = self.model.compute_logits(hidden[first : first + len(targets)]).float()
            if self.keep_logits:
                self.prompt_logits.setdefault(req.request_id, []).append(logits.clone())
            out[req.request_id] = token_logprobs(logits, targets, req.params.prompt_logprobs or 0)
        return out

    @staticmethod
    def _row(req: Request) -> SampleRow:
        params = req.params
        suppress: tuple[int, ...] = ()
        if len(req.output_token_ids) < params.min_tokens:
            eos = () if params.ignore_eos else req.eos_token_ids
            suppress = tuple(set(eos) | set(params.stop_token_ids or ()))
        return SampleRow(params, req.seed, req.num_tokens, suppress)
