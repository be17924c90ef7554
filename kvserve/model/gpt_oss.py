"""gpt-oss (``GptOssForCausalLM``) checkpoints read into kvserve's MoE layout.

gpt-oss is Llama's decoder (``llama.LlamaForCausalLM``) with what ``ModelSpec`` flags: a
learned sink logit per attention head (``attention_sinks``, applied by every attention
backend), biases on every projection, sliding (128) and global layers alternating, YaRN,
and a mixture of experts with a biased router, the softmax over the top-k logits and a
clamped SwiGLU (``mlp.SparseMoE``, ``mlp.ClampedSwiGLU``).

Its checkpoint stores a layer's experts stacked, which ``expand`` splits as the tensors
are read, into the names a Qwen3-MoE checkpoint uses (so tensor parallelism, int8 and the
shape checks see one expert's tensor at a time):

- ``mlp.router.{weight,bias}`` → ``mlp.gate.{weight,bias}``;
- ``mlp.experts.gate_up_proj`` ``[experts, hidden, 2 * inter]`` (gate and up columns
  interleaved) and ``gate_up_proj_bias`` ``[experts, 2 * inter]`` → each expert's
  ``gate_proj`` and ``up_proj`` weight ``[inter, hidden]`` and bias;
- ``mlp.experts.down_proj`` ``[experts, inter, hidden]`` and ``down_proj_bias`` → each
  expert's ``down_proj`` weight ``[hidden, inter]`` and bias.

OpenAI's checkpoints store the two expert weights in MXFP4 (``quantization_config``
``mxfp4``): ``gate_up_proj_blocks`` / ``down_proj_blocks`` ``[experts, out, groups, 16]``
(two e2m1 codes a byte, low nibble first) with ``…_scales`` ``[experts, out, groups]``
(power-of-two exponents biased by 127), 32 values a group along the input. They are
dequantized as they are read (``dequantize_mxfp4``) and then split as above; kvserve
serves them in the model's dtype (no MXFP4 kernel yet).
"""

from __future__ import annotations

import torch

from kvserve.model.spec import ModelSpec

_STACKED = ("gate_up_proj", "gate_up_proj_bias", "down_proj", "down_proj_bias")
_FP4 = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)  # e2m1 magnitudes; code bit 3 is the sign
MXFP4_BLOCKS, MXFP4_SCALES = "_blocks", "_scales"


def dequantize_mxfp4(blocks: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """MXFP4 weights ``blocks`` uint8 ``[experts, out, groups, 16]`` with ``scales`` uint8
    ``[experts, out, groups]`` as float32 ``[experts, out, groups * 32]``, one expert at a
    time (the codes' lookup indices are 8 bytes each). Raises ValueError on other shapes
    or dtypes."""
    if (
        blocks.dtype != torch.uint8
        or scales.dtype != torch.uint8
        or blocks.dim() != 4
        or blocks.shape[-1] != 16
        or blocks.shape[:-1] != scales.shape
    ):
        raise ValueError(
            f"MXFP4 blocks {list(blocks.shape)} {blocks.dtype} and scales "
            f"{list(scales.shape)} {scales.dtype}: expected uint8 [experts, out, groups, 16] "
            "and uint8 [experts, out, groups]"
        )
    lut = torch.tensor(_FP4 + tuple(-x for x in _FP4))
    out = torch.empty(*scales.shape, 32)
    for e in range(blocks.shape[0]):
        codes = torch.stack([blocks[e] & 0x0F, blocks[e] >> 4], dim=-1).flatten(-2)
        exponent = scales[e].to(torch.int32).unsqueeze(-1) - 127
        out[e] = torch.ldexp(lut[codes.long()], exponent.float())
    return out.flatten(-2)


def _split(name: str) -> tuple[str, str] | None:
    """``(layer prefix ending in 'mlp.', what follows)`` of an MLP tensor name, else None."""
    prefix, sep, leaf = name.rpartition(".mlp.")
    return (prefix + sep, leaf) if sep else None


def model_names(spec: ModelSpec, name: str) -> list[str]:
    """The model's names for checkpoint tensor ``name`` (one, or an expert's each)."""
    parts = _split(name) if spec.family == "gpt_oss" else None
    if parts is None:
        return [name]
    mlp, leaf = parts
    if leaf.startswith("router."):
        return [mlp + "gate." + leaf.removeprefix("router.")]
    stacked = leaf.removeprefix("experts.")
    if leaf.startswith("experts.") and stacked.endswith(MXFP4_SCALES):
        return []  # read with its blocks
    stacked = stacked.removesuffix(MXFP4_BLOCKS)
    if not leaf.startswith("experts.") or stacked not in _STACKED:
        return [name]
    suffix = "bias" if stacked.endswith("_bias") else "weight"
    projections = ("gate_proj", "up_proj") if stacked.startswith("gate_up") else ("down_proj",)
    return [f"{mlp}experts.{e}.{p}.{suffix}" for e in range(spec.num_experts) for p in projections]


def expand(
    spec: ModelSpec, name: str, tensor: torch.Tensor, scales: torch.Tensor | None = None
) -> list[tuple[str, torch.Tensor]]:
    """Checkpoint tensor ``name`` as the model's tensors, in ``model_names``' order: a
    stacked expert tensor (its first dimension the experts) split and transposed to
    ``[out, in]`` rows, gate/up de-interleaved (MXFP4 ``…_blocks`` dequantized with their
    ``scales`` first); any other tensor as it is. Raises ValueError naming the tensor when
    its shape does not hold the config's experts."""
    names = model_names(spec, name)
    if len(names) == 1:
        return [(names[0], tensor)]
    if name.endswith(MXFP4_BLOCKS):
        if scales is None:
            raise ValueError(f"tensor {name!r} comes without its {MXFP4_SCALES} tensor")
        try:
            tensor = dequantize_mxfp4(tensor, scales).transpose(1, 2)  # as a bf16 checkpoint's
        except ValueError as e:
            raise ValueError(f"tensor {name!r}: {e}") from None
    if tensor.dim() < 2 or tensor.shape[0] != spec.num_experts:
        raise ValueError(
            f"tensor {name!r} has shape {list(tensor.shape)}, config implies "
            f"{spec.num_experts} experts stacked on its first dimension"
        )
    out: list[torch.Tensor] = []
    for e in range(spec.num_experts):
        t = tensor[e]  # [hidden, 2 * inter] / [2 * inter] / [inter, hidden] / [hidden]
        if "gate_up" in name:
            out += [t[..., 0::2], t[..., 1::2]]
        else:
            out.append(t)
    if tensor.dim() == 3:  # weights: the checkpoint's [in, out] as [out, in]
        out = [t.t() for t in out]
    return [(n, t.contiguous()) for n, t in zip(names, out, strict=True)]
