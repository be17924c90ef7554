"""How much KV fits on a GPU: a profiling forward pass, and ``--gpu-memory-utilization``
turned into KV bytes after the weights, the activations' peak, the CUDA graphs and what
is not torch's (the CUDA context, NCCL), logged as a table.

``plan_kv_memory`` is plain arithmetic (tested with worked cases); ``profile_forward``
runs one dummy step of ``tokens`` prefill tokens through any attention backend (the SDPA
path's chunk description and the paged kernels' sequence tables both), so the same pass
profiles the Triton and the SDPA backends, and runs on CPU in the tests.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvserve.errors import EngineError
from kvserve.model.attention import AttentionMetadata, PrefillChunk
from kvserve.model.kv_cache import KVCacheSpec
from kvserve.model.kv_quant import KVFormat
from kvserve.model.llama import LlamaForCausalLM
from kvserve.utils import cdiv, format_size


@dataclass(frozen=True)
class MemoryPlan:
    """One GPU's memory, in bytes: ``kv`` is what the KV cache may take."""

    total: int
    utilization: float
    weights: int
    activations: int  # the profiling pass's peak above the weights
    graphs: int  # reserved for CUDA graphs' memory pools
    non_torch: int  # allocated outside torch's allocator (CUDA context, NCCL, …)
    kv: int

    def table(self) -> str:
        """The plan as lines for the start log."""
        rows = [
            ("GPU memory", self.total),
            (f"× utilization {self.utilization:g}", int(self.total * self.utilization)),
            ("− weights", self.weights),
            ("− activations (profiled peak)", self.activations),
            ("− CUDA graphs", self.graphs),
            ("− outside torch (context, NCCL)", self.non_torch),
            ("= KV cache", self.kv),
        ]
        return "\n".join(f"  {name:<34} {format_size(b):>10}" for name, b in rows)


def plan_kv_memory(
    total: int, utilization: float, weights: int, activations: int, graphs: int, non_torch: int
) -> MemoryPlan:
    """The KV bytes ``utilization`` of ``total`` leaves. Raises EngineError (with the
    table) when nothing is left."""
    if not 0 < utilization <= 1:
        raise EngineError(f"gpu_memory_utilization must be in (0, 1], got {utilization}")
    budget = int(total * utilization)
    kv = budget - weights - activations - graphs - non_torch
    plan = MemoryPlan(total, utilization, weights, activations, graphs, non_torch, kv)
    if kv <= 0:
        raise EngineError(
            "no GPU memory left for the KV cache; raise --gpu-memory-utilization, lower "
            "--max-num-batched-tokens or shard the model (--tensor-parallel-size):\n" + plan.table()
        )
    return plan


def profile_inputs(tokens: int, block_size: int, device: torch.device) -> AttentionMetadata:
    """Metadata of one sequence's first ``tokens`` prefill tokens in blocks 0, 1, …, for
    any backend (the chunk for SDPA, the sequence tables for the paged kernels)."""
    pos = torch.arange(tokens, device=device)
    return AttentionMetadata(
        slot_mapping=pos.clone(),
        max_position=tokens - 1,
        prefills=[PrefillChunk(0, tokens, tokens, None, None)],
        seq_block_tables=torch.arange(cdiv(tokens, block_size), device=device).view(1, -1),
        seq_lens=torch.tensor([tokens], device=device),
        query_start=torch.tensor([0, tokens], device=device),
    )


@torch.inference_mode()
def profile_forward(
    model: LlamaForCausalLM,
    spec: KVCacheSpec,
    fmt: KVFormat,
    tokens: int,
    device: torch.device,
) -> None:
    """One dummy forward pass of ``tokens`` tokens and its last row's logits, over a
    scratch cache just large enough (freed on return): the step that needs the most
    activation memory."""
    caches = spec.allocate(cdiv(tokens, spec.block_size), device, fmt)
    meta = profile_inputs(tokens, spec.block_size, device)
    ids = torch.zeros(tokens, dtype=torch.long, device=device)
    hidden = model(ids, torch.arange(tokens, device=device), caches, meta)
    model.compute_logits(hidden[-1:])


def graph_reserve(activations: int, tokens: int, sizes: list[int]) -> int:
    """Bytes to keep for CUDA graphs of decode batches ``sizes`` (none: 0): their shared
    pool holds the largest bucket's activations (about a token's share each of the
    ``activations`` profiled for ``tokens``) and a few MiB per graph."""
    return activations * max(sizes) // tokens + len(sizes) * 2**21 if sizes else 0


def measure_cuda(
    model: LlamaForCausalLM,
    spec: KVCacheSpec,
    fmt: KVFormat,
    tokens: int,
    device: torch.device,
    utilization: float,
    weights: int,
    graph_sizes: list[int],
) -> MemoryPlan:
    """Profile ``tokens`` on a CUDA ``device`` and plan its KV memory, keeping room for
    CUDA graphs of ``graph_sizes`` decode rows."""
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats(device)
    before = torch.cuda.memory_allocated(device)
    profile_forward(model, spec, fmt, tokens, device)
    torch.cuda.synchronize(device)
    peak = torch.cuda.max_memory_allocated(device) - before
    torch.cuda.empty_cache()
    free, total = torch.cuda.mem_get_info(device)
    non_torch = max(0, total - free - torch.cuda.memory_reserved(device))
    graphs = graph_reserve(peak, tokens, graph_sizes)
    return plan_kv_memory(total, utilization, weights, peak, graphs, non_torch)
