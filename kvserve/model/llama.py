"""Llama-family decoder (Llama, Mistral, Qwen2, Qwen3) over flattened tokens and paged KV.

Differences between the families are flags on ``ModelSpec``: QKV bias (Qwen2), q/k RMSNorm
per head (Qwen3), sliding window (Mistral, handled by the attention metadata), tied
embeddings. Q/K/V and gate/up projections are fused at load time.

Under tensor parallelism (a ``TPGroup``, ``model.parallel``) each rank builds the modules
of its ``ShardPlan``'s sizes: its heads, its intermediate slice, its vocabulary rows; the
O and down projections' partial sums and the embedding are all-reduced, the logits
gathered on rank 0 (``compute_logits`` returns None on the other ranks).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from kvserve.model.attention import AttentionBackend, AttentionMetadata
from kvserve.model.fused_stack import FusedStack
from kvserve.model.kv_groups import KVGroups
from kvserve.model.mlp import make_mlp, mlp_weights, our_mlp_name
from kvserve.model.ops import TorchOps
from kvserve.model.parallel import ShardPlan, TPGroup
from kvserve.model.rope import RotaryEmbedding
from kvserve.model.spec import ModelSpec


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float, ops: TorchOps):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps
        self.ops = ops

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.ops.rms_norm(x, self.weight, self.eps)

    def add_forward(
        self, x: torch.Tensor, residual: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``(norm(residual + x), residual + x)``."""
        return self.ops.add_rms_norm(x, residual, self.weight, self.eps)


