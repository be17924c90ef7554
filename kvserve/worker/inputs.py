"""One step's model inputs, built by each rank from its own copy of the requests.

``InputBuilder.build`` turns a step's ``SchedulerOutput`` (which requests compute how
many tokens) and the rank's ``RankRequests`` (their tokens and block tables) into a
``StepInputs``: token ids, positions, attention metadata and which hidden rows need
logits, with every per-request detail the sampler needs (request ids, ``SampleRow``s,
prompt-logprob targets). Every rank builds the same inputs from the same outputs (the
sampler's rows only on rank 0, which samples).

Batch token order: every request with exactly one new token (decodes) first, then the
prefill chunks. A request is sampled when its chunk reaches the end of its known tokens;
a partial prefill chunk samples nothing.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from kvserve.model.attention import AttentionMetadata, PrefillChunk, visible
from kvserve.sampling import SampleRow
from kvserve.sched.output import SchedulerOutput
from kvserve.worker.requests import RankRequests


@dataclass
class PromptRows:
    """Prompt logprobs of one request: logits rows ``offset`` … ``offset+len(targets)-1``
    of the step's ``logit_rows`` score ``targets``, with the top ``num_logprobs``."""

    request_id: str
    offset: int
    targets: list[int]
    num_logprobs: int


@dataclass
class StepInputs:
    """Everything a rank needs for one forward pass and its sampling."""

    input_ids: torch.Tensor
    positions: torch.Tensor
    meta: AttentionMetadata
    logit_rows: torch.Tensor  # hidden rows that need logits: prompt rows, then sampled rows
    prompt: list[PromptRows]
    sampled: list[str]  # request ids of the last len(sampled) logit rows
    rows: list[SampleRow]  # the sampler's view of each of them


@dataclass
class _SharedMeta:
    """What every group's metadata of one step shares."""

    max_position: int
    num_decodes: int
    seq_lens: torch.Tensor
    query_start: torch.Tensor
    decode_lens: list[int]
    decode_mask: torch.Tensor | None  # the SDPA backend's (every group's tables one length)


