"""The Triton attention backend: the GPU path's paged attention and KV writes
(``triton_attention.py``, ``triton_kv_write.py``), behind the interface the C++ CPU
backend has (``AttentionBackend``: every row of a step in one call, K/V read in place).

It runs on CUDA devices, and on CPU tensors only under Triton's interpreter
(``TRITON_INTERPRET=1`` in the environment before kvserve starts), which is how the tests
run it, engine and all, on machines without a GPU. ``triton_unusable`` says why it cannot
run somewhere; the kernel modules are imported only once it can (Triton reads the
interpreter setting when a module defines its kernels).
"""

from __future__ import annotations

import importlib.util

import torch

from kvserve.model.attention import AttentionMetadata, KVCache, TorchPagedAttention, kv_tensors
from kvserve.model.kv_quant import QuantizedKVCache
from kvserve.model.triton_mode import interpreting

TRITON_MAX_HEAD_DIM = 256


def triton_unusable(
    device: torch.device, head_dim: int, kv_storage: torch.dtype | None = None
) -> str | None:
    """Why the Triton backend cannot serve a model of ``head_dim`` with a KV cache of
    element type ``kv_storage`` on ``device``, or None when it can."""
    if importlib.util.find_spec("triton") is None:
        return "Triton is not installed (pip install triton)"
    if device.type == "cpu" and not interpreting():
        return "the Triton backend runs on a GPU (on CPU only with TRITON_INTERPRET=1, for tests)"
    if device.type not in ("cpu", "cuda"):
        return f"the Triton backend does not run on {device.type}"
    if (
        device.type == "cuda"
        and kv_storage == torch.float8_e4m3fn
        and torch.cuda.get_device_capability(device) < (8, 9)
    ):  # Triton converts e4m3 on Ada/Hopper and later only
        return "fp8_e4m3 KV caches need compute capability 8.9 (use fp8_e5m2 or int8)"
    if head_dim > TRITON_MAX_HEAD_DIM:
        return f"the Triton backend supports head_dim up to {TRITON_MAX_HEAD_DIM}, not {head_dim}"
    return None


class TritonPagedAttention(TorchPagedAttention):
    """Every row of a step, decode or prefill, through the Triton paged-attention kernels
    (split-KV for decode-only steps with long contexts), K/V written by the Triton write
    kernels (16/32-bit caches; 8-bit ones with per-token scales quantize in the kernel,
    the same codes as ``QuantizedKVCache.write``; per-head fp8 scales and their
    calibration write through torch).

    Batch-invariant by construction (``triton_attention``'s determinism rule): a row's
    output does not depend on the other rows of the step, on its prompt's chunking or on
    whether its context came from the prefix cache. Needs ``seq_block_tables``,
    ``seq_lens`` and ``query_start`` in the metadata (``dense_masks`` False). Construct
    only where ``triton_unusable`` returned None.
    """

    dense_masks = False
    tiled = False

    def __init__(self, block_size: int, sliding_window: int | None, sinks: int = 0):
        super().__init__(block_size)
        self.window = sliding_window or 0
        self.sinks = sinks if self.window else 0
        from kvserve.model import triton_attention, triton_kv_write  # see the module doc

        self._attention = triton_attention.paged_attention
        self._write_kv = triton_kv_write.write_kv
        self._write_quantized = triton_kv_write.write_quantized

    def for_window(self, window: int) -> TritonPagedAttention:
        return TritonPagedAttention(self.block_size, window or None, 0)

    def write(  # type: ignore[override]  (an instance method: the kernels are per instance)
        self, k: torch.Tensor, v: torch.Tensor, kv_cache: KVCache, meta: AttentionMetadata
    ) -> None:
        """Store the step's new K/V ``[tokens, kv_heads, dim]`` at ``meta.slot_mapping``."""
        if isinstance(kv_cache, QuantizedKVCache):
            if kv_cache.fmt.scale == "token" and not kv_cache.tiled:
                self._write_quantized(kv_cache, meta.slot_mapping, k, v)
            else:
                kv_cache.write(meta.slot_mapping, k, v)
        else:
            self._write_kv(k, v, meta.slot_mapping, kv_cache)

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        kv_cache: KVCache,
        meta: AttentionMetadata,
        scale: float,
        softcap: float = 0.0,
        sink_logits: torch.Tensor | None = None,
    ) -> torch.Tensor:
        self.write(k, v, kv_cache, meta)
        assert meta.seq_block_tables is not None and meta.seq_lens is not None
        assert meta.query_start is not None
        data, k_scale, v_scale = kv_tensors(kv_cache)
        return self._attention(
            q,
            data[0],
            data[1],
            meta.seq_block_tables,
            meta.seq_lens,
            meta.query_start,
            scale,
            self.window,
            self.sinks,
            k_scale,
            v_scale,
            self.block_size,
            meta.max_position + 1,
            softcap=softcap,
            sink_logits=sink_logits,
        )
