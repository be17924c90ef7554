"""Tensor parallelism: which slice of the model a rank holds, and its collectives.

``ShardPlan`` is pure arithmetic over a ``ModelSpec``: rank r of N holds

- a contiguous group of KV heads and the query heads that attend to them (the unit of the
  split is a KV-head group, so grouped-query attention stays local to a rank). With more
  KV heads than ranks the groups are as even as they can be (3 KV heads over 2 ranks:
  2 and 1); with fewer (MQA/GQA, ``N % num_kv_heads == 0``) each KV head is replicated on
  ``N / num_kv_heads`` ranks and their query heads split evenly, as vLLM does;
- a contiguous slice of the MLP's intermediate dimension (column-parallel gate/up,
  row-parallel down) and of the attention output (row-parallel O);
- ``ceil(vocab / N)`` rows of the embedding and LM head (the last rank's padded with zero
  rows), the logits gathered on rank 0 for sampling.

Norms are replicated; a row-parallel bias lives on rank 0 only, so the all-reduce adds it
once. ``ShardPlan.for_rank`` raises ``ShardingError`` with the numbers for a shape that
cannot be split (more ranks than query heads, KV heads neither a multiple nor a divisor
of N).

``TPGroup`` runs the collectives: over a shared-memory segment for CPU ranks of one
machine (``model.shm``, ~100x faster than gloo over loopback), else over the
``torch.distributed`` process group (gloo on CPU, NCCL on CUDA). Either way a timeout
bounds every collective: a dead peer is an error, never a hang.
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist

from kvserve.model.shm import ShmChannel
from kvserve.model.spec import ModelSpec


class ShardingError(ValueError):
    """The model cannot be split over this many ranks; the message has the numbers."""


def split_range(n: int, parts: int, index: int) -> tuple[int, int]:
    """``(start, count)`` of part ``index`` when ``n`` items are split into ``parts``
    contiguous parts as evenly as possible (the first ``n % parts`` get one more)."""
    base, extra = divmod(n, parts)
    start = index * base + min(index, extra)
    return start, base + (1 if index < extra else 0)


@dataclass(frozen=True)
class ShardPlan:
    """What rank ``rank`` of ``size`` holds (in units of heads, rows and columns)."""

    rank: int
    size: int
    head_dim: int
    q_head_start: int
    num_heads: int
    kv_head_start: int
    num_kv_heads: int
    inter_start: int
    intermediate_size: int
    vocab_size: int  # the whole vocabulary
    vocab_shard: int  # embedding / LM head rows per rank (padded)
    moe_inter_start: int = 0  # this rank's slice of every expert's intermediate size
    moe_intermediate_size: int = 0
    shared_inter_start: int = 0  # and of Qwen2-MoE's shared expert's
    shared_intermediate_size: int = 0
    # the whole model's, to find a rank's rows in Phi-3's fused qkv_proj / gate_up_proj
    total_heads: int = 0
    total_kv_heads: int = 0
    total_intermediate_size: int = 0

    @classmethod
    def single(cls, spec: ModelSpec) -> ShardPlan:
        return cls.for_rank(spec, 0, 1)

    @classmethod
    def for_rank(cls, spec: ModelSpec, rank: int, size: int) -> ShardPlan:
        """Rank ``rank``'s share; raises ``ShardingError`` naming the numbers."""
        check_shardable(spec, size)
        hq, hkv = spec.num_heads, spec.num_kv_heads
        group = hq // hkv
        if hkv >= size:
            kv_start, kv_n = split_range(hkv, size, rank)
            q_start, q_n = kv_start * group, kv_n * group
        else:
            q_n = hq // size
            q_start, kv_start, kv_n = rank * q_n, rank // (size // hkv), 1
        inter_start, inter_n = split_range(spec.intermediate_size, size, rank)
        moe_start, moe_n = split_range(spec.moe_intermediate_size, size, rank)
        shared_start, shared_n = split_range(spec.shared_expert_intermediate_size, size, rank)
        return cls(
            rank,
            size,
            spec.head_dim,
            q_start,
            q_n,
            kv_start,
            kv_n,
            inter_start,
            inter_n,
            spec.vocab_size,
            -(-spec.vocab_size // size),
            moe_start,
            moe_n,
            shared_start,
            shared_n,
            hq,
            hkv,
            spec.intermediate_size,
        )

    @property
    def vocab_start(self) -> int:
        return self.rank * self.vocab_shard

    def local_spec(self, spec: ModelSpec) -> ModelSpec:
        """``spec`` with this rank's head counts and intermediate size (module shapes)."""
        return dataclasses.replace(
            spec,
            num_heads=self.num_heads,
            num_kv_heads=self.num_kv_heads,
            intermediate_size=self.intermediate_size,
            moe_intermediate_size=self.moe_intermediate_size,
            shared_expert_intermediate_size=self.shared_intermediate_size,
        )

    def _ffn(self, name: str) -> tuple[str, int, int]:
        """``(leaf, start, size)`` of FFN tensor ``name``: its projection (Mixtral's
        w1/w3/w2 read as gate/up/down) and this rank's slice of the intermediate size, an
        expert's or the dense MLP's."""
        leaf = name.rsplit(".", 2)[-2] if name.count(".") >= 2 else name
        if ".shared_expert." in name:
            return leaf, self.shared_inter_start, self.shared_intermediate_size
        if ".experts." not in name:
            return leaf, self.inter_start, self.intermediate_size
        leaf = _MIXTRAL_LEAVES.get(leaf, leaf)
        return leaf, self.moe_inter_start, self.moe_intermediate_size

    def read(self, name: str, tslice) -> torch.Tensor:
        """This rank's part of checkpoint tensor ``name`` from a safetensors slice, reading
        only that part (``tslice[a:b]`` or ``tslice[:, a:b]``)."""
        if self.size == 1:
            return tslice[:]
        d = self.head_dim
        leaf = name.rsplit(".", 2)[-2] if name.count(".") >= 2 else name
        is_bias = name.endswith(".bias")
        if leaf in ("qkv_proj", "gate_up_proj"):  # Phi-3's fused tensors: each part's rows
            return torch.cat([tslice[a:b] for a, b in self._fused_rows(leaf)])
        if leaf == "q_proj":
            return tslice[self.q_head_start * d : (self.q_head_start + self.num_heads) * d]
        if name.endswith(".self_attn.sinks"):  # gpt-oss: one logit per query head
            return tslice[self.q_head_start : self.q_head_start + self.num_heads]
        if leaf in ("k_proj", "v_proj"):
            a = self.kv_head_start * d
            return tslice[a : a + self.num_kv_heads * d]
        leaf, start, inter = self._ffn(name)
        if leaf in ("gate_proj", "up_proj"):
            return tslice[start : start + inter]
        if leaf in ("o_proj", "down_proj") and is_bias:  # added once, by rank 0
            full = tslice[:]
            return full if self.rank == 0 else torch.zeros_like(full)
        columns = self.k_slice(name)
        if columns is not None:
            return tslice[:, columns[0] : columns[0] + columns[1]]
        if name.endswith(("embed_tokens.weight", "lm_head.weight")):
            end = min(self.vocab_start + self.vocab_shard, self.vocab_size)
            rows = tslice[self.vocab_start : end]
            if rows.shape[0] < self.vocab_shard:
                pad = rows.new_zeros(self.vocab_shard - rows.shape[0], *rows.shape[1:])
                rows = torch.cat([rows, pad])
            return rows
        return tslice[:]

    def k_slice(self, name: str) -> tuple[int, int] | None:
        """``(start, count)`` of this rank's input columns of row-parallel weight ``name``
        (O and down projections: the rank's heads' or intermediate slice's columns); None
        for a tensor not split along its input (rows split, or replicated)."""
        if self.size == 1 or name.endswith(".bias"):
            return None
        leaf, start, inter = self._ffn(name)
        if leaf == "o_proj":
            return self.q_head_start * self.head_dim, self.num_heads * self.head_dim
        return (start, inter) if leaf == "down_proj" else None

    def splits_blocks(self, name: str, block: int) -> bool:
        """Whether this rank's part of weight ``name`` is whole blocks of ``block`` input
        values (always, unless ``name`` is split along its input at another boundary)."""
        columns = self.k_slice(name)
        return columns is None or (columns[0] % block == 0 and columns[1] % block == 0)

    def read_blocks(self, name: str, tslice, block: int, block_bytes: int) -> torch.Tensor:
        """``read`` for a weight stored as raw quantized rows (uint8 ``[rows, row bytes]``,
        ``block`` values in ``block_bytes`` bytes): its rows as ``read`` selects them (the
        vocabulary's padding rows zero bytes, which decode to 0), and along the input its
        whole blocks; needs ``splits_blocks(name, block)``."""
        columns = self.k_slice(name)
        if columns is None:
            return self.read(name, tslice)
        start, count = columns
        assert start % block == 0 and count % block == 0, (name, columns, block)
        return tslice[:, start // block * block_bytes : (start + count) // block * block_bytes]

    def _fused_rows(self, leaf: str) -> list[tuple[int, int]]:
        """This rank's row ranges of a fused tensor: its query, key and value heads'
        rows of ``qkv_proj``, or its slice of the gate's and of the up projection's rows
        of ``gate_up_proj``."""
        if leaf == "gate_up_proj":
            a, n, total = self.inter_start, self.intermediate_size, self.total_intermediate_size
            return [(a, a + n), (total + a, total + a + n)]
        d, q_rows = self.head_dim, self.total_heads * self.head_dim
        k = self.kv_head_start * d
        v = q_rows + self.total_kv_heads * d + k
        q = self.q_head_start * d
        kv = self.num_kv_heads * d
        return [(q, q + self.num_heads * d), (q_rows + k, q_rows + k + kv), (v, v + kv)]

    def shape(self, name: str, full: tuple[int, ...]) -> tuple[int, ...]:
        """The shape ``read`` returns for a tensor whose checkpoint shape is ``full``."""
        if self.size == 1:
            return full
        d = self.head_dim
        leaf = name.rsplit(".", 2)[-2] if name.count(".") >= 2 else name
        if leaf in ("qkv_proj", "gate_up_proj"):
            return (sum(b - a for a, b in self._fused_rows(leaf)), *full[1:])
        if leaf == "q_proj":
            return (self.num_heads * d, *full[1:])
        if name.endswith(".self_attn.sinks"):
            return (self.num_heads,)
        if leaf in ("k_proj", "v_proj"):
            return (self.num_kv_heads * d, *full[1:])
        leaf, _, inter = self._ffn(name)
        if leaf in ("gate_proj", "up_proj"):
            return (inter, *full[1:])
        if leaf in ("o_proj", "down_proj") and not name.endswith(".bias"):
            n = self.num_heads * d if leaf == "o_proj" else inter
            return (full[0], n)
        if name.endswith(("embed_tokens.weight", "lm_head.weight")):
            return (self.vocab_shard, *full[1:])
        return full


_MIXTRAL_LEAVES = {"w1": "gate_proj", "w3": "up_proj", "w2": "down_proj"}


def kv_heads_per_rank(num_kv_heads: int, size: int) -> int:
    """KV heads the fullest rank holds (what sizes every rank's share of a block)."""
    return -(-num_kv_heads // size) if num_kv_heads >= size else 1


def check_shardable(spec: ModelSpec, size: int) -> None:
    """Raise ``ShardingError`` (with the numbers) when ``spec`` cannot be split over
    ``size`` ranks; see the module docstring for what can."""
    hq, hkv = spec.num_heads, spec.num_kv_heads
    if size < 1:
        raise ShardingError(f"tensor_parallel_size must be >= 1, got {size}")
    if size == 1:
        return
    if spec.num_experts and spec.moe_intermediate_size < size:
        raise ShardingError(
            f"tensor_parallel_size {size} exceeds the experts' intermediate size "
            f"{spec.moe_intermediate_size}"
        )
    if hkv < size and (size % hkv or hq % size):
        raise ShardingError(
            f"tensor_parallel_size {size} does not split this model: it has {hkv} KV heads "
            f"and {hq} query heads; with fewer KV heads than ranks, the ranks must be a "
            f"multiple of the KV heads and divide the query heads "
            f"(try {', '.join(str(n) for n in _sizes_that_fit(spec, size))})"
        )
    if spec.intermediate_size < size:
        raise ShardingError(
            f"tensor_parallel_size {size} exceeds the intermediate size {spec.intermediate_size}"
        )


def _sizes_that_fit(spec: ModelSpec, up_to: int) -> list[int]:
    hq, hkv = spec.num_heads, spec.num_kv_heads
    return [n for n in range(1, up_to + 1) if n <= hkv or (n % hkv == 0 and hq % n == 0)]


class TPGroup:
    """This rank's view of the tensor-parallel group (``torch.distributed`` initialized)."""

    def __init__(
        self,
        plan: ShardPlan,
        group: dist.ProcessGroup | None = None,
        shm: ShmChannel | None = None,
    ):
        self.plan = plan
        self.rank, self.size = plan.rank, plan.size
        self.group = group
        self.shm = shm  # ranks of one machine on CPU: shared memory instead of gloo
        self.comm_seconds = 0.0  # inside collectives (waiting for peers included)

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum ``x`` over the ranks, in place; returns ``x``."""
        t = time.perf_counter()
        if self.shm is not None:
            self.shm.all_reduce(x)
        else:
            dist.all_reduce(x, group=self.group)
        self.comm_seconds += time.perf_counter() - t
        return x

    def gather_vocab(self, local: torch.Tensor) -> torch.Tensor | None:
        """Every rank's ``[rows, vocab_shard]`` logits → ``[rows, vocab]`` on rank 0; None
        on the other ranks."""
        t = time.perf_counter()
        local = local.contiguous()
        if self.shm is not None:
            stacked = self.shm.gather(local)
            parts = None if stacked is None else list(stacked.unbind(0))
        else:
            parts = [torch.empty_like(local) for _ in range(self.size)] if self.rank == 0 else None
            dist.gather(local, parts, dst=0, group=self.group)
        self.comm_seconds += time.perf_counter() - t
        if parts is None:
            return None
        return torch.cat(parts, dim=-1)[..., : self.plan.vocab_size]