class InputBuilder:
    """Builds ``StepInputs`` on ``device`` (a rank's side of the door)."""

    def __init__(
        self,
        block_size: int,
        device: torch.device,
        sliding_window: int | None,
        attention_sinks: int,
        dense_masks: bool,
    ):
        self.device = device
        self.block_size = block_size
        self.window = sliding_window
        self.sinks = attention_sinks if sliding_window is not None else 0
        # dense masks for the SDPA backend; the paged kernel reads the sequence fields only
        self.dense_masks = dense_masks

    def _slots(self, table: torch.Tensor, start: int, end: int) -> torch.Tensor:
        pos = torch.arange(start, end)
        return table[pos // self.block_size] * self.block_size + pos % self.block_size

    def _prefill_mask(self, computed: int, n: int) -> torch.Tensor | None:
        if computed == 0 and self.window is None:
            return None
        q_pos = torch.arange(computed, computed + n).unsqueeze(1)
        mask = visible(q_pos, torch.arange(computed + n).unsqueeze(0), self.window, self.sinks)
        return mask.view(1, 1, n, computed + n).to(self.device)

    def build(
        self, out: SchedulerOutput, requests: RankRequests, sample_rows: bool = True
    ) -> StepInputs:
        """Inputs for ``out``'s scheduled requests, as ``requests`` knows them (decodes
        first); ``sample_rows``: build the sampler's rows (rank 0; others leave them
        empty). In the hybrid KV layout the metadata has one copy per group
        (``AttentionMetadata.groups``), each over that group's block tables; masks and
        lengths are shared."""
        batch = sorted(out.num_scheduled_tokens.items(), key=lambda s: s[1] != 1)
        groups = len(requests[batch[0][0]].block_ids)
        ids: list[int] = []
        decode_pos: list[int] = []
        prefill_pos: list[torch.Tensor] = []
        seq_lens: list[int] = []
        query_start = [0]
        logit_rows: list[int] = []
        sampled: list[str] = []
        rows: list[SampleRow] = []
        prompt_rows: list[int] = []
        prompt: list[PromptRows] = []
        # per group: every sequence's table (decodes first, the batch order) and slots
        tables: list[list[list[int]]] = [[] for _ in range(groups)]
        decode_slots: list[list[int]] = [[] for _ in range(groups)]
        prefill_slots: list[list[torch.Tensor]] = [[] for _ in range(groups)]
        prefills: list[list[PrefillChunk]] = [[] for _ in range(groups)]
        bs = self.block_size
        for rid, n in batch:
            req = requests[rid]
            start = req.num_computed_tokens
            group_tables = req.block_ids
            tok_start = len(ids)
            ids.extend(req.token_ids[start : start + n])
            seq_lens.append(start + n)
            query_start.append(len(ids))
            for g, table_list in enumerate(group_tables):
                tables[g].append(table_list)
            if n == 1:
                decode_pos.append(start)
                for g, table_list in enumerate(group_tables):
                    decode_slots[g].append(table_list[start // bs] * bs + start % bs)
            else:
                prefill_pos.append(torch.arange(start, start + n))
                mask = self._prefill_mask(start, n) if self.dense_masks else None
                for g, table_list in enumerate(group_tables):
                    table = torch.tensor(table_list, dtype=torch.long)
                    prefill_slots[g].append(self._slots(table, start, start + n))
                    if self.dense_masks:  # the SDPA backend's per-chunk description
                        context = None if start == 0 else table.to(self.device)
                        prefills[g].append(
                            PrefillChunk(tok_start, tok_start + n, start + n, context, mask)
                        )
            k = req.params.prompt_logprobs
            if k is not None and start < req.num_prompt_tokens - 1:
                last = min(start + n, req.num_prompt_tokens - 1)
                targets = req.token_ids[start + 1 : last + 1]
                prompt.append(PromptRows(rid, len(prompt_rows), targets, k))
                prompt_rows.extend(range(tok_start, tok_start + len(targets)))
            if start + n == req.num_tokens:
                logit_rows.append(len(ids) - 1)
                sampled.append(rid)
                if sample_rows:
                    rows.append(req.sample_row(out.grammar_masks.get(rid)))
        positions = torch.cat([torch.tensor(decode_pos, dtype=torch.long), *prefill_pos])
        decode_lens = [p + 1 for p in decode_pos]
        decode_mask = None
        if self.dense_masks and decode_lens:
            width = max(len(t) for t in tables[0][: len(decode_lens)])
            decode_mask = self._decode_mask(width * bs, decode_lens)
        shared = _SharedMeta(
            int(positions.max()),
            len(decode_pos),
            torch.tensor(seq_lens, dtype=torch.long, device=self.device),
            torch.tensor(query_start, dtype=torch.long, device=self.device),
            decode_lens,
            decode_mask,
        )
        metas = [
            self._meta(shared, tables[g], decode_slots[g], prefill_slots[g], prefills[g])
            for g in range(groups)
        ]
        meta = metas[0]
        for m in metas[1:]:
            m.window_masks = meta.window_masks  # built once per step, for every group
        meta.groups = metas[1:]
        return StepInputs(
            torch.tensor(ids, dtype=torch.long, device=self.device),
            positions.to(self.device),
            meta,
            torch.tensor(prompt_rows + logit_rows, dtype=torch.long, device=self.device),
            prompt,
            sampled,
            rows,
        )

    def _meta(
        self,
        shared: _SharedMeta,
        tables: list[list[int]],
        decode_slots: list[int],
        prefill_slots: list[torch.Tensor],
        prefills: list[PrefillChunk],
    ) -> AttentionMetadata:
        """One group's metadata: its slots and block tables, the step's lengths."""
        meta = AttentionMetadata(
            slot_mapping=torch.cat(
                [torch.tensor(decode_slots, dtype=torch.long), *prefill_slots]
            ).to(self.device),
            max_position=shared.max_position,
            num_decodes=shared.num_decodes,
        )
        if not self.dense_masks:
            meta.seq_block_tables = self._padded(tables)
            meta.seq_lens = shared.seq_lens
            meta.query_start = shared.query_start
        elif shared.decode_lens:
            lens = shared.decode_lens
            meta.decode_block_tables = self._padded(tables[: len(lens)])
            meta.decode_mask = shared.decode_mask
            meta.decode_lens = torch.tensor(lens, dtype=torch.long, device=self.device)
        meta.prefills = prefills
        return meta

    def _padded(self, tables: list[list[int]]) -> torch.Tensor:
        """``[len(tables), longest]`` int64 block tables, 0-padded, on the device (filled
        row by row through numpy: 3x faster than torch.tensor of nested lists, which
        counts with one table per group and step in the hybrid layout)."""
        width = max(len(t) for t in tables)
        rows = np.zeros((len(tables), width), dtype=np.int64)
        for i, t in enumerate(tables):
            rows[i, : len(t)] = t
        return torch.from_numpy(rows).to(self.device)

    def _decode_mask(self, max_len: int, lens: list[int]) -> torch.Tensor | None:
        """``[decodes, 1, 1, max_len]`` of the keys each decode sees (None: all of the
        padded context of every decode: plain causal attention)."""
        pos = torch.arange(max_len).unsqueeze(0)
        lens_t = torch.tensor(lens).unsqueeze(1)
        mask = visible(lens_t - 1, pos, self.window, self.sinks)  # a decode sits at len - 1
        need_mask = self.window is not None or any(n != max_len for n in lens)
        return mask.view(len(lens), 1, 1, max_len).to(self.device) if need_mask else None