class Attention(nn.Module):
    """Fused QKV projection, optional per-head q/k norms (``norm_class``: Qwen3's RMSNorm,
    Gemma's), rotary embedding, paged attention through ``backend`` (the layer's own: it
    carries the layer's window), output projection."""

    def __init__(
        self,
        spec: ModelSpec,
        backend: AttentionBackend,
        ops: TorchOps,
        tp: TPGroup | None,
        norm_class: type[nn.Module] = RMSNorm,
    ):
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = (
            spec.num_heads,
            spec.num_kv_heads,
            spec.head_dim,
        )
        self.q_size = spec.num_heads * spec.head_dim
        self.kv_size = spec.num_kv_heads * spec.head_dim
        self.qkv_proj = nn.Linear(
            spec.hidden_size, self.q_size + 2 * self.kv_size, bias=spec.attention_bias
        )
        self.o_proj = nn.Linear(self.q_size, spec.hidden_size, bias=spec.o_proj_bias)
        qk_norm = spec.qk_norm
        self.q_norm = norm_class(spec.head_dim, spec.rms_norm_eps, ops) if qk_norm else None
        self.k_norm = norm_class(spec.head_dim, spec.rms_norm_eps, ops) if qk_norm else None
        self.scale = spec.attention_scale
        self.softcap = spec.attn_logit_softcap or 0.0  # Gemma 2's score soft-capping
        # gpt-oss: a learned logit per head, one more softmax column whose value is dropped
        self.sinks = nn.Parameter(torch.zeros(spec.num_heads)) if spec.attention_sinks else None
        self.backend = backend
        self.ops = ops
        self.tp = tp

    def forward(
        self,
        positions: torch.Tensor,
        x: torch.Tensor,
        rope: tuple[torch.Tensor, torch.Tensor],
        kv_cache: torch.Tensor,
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        t = x.shape[0]
        q, k, v = self.qkv_proj(x).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.view(t, self.num_heads, self.head_dim)
        k = k.view(t, self.num_kv_heads, self.head_dim)
        v = v.view(t, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None and self.k_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = self.ops.rope(positions, q, k, *rope)
        sinks = None if self.sinks is None else self.sinks.float()
        o = self.backend.forward(q, k, v, kv_cache, meta, self.scale, self.softcap, sinks)
        out = self.o_proj(o.reshape(t, self.q_size))
        return out if self.tp is None else self.tp.all_reduce(out)


class DecoderLayer(nn.Module):
    """Pre-norm block; carries the residual stream separately so adds fuse into norms."""

    # the C++ loop of this block's order: decoder_stack (model/fused_stack.py)
    fused_stack_order = "llama"

    def __init__(
        self,
        spec: ModelSpec,
        backend: AttentionBackend,
        ops: TorchOps,
        tp: TPGroup | None,
        layer: int = 0,
    ):
        super().__init__()
        self.input_layernorm = RMSNorm(spec.hidden_size, spec.rms_norm_eps, ops)
        self.self_attn = Attention(spec, backend, ops, tp)
        self.post_attention_layernorm = RMSNorm(spec.hidden_size, spec.rms_norm_eps, ops)
        self.mlp = make_mlp(spec, ops, tp, layer)

    def forward(
        self,
        positions: torch.Tensor,
        x: torch.Tensor,
        residual: torch.Tensor | None,
        rope: tuple[torch.Tensor, torch.Tensor],
        kv_cache: torch.Tensor,
        meta: AttentionMetadata,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Returns ``(block output, residual)``; the layer's true output is their sum."""
        if residual is None:
            residual, h = x, self.input_layernorm(x)
        else:
            h, residual = self.input_layernorm.add_forward(x, residual)
        h = self.self_attn(positions, h, rope, kv_cache, meta)
        h, residual = self.post_attention_layernorm.add_forward(h, residual)
        return self.mlp(h), residual


# HF projection → (our fused projection beside it, its piece among the fused ones)
FUSED_PIECES = {
    "q_proj": ("qkv_proj", 0),
    "k_proj": ("qkv_proj", 1),
    "v_proj": ("qkv_proj", 2),
    "gate_proj": ("gate_up_proj", 0),
    "up_proj": ("gate_up_proj", 1),
}
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


class LlamaForCausalLM(nn.Module):
    """The decoder stack plus LM head. ``forward`` returns final hidden states ``[T, H]``.

    ``spec`` is the whole model's; with ``tp`` the modules have the sizes of
    ``tp.plan`` (``plan.local_spec``) and the checkpoint is read through ``plan.read``.
    A layer whose window differs from the model's (``spec.layer_windows``) gets
    ``backend.for_window`` of it, one backend object per distinct window.
    """

    layer_class: type[nn.Module] = DecoderLayer
    norm_class: type[nn.Module] = RMSNorm
    stack_class: type[FusedStack] = FusedStack  # the layers in one C++ call

    def __init__(
        self,
        spec: ModelSpec,
        backend: AttentionBackend,
        ops: TorchOps | None = None,
        tp: TPGroup | None = None,
    ):
        super().__init__()
        ops = ops or TorchOps()
        self.spec = spec
        self.tp = tp
        self.plan = tp.plan if tp is not None else ShardPlan.single(spec)
        local = self.plan.local_spec(spec)
        self.local_spec = local
        self.embed_tokens = nn.Embedding(self.plan.vocab_shard, spec.hidden_size)
        # the model-wide backend serves the global layers (a hybrid model has no window)
        backends = {w: backend.for_window(w) for w in set(spec.layer_windows) if w}
        windows = spec.layer_windows or (None,) * spec.num_layers
        self.layers = nn.ModuleList(
            self.layer_class(local, backends.get(w, backend), ops, tp, i)
            for i, w in enumerate(windows)
        )
        self.norm = self.norm_class(spec.hidden_size, spec.rms_norm_eps, ops)
        self.lm_head = (
            None
            if spec.tie_word_embeddings
            else nn.Linear(spec.hidden_size, self.plan.vocab_shard, bias=False)
        )
        self.rope: RotaryEmbedding | None = None
        self.local_rope: RotaryEmbedding | None = None  # the sliding layers' (Gemma 3)
        # per layer: rotated with local_rope's tables (a sliding layer, when there is one)
        self._local_layers = tuple(
            spec.local_rope is not None and bool(spec.layer_window(i))
            for i in range(spec.num_layers)
        )
        # per layer: its KV group in the hybrid layout (the step's meta.groups, when set)
        self._kv_groups = (
            KVGroups.for_layer_windows(spec.layer_windows).layer_group
            if spec.hybrid
            else (0,) * spec.num_layers
        )
        # a packed copy of the tied embeddings for the LM head (``model.linear``)
        self.lm_head_packed: nn.Module | None = None
        # the layers in one C++ call (``model.fused_stack``), set after prepacking
        self.fused_stack: FusedStack | None = None

    def init_rope(self, device: torch.device, max_positions: int) -> None:
        s = self.spec
        self.rope = RotaryEmbedding(s.rope, s.head_dim, max_positions, device)
        if s.local_rope is not None:
            self.local_rope = RotaryEmbedding(s.local_rope, s.head_dim, max_positions, device)

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[torch.Tensor],
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        assert self.rope is not None, "init_rope() must be called before forward()"
        x = self._embed(input_ids)
        tables = self.rope.tables(x.dtype, meta.max_position)
        local = tables
        if self.local_rope is not None:
            local = self.local_rope.tables(x.dtype, meta.max_position)
        fused = None
        if self.fused_stack is not None:
            fused = self.fused_stack(x, positions, tables, kv_caches, meta, local)
        if fused is not None:
            x, residual = fused
        else:
            residual = None
            layers = zip(self.layers, kv_caches, self._local_layers, self._kv_groups, strict=True)
            for layer, cache, sliding, group in layers:
                rope = local if sliding else tables
                x, residual = layer(positions, x, residual, rope, cache, meta.for_group(group))
        assert residual is not None
        return self.norm.add_forward(x, residual)[0]

    def _embed(self, ids: torch.Tensor) -> torch.Tensor:
        if self.tp is None:
            return self.embed_tokens(ids)
        start, n = self.plan.vocab_start, self.plan.vocab_shard
        local = ids - start
        mine = (local >= 0) & (local < n)
        x = self.embed_tokens(local.clamp(0, n - 1))
        x.mul_(mine.unsqueeze(-1).to(x.dtype))  # other ranks' rows are zero here
        return self.tp.all_reduce(x)

    def compute_logits(
        self, hidden: torch.Tensor, argmax_only: bool = False
    ) -> torch.Tensor | None:
        """float32 ``[rows, vocab]``; under tensor parallelism every rank must call it with
        the same rows (a collective), and only rank 0 gets the logits (others: None).

        ``argmax_only`` (the rows only need their argmax: ``sampling.argmax_only``): on one
        rank and without soft-capping, the LM head's output is returned in its own dtype,
        sparing a float32 copy of ``[rows, vocab]`` (~3 ms a step for a 262k vocabulary)."""
        if self.lm_head_packed is not None:
            logits = self.lm_head_packed(hidden)
        elif self.lm_head is not None:
            logits = self.lm_head(hidden)
        else:
            logits = F.linear(hidden, self.embed_tokens.weight)
        if self.tp is not None:
            gathered = self.tp.gather_vocab(logits)
            logits = None if gathered is None else gathered
        if logits is None:
            return None
        cap = self.spec.final_logit_softcap
        if argmax_only and cap is None and self.tp is None:
            return logits
        logits = logits.float()
        return logits if cap is None else torch.tanh(logits / cap) * cap

    def expected_weights(self) -> dict[str, tuple[int, ...]]:
        """HF checkpoint tensor names this model needs, with their shapes."""
        s = self.spec
        q, kv = s.num_heads * s.head_dim, s.num_kv_heads * s.head_dim
        out: dict[str, tuple[int, ...]] = {
            "model.embed_tokens.weight": (s.vocab_size, s.hidden_size)
        }
        for i in range(s.num_layers):
            p = f"model.layers.{i}."
            out[p + "input_layernorm.weight"] = (s.hidden_size,)
            out[p + "post_attention_layernorm.weight"] = (s.hidden_size,)
            projections = (("q_proj", q), ("k_proj", kv), ("v_proj", kv))
            if s.fused_checkpoint:  # Phi-3 stores q, k and v as one tensor
                projections = (("qkv_proj", q + 2 * kv),)
            for name, rows in projections:
                out[p + f"self_attn.{name}.weight"] = (rows, s.hidden_size)
                if s.attention_bias:
                    out[p + f"self_attn.{name}.bias"] = (rows,)
            out[p + "self_attn.o_proj.weight"] = (s.hidden_size, q)
            if s.o_proj_bias:
                out[p + "self_attn.o_proj.bias"] = (s.hidden_size,)
            if s.attention_sinks:
                out[p + "self_attn.sinks"] = (s.num_heads,)
            if s.qk_norm:
                out[p + "self_attn.q_norm.weight"] = (s.head_dim,)
                out[p + "self_attn.k_norm.weight"] = (s.head_dim,)
            out.update(mlp_weights(s, i, p))
        out["model.norm.weight"] = (s.hidden_size,)
        if not s.tie_word_embeddings:
            out["lm_head.weight"] = (s.vocab_size, s.hidden_size)
        return out

    def load_weight(self, hf_name: str, tensor: torch.Tensor) -> bool:
        """Copy one HF tensor into place (slicing fused projections).

        Returns False when the name is not a parameter of this model (the caller decides
        whether that is an error). Shapes must already have been checked.
        """
        if hf_name.endswith(_IGNORED_SUFFIXES):
            return True
        if hf_name == "lm_head.weight" and self.lm_head is None:
            return True  # tied checkpoints sometimes carry a copy
        name = our_mlp_name(hf_name.removeprefix("model."))
        if not hasattr(self, "_params"):
            self._params = dict(self.named_parameters())
        params = self._params
        module, _, leaf = name.rpartition(".")  # leaf: weight or bias
        parent, _, proj = module.rpartition(".")
        if proj in FUSED_PIECES:
            ours, shard = FUSED_PIECES[proj]
            target = params.get(f"{parent}.{ours}.{leaf}")
            if target is None:
                return False
            sizes = self._fused_sizes(ours, target.shape[0])
            offset = sum(sizes[:shard])
            with torch.no_grad():
                target[offset : offset + sizes[shard]].copy_(tensor)
            return True
        target = params.get(name)
        if target is None:
            return False
        with torch.no_grad():
            target.copy_(tensor)
        return True

    def _fused_sizes(self, ours: str, rows: int) -> list[int]:
        """The pieces' rows in fused projection ``ours`` of ``rows`` rows (this rank's)."""
        s = self.local_spec
        if ours == "qkv_proj":
            kv = s.num_kv_heads * s.head_dim
            return [s.num_heads * s.head_dim, kv, kv]
        return [rows // 2, rows // 2]  # gate_up_proj, of a dense MLP or an expert
