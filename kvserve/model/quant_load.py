"""Loading a checkpoint whose tensors ``kvserve_quant.json`` names as raw GGUF blocks.

``QuantLoad.plan`` decides, before the model's memory is allocated, which modules are
served quantized (``model/quantized.py``): a projection (fused Q/K/V or gate/up included)
whose every piece the checkpoint stores quantized, the token embeddings and the LM head.
They are replaced by placeholders that hold no dense weight, so loading never allocates the
16/32-bit matrix. ``QuantLoad.take`` receives their raw pieces, ``QuantLoad.finish`` packs
them into ``GGUFLinear`` / ``GGUFEmbedding``. Every other raw tensor (a piece of a module
kept dense, or all of them with ``keep=False``: ``--quantization none``, a GPU, no CPU
kernels) is dequantized (``dequantized``) and loaded as any float tensor.

Under tensor parallelism a rank keeps its own part of each quantized matrix: its rows, and
for the O and down projections (split along their input) its columns, as whole blocks. A
module whose rank columns do not fall on block boundaries (a Q4_K O projection whose
heads split at 128 values, not 256) stays dense on every rank, as it would be dequantized.

``--quantization int8`` adds the float matrices ``int8_names`` picks: ``QuantLoad`` plans
them as the GGUF ones, and ``take_dense`` quantizes each as it is read to int8 with one
scale per output row (``quantized.pack_int8``), never holding the model in bf16.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

import numpy as np
import torch
from torch import nn

from kvserve.model.llama import FUSED_PIECES
from kvserve.model.mlp import our_mlp_name
from kvserve.model.quantized import (
    BLOCKS,
    INT8,
    QUANT_MANIFEST,
    GGUFEmbedding,
    GGUFLinear,
    Packed,
    dequantize,
    pack,
    pack_int8,
    release_freed_memory,
)

logger = logging.getLogger(__name__)

# our fused module -> how many checkpoint pieces it holds
_PIECES = {ours: max(i for o, i in FUSED_PIECES.values() if o == ours) + 1
           for ours, _ in FUSED_PIECES.values()}  # fmt: skip


def read_manifest(model_dir: str | Path) -> dict[str, str]:
    """Checkpoint tensor name -> GGML type of the tensors stored as raw blocks ({} if none)."""
    path = Path(model_dir) / QUANT_MANIFEST
    return json.loads(path.read_text()) if path.is_file() else {}


def dequantized(raw: torch.Tensor, ggml_type: str) -> torch.Tensor:
    """Raw rows (uint8 ``[n, row_bytes]``) as float32 ``[n, k]``."""
    return torch.from_numpy(dequantize(raw.numpy(), ggml_type))


class _Pending(nn.Module):
    """A placeholder for a quantized module while its pieces load (no dense weight)."""

    def __init__(self, pieces: int, bias: nn.Parameter | None):
        super().__init__()
        # raw GGUF rows (rows, type, k), or a piece already packed (``pack_int8``)
        self.raw: list[tuple[np.ndarray, str, int] | Packed | None] = [None] * pieces
        self.bias = bias


def _target(name: str) -> tuple[str, int, int]:
    """Checkpoint name -> (our module's path, piece index, pieces)."""
    module = our_mlp_name(name).removeprefix("model.").rpartition(".")[0]
    parent, _, proj = module.rpartition(".")
    if proj in FUSED_PIECES:
        ours, piece = FUSED_PIECES[proj]
        return f"{parent}.{ours}", piece, _PIECES[ours]
    return module, 0, 1


_ROUTERS = ("gate", "shared_expert_gate")  # MoE routers: kept in float by int8


def int8_shape_ok(name: str, shape: tuple[int, ...]) -> bool:
    """Whether checkpoint matrix ``name`` of ``shape`` may be quantized by ``--quantization
    int8`` as far as its name and shape tell: a 2-D ``.weight`` whose rows are whole blocks
    of 32, not a MoE router (``int8_names`` also needs its module to be a linear or an
    embedding)."""
    if not name.endswith(".weight") or len(shape) != 2 or shape[1] % 32:
        return False
    return _target(name)[0].rpartition(".")[2] not in _ROUTERS


def int8_names(model: nn.Module, expected: dict[str, tuple[int, ...]]) -> list[str]:
    """The checkpoint matrices ``--quantization int8`` quantizes: the weight of every
    ``nn.Linear`` (projections, LM head) and ``nn.Embedding`` of ``model`` (before
    ``QuantLoad`` plans it) whose rows are whole blocks of 32, every MoE expert's
    projections included. Norms, biases and the MoE routers (``gate``,
    ``shared_expert_gate``: tiny, and their rounding would move tokens between experts, as
    llama.cpp keeps them in float) stay in the model's dtype."""
    names = []
    for name, shape in expected.items():
        if not int8_shape_ok(name, shape):
            continue
        module = _target(name)[0]
        try:
            found = model.get_submodule(module)
        except AttributeError:
            continue
        if isinstance(found, (nn.Linear, nn.Embedding)):
            names.append(name)
    return names


class QuantLoad:
    """The quantized modules of one model being loaded (``plan``, ``take``, ``finish``).
    ``manifest``: the checkpoint's raw tensors (name -> GGML type); ``requantize``: float
    tensors to quantize to int8 as they load (``int8_names``; those in ``manifest`` keep
    their type)."""

    def __init__(
        self, model: nn.Module, manifest: dict[str, str], keep: bool, requantize: list[str]
    ):
        self.model = model
        self.requantize = frozenset(n for n in requantize if n not in manifest)
        self.manifest = manifest | dict.fromkeys(self.requantize, INT8)
        self.pending: dict[str, _Pending] = {}
        if keep:
            self._plan()

    def keeps(self, name: str) -> bool:
        """Whether checkpoint tensor ``name`` fills a module served quantized (``take``,
        ``take_dense``); else the caller loads it as a float tensor."""
        return self._slot(name) is not None

    def take_dense(self, name: str, dense: torch.Tensor) -> None:
        """Quantize float matrix ``dense`` of ``name``, which ``keeps``, to int8 per row
        (``pack_int8``) and keep this rank's part of it for its module: the part's codes
        and scales are the whole matrix's."""
        slot = self._slot(name)
        assert slot is not None, name
        plan = self.model.plan
        amax = dense.detach().float().abs().amax(dim=1) if plan.k_slice(name) else None
        slot[0].raw[slot[1]] = pack_int8(plan.read(name, dense), amax)

    def _slot(self, name: str) -> tuple[_Pending, int] | None:
        """The placeholder and piece index that checkpoint tensor ``name`` fills; None when
        its module stays dense (or it is a tied checkpoint's copy of the LM head)."""
        module, piece, _ = _target(name)
        pending = self.pending.get(module)
        if pending is None or (name == "lm_head.weight" and module != "lm_head"):
            return None
        return pending, piece

    def _plan(self) -> None:
        by_module: dict[str, list[int]] = {}
        sizes: dict[str, int] = {}
        for name in self.manifest:
            if name == "lm_head.weight" and getattr(self.model, "lm_head", None) is None:
                continue  # a tied checkpoint's copy
            module, piece, pieces = _target(name)
            block = BLOCKS.get(self.manifest[name], (32, 0))[0]  # int8: activations per 32
            if self.model.plan.splits_blocks(name, block):  # this rank's part: whole blocks
                by_module.setdefault(module, []).append(piece)
            sizes[module] = pieces
        for module, pieces in by_module.items():
            if sorted(pieces) != list(range(sizes[module])):
                continue  # a fused module with a dense piece stays dense
            parent_name, _, leaf = module.rpartition(".")
            parent = self.model.get_submodule(parent_name) if parent_name else self.model
            old = getattr(parent, leaf, None)
            if not isinstance(old, (nn.Linear, nn.Embedding)):
                continue
            bias = old.bias if isinstance(old, nn.Linear) else None
            parent.register_module(leaf, _Pending(sizes[module], bias))
            self.pending[module] = getattr(parent, leaf)

    def take(self, name: str, raw: torch.Tensor) -> None:
        """Keep raw piece ``name`` (this rank's rows, whole blocks: uint8 ``[rows, row
        bytes]``), which ``keeps``, for its quantized module."""
        slot = self._slot(name)
        assert slot is not None, name
        ggml_type = self.manifest[name]
        per, size = BLOCKS[ggml_type]
        slot[0].raw[slot[1]] = (raw.numpy(), ggml_type, raw.shape[1] // size * per)

    def finish(self, dtype: torch.dtype) -> int:
        """Pack every placeholder into its quantized module; returns their weights' bytes.
        A tied LM head reads the quantized embeddings (``lm_head_packed``)."""
        total = 0
        for module, pending in self.pending.items():
            parent_name, _, leaf = module.rpartition(".")
            parent = self.model.get_submodule(parent_name) if parent_name else self.model
            assert all(pending.raw), f"{module}: a piece was never loaded"
            parts = [e if isinstance(e, Packed) else pack(*e) for e in pending.raw]  # type: ignore[misc]
            pending.raw = [None] * len(pending.raw)  # the raw pieces go before the trim
            if leaf == "embed_tokens":
                new: nn.Module = GGUFEmbedding(parts[0], dtype)
                if getattr(self.model, "lm_head", True) is None:
                    self.model.lm_head_packed = GGUFLinear(parts)
            else:
                new = GGUFLinear(_merged(parts), pending.bias)
            parent.register_module(leaf, new)
            total += sum(p.nbytes for p in parts)
        if self.pending:
            release_freed_memory()  # the raw pieces and packing's temporaries
            types = sorted(set(self.manifest.values()))
            logger.info("%d modules kept quantized (%s): %.1f MiB",
                        len(self.pending), "/".join(types), total / 2**20)  # fmt: skip
        return total


def _merged(parts: list[Packed]) -> list[Packed]:
    """Runs of parts of one type whose earlier parts fill whole groups of 16 rows, each
    as one part (one kernel call for a fused Q/K/V of one type)."""
    out: list[Packed] = []
    for p in parts:
        last = out[-1] if out else None
        if last is None or last.ggml_type != p.ggml_type or last.n % 16:
            out.append(p)
            continue
        out[-1] = Packed(
            p.ggml_type, last.n + p.n, p.k,
            *(torch.cat([a, b]) for a, b in ((last.qs, p.qs), (last.d, p.d), (last.aux, p.aux))),
        )  # fmt: skip
    return out
