"""CUDA graphs for decode steps: the model's forward pass captured once per batch-size
bucket at start and replayed with the step's inputs copied into static buffers, so a
decode step costs one graph launch instead of hundreds of kernel launches from Python.

- Buckets (``capture_sizes``): 1, 2, 4, then multiples of 8 up to ``max_num_seqs`` (at
  most 256), as vLLM captures. A step of n decode rows runs the smallest bucket ≥ n; the
  rows past n are padding: their slot is -1 (the Triton KV writes skip them), their
  context one token of block 0, and their output is dropped.
- Static buffers (``_Static``) hold the largest bucket; bucket b's metadata are views of
  their first b rows. The attention metadata's ``max_position`` is the model's
  ``max_model_len - 1`` in every graph, which sizes the split-KV grid for any context;
  the kernels give a row the same bits whatever the grid (``model/triton_attention.py``).
- Only steps every part of which is capturable take a graph (``eligible``): decode rows
  only, the Triton attention backend, no MoE routing (it reads counts on the host), no
  KV cache written through torch (fp8 with per-head scales), no tensor parallelism.
  Other steps run eagerly; ``--enforce-eager`` turns graphs off.
- ``capture`` is a ``Capture``: ``CudaCapture`` on a GPU; ``ReplayByCall`` (the forward
  run again at each replay, reading the same static buffers) tests this module's
  bucketing and buffer logic on CPU.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import torch

from kvserve.model.attention import AttentionMetadata
from kvserve.model.llama import LlamaForCausalLM

logger = logging.getLogger("kvserve")

Forward = Callable[[], torch.Tensor]


def capture_sizes(max_num_seqs: int, limit: int = 256) -> list[int]:
    """The decode batch sizes captured: 1, 2, 4, then every multiple of 8 up to
    ``min(max_num_seqs, limit)`` (that bound itself included)."""
    top = max(1, min(max_num_seqs, limit))
    sizes = [s for s in (1, 2, 4) if s <= top]
    sizes += list(range(8, top + 1, 8))
    if sizes[-1] != top:
        sizes.append(top)
    return sizes


class Capture(Protocol):
    """Turns a forward pass over static buffers into a replay that returns its output."""

    def capture(self, forward: Forward) -> Forward: ...


class CudaCapture:
    """``torch.cuda.CUDAGraph`` captures sharing one memory pool (captured largest
    first, so smaller graphs reuse the largest one's memory)."""

    def __init__(self, device: torch.device):
        self.device = device
        self.pool = torch.cuda.graph_pool_handle()

    def capture(self, forward: Forward) -> Forward:
        stream = torch.cuda.Stream(self.device)
        stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(stream):  # warm-up: Triton compiles, allocator settles
            forward()
            forward()
        torch.cuda.current_stream(self.device).wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            out = forward()

        def replay() -> torch.Tensor:
            graph.replay()
            return out

        return replay


class ReplayByCall:
    """A stand-in capture for machines without a GPU: each replay runs the forward pass
    again over the same static buffers, which is what a graph replay computes."""

    def capture(self, forward: Forward) -> Forward:
        forward()  # as CudaCapture warms up
        return forward


@dataclass
class _Static:
    """The largest bucket's inputs; a bucket reads the first rows of each."""

    ids: torch.Tensor
    positions: torch.Tensor
    slots: list[torch.Tensor]  # per KV group
    tables: list[torch.Tensor]  # per KV group, [rows, max_blocks]
    seq_lens: torch.Tensor
    query_start: torch.Tensor  # 0, 1, …, rows: one row per sequence

    @classmethod
    def allocate(cls, rows: int, max_blocks: int, groups: int, device: torch.device) -> _Static:
        def z(*shape: int) -> torch.Tensor:
            return torch.zeros(shape, dtype=torch.long, device=device)

        return cls(
            z(rows),
            z(rows),
            [z(rows) - 1 for _ in range(groups)],  # captures write nothing
            [z(rows, max_blocks) for _ in range(groups)],
            z(rows),
            torch.arange(rows + 1, device=device),
        )

    def meta(self, rows: int, max_position: int) -> AttentionMetadata:
        """Bucket ``rows``'s metadata over the buffers (groups 1, … in ``groups``)."""
        metas = [
            AttentionMetadata(
                slot_mapping=self.slots[g][:rows],
                max_position=max_position,
                num_decodes=rows,
                seq_block_tables=self.tables[g][:rows],
                seq_lens=self.seq_lens[:rows],
                query_start=self.query_start[: rows + 1],
            )
            for g in range(len(self.slots))
        ]
        metas[0].groups = metas[1:]
        return metas[0]


class DecodeGraphs:
    """Captured decode steps of ``model`` over ``kv_caches`` (see the module doc)."""

    def __init__(
        self,
        model: LlamaForCausalLM,
        kv_caches: list,
        device: torch.device,
        sizes: list[int],
        max_blocks: int,
        groups: int,
        max_position: int,
        capture: Capture,
    ):
        self.sizes = sorted(sizes)
        self.max_blocks = max_blocks
        self.static = _Static.allocate(self.sizes[-1], max_blocks, groups, device)
        self.replays: dict[int, Forward] = {}
        for rows in reversed(self.sizes):  # largest first: the pool grows once
            meta = self.static.meta(rows, max_position)
            ids, pos = self.static.ids[:rows], self.static.positions[:rows]
            self.replays[rows] = capture.capture(
                lambda ids=ids, pos=pos, meta=meta: model(ids, pos, kv_caches, meta)
            )
        logger.info("CUDA graphs: decode steps of %s rows captured", self.sizes)

    def eligible(self, input_ids: torch.Tensor, meta: AttentionMetadata) -> bool:
        """Is this step decode rows only, within the largest bucket and the tables' width?"""
        n = input_ids.shape[0]
        if n == 0 or n > self.sizes[-1] or meta.num_decodes != n:
            return False
        tables = meta.seq_block_tables
        return tables is not None and tables.shape[0] == n and tables.shape[1] <= self.max_blocks

    def run(
        self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata
    ) -> torch.Tensor:
        """The hidden states ``[n, hidden]`` of an ``eligible`` step (a view of the
        graph's output: read it before the next step)."""
        n = input_ids.shape[0]
        rows = next(s for s in self.sizes if s >= n)
        st = self.static
        st.ids[:n].copy_(input_ids)
        st.ids[n:rows].zero_()
        st.positions[:n].copy_(positions)
        st.positions[n:rows].zero_()
        assert meta.seq_lens is not None
        st.seq_lens[:n].copy_(meta.seq_lens)
        st.seq_lens[n:rows].fill_(1)
        for g in range(len(st.slots)):
            gm = meta.for_group(g)
            assert gm.seq_block_tables is not None
            st.slots[g][:n].copy_(gm.slot_mapping)
            st.slots[g][n:rows].fill_(-1)  # padding rows write nothing
            width = gm.seq_block_tables.shape[1]
            st.tables[g][:n, :width].copy_(gm.seq_block_tables)
            st.tables[g][n:rows].zero_()
        return self.replays[rows]()[:n]
