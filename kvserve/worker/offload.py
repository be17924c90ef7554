"""The worker's side of the KV store: block bytes in and out of the KV tensors.

- ``block_format()``: the format this worker's blocks are stored in (model, KV dtype,
  shapes; fp8 per-head scales and K smoothing's shifts by digest, recomputed per use: the
  scales may be calibrated after start).
- ``load(loads)``: each ``KVLoad``'s fetched payload rows into its device blocks. The
  engine runs it before the step's forward pass (from the ``SchedulerOutput``), so a
  request scheduled in the step its load finished reads its restored blocks.
- ``save(saves, store)``: the ``KVSave`` blocks (full after this step) gathered in one
  index per KV tensor, serialized (``store.serde``: header, checksum, token ids) and put
  into the tiered store in one batch — synchronously into the host tier, asynchronously
  below it.
"""

from __future__ import annotations

import hashlib
from typing import TYPE_CHECKING

import torch

from kvserve.model.kv_cache import block_tensors
from kvserve.model.kv_quant import QuantizedKVCache
from kvserve.store import serde

if TYPE_CHECKING:
    from kvserve.store.offloader import KVLoad, KVSave
    from kvserve.store.tiered import TieredStore

_DTYPE_NAMES = {
    torch.float32: "float32",
    torch.float16: "float16",
    torch.bfloat16: "bfloat16",
    torch.int8: "int8",
    torch.uint8: "uint8",
}


class KVTransfer:
    """``layer_group``: each layer's KV group in the hybrid layout (model/kv_groups.py; None:
    uniform). A stored block holds every layer's rows in layer order either way, a layer's
    taken from its group's page."""

    def __init__(
        self,
        caches: list,
        block_size: int,
        model_fingerprint: str,
        kv_dtype: str,
        layer_group: tuple[int, ...] | None = None,
        row_slice: tuple[int, int] | None = None,
    ):
        """``row_slice``: (offset, bytes) of this rank's shard in a stored block's rows
        under tensor parallelism; None in one process."""
        self.caches = caches
        # per layer, its parts (a hybrid layout's layers share tensors: not deduplicated)
        self._layers = [block_tensors([c], block_size) for c in caches]
        self._groups = layer_group or (0,) * len(caches)
        self._device = self._layers[0][0].device
        parts = tuple((_DTYPE_NAMES[v.dtype], (v.shape[0], *v.shape[2:])) for v in self._layers[0])
        self._base = (model_fingerprint, kv_dtype, block_size, len(caches), parts)
        self.row_slice = row_slice

    def block_format(self) -> serde.BlockFormat:
        """The stored format; its digest covers fp8 per-head scales and K smoothing's
        shifts (blocks written under other ones are a miss)."""
        digest = None
        first = self.caches[0]
        if isinstance(first, QuantizedKVCache) and (
            first.fmt.scale == "head" or first.k_shift is not None
        ):
            h = hashlib.blake2b(digest_size=8)
            for c in self.caches:
                if c.fmt.scale == "head":
                    h.update(c.scale.detach().cpu().numpy().tobytes())
                if c.k_shift is not None:
                    h.update(b"k_shift" + c.k_shift.detach().cpu().numpy().tobytes())
            digest = h.hexdigest()
        return serde.BlockFormat(*self._base, scales_digest=digest)

    @property
    def parts(self) -> tuple:
        """Per layer: (dtype name, shape) of each tensor part of one block."""
        return self._base[4]

    def rows(self, pages: list[tuple[int, ...]]) -> torch.Tensor:
        """One row of payload bytes per block ``[n, payload bytes]`` uint8 on the host, from
        its page in each group (``KVSave.pages``): every layer's parts, layer-major
        (``serde.pack``)."""
        n = len(pages)
        idx = [
            torch.tensor([p[g] for p in pages], device=self._device)
            for g in range(max(self._groups) + 1)
        ]
        return torch.cat(
            [
                v.index_select(1, idx[g])
                .transpose(0, 1)
                .contiguous()
                .view(torch.uint8)
                .reshape(n, -1)
                for views, g in zip(self._layers, self._groups, strict=True)
                for v in views
            ],
            dim=1,
        ).cpu()

    def save(self, saves: list[KVSave], store: TieredStore) -> int:
        """Serialize and store ``saves``; returns how many blocks were offered."""
        if not saves:
            return 0
        fmt = self.block_format()
        rows = self.rows([s.pages for s in saves])
        store.put(
            [(s.key, serde.encode(fmt, s.key, rows[j], s.tokens)) for j, s in enumerate(saves)]
        )
        return len(saves)

    def load(self, loads: list[KVLoad]) -> None:
        """Payload rows ([n, payload bytes]) of each load into its device blocks (a layer's
        into its group's pages); with ``row_slice`` (a tensor-parallel rank) only those
        bytes of each row are its."""
        for ld in loads:
            n = ld.rows.shape[0]
            if not n:
                continue
            per_group = len(ld.blocks) // ld.groups
            idx = [
                torch.tensor(ld.blocks[g * per_group : g * per_group + n], device=self._device)
                for g in range(ld.groups)
            ]
            offset = self.row_slice[0] if self.row_slice is not None else 0
            for views, g in zip(self._layers, self._groups, strict=True):
                for view in views:
                    shape = (n, 2, *view.shape[2:])
                    size = view[:, :1].numel() * view.element_size()  # bytes of one block
                    rows = ld.rows[:, offset : offset + size].contiguous()
                    part = rows.view(view.dtype).view(shape)
                    view.index_copy_(1, idx[g], part.transpose(0, 1).to(view.device))
                    offset += size
