"""Load an HF-format checkpoint directory (single or sharded safetensors) into our model."""

from __future__ import annotations

import contextlib
import json
import logging
from collections.abc import Iterator
from pathlib import Path

import torch
from safetensors import safe_open
from tqdm import tqdm

from kvserve.model.attention import AttentionBackend
from kvserve.model.gemma import GemmaForCausalLM
from kvserve.model.gpt_oss import MXFP4_BLOCKS, MXFP4_SCALES, expand, model_names
from kvserve.model.llama import LlamaForCausalLM
from kvserve.model.ops import TorchOps
from kvserve.model.parallel import TPGroup
from kvserve.model.quant_load import QuantLoad, dequantized, int8_names, read_manifest
from kvserve.model.quantized import BLOCKS, row_bytes
from kvserve.model.spec import ModelConfigError, ModelSpec
from kvserve.utils import parse_dtype

logger = logging.getLogger(__name__)


class WeightLoadError(ValueError):
    """A checkpoint's tensors do not match its config; the message names file and tensor."""


def resolve_dtype(requested: str, spec: ModelSpec, device: torch.device) -> torch.dtype:
    """``auto`` → the checkpoint's dtype (float32 if it names none); else the named dtype."""
    if requested != "auto":
        return parse_dtype(requested)
    if spec.torch_dtype is None:
        return torch.float32
    try:
        return parse_dtype(str(spec.torch_dtype))
    except ValueError:
        raise ModelConfigError(
            f"config.json: field 'dtype'={spec.torch_dtype!r} is not supported; "
            "pass dtype=float32|float16|bfloat16"
        ) from None


def checkpoint_files(model_dir: Path) -> dict[str, Path]:
    """Map tensor name → safetensors file, from the shard index if there is one."""
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError) as e:
            raise WeightLoadError(f"{index}: unreadable shard index ({e!r})") from None
        files = {name: model_dir / fname for name, fname in weight_map.items()}
        for path in set(files.values()):
            if not path.is_file():
                raise WeightLoadError(f"{index}: names shard {path.name} which does not exist")
        return files
    shards = sorted(model_dir.glob("*.safetensors"))
    if not shards:
        raise WeightLoadError(f"{model_dir}: no *.safetensors files (only safetensors is loaded)")
    files = {}
    for path in shards:
        with safe_open(str(path), framework="pt") as f:
            for name in f.keys():  # noqa: SIM118 - safe_open is not a dict
                files[name] = path
    return files


@contextlib.contextmanager
def _no_param_init() -> Iterator[None]:
    """Modules built on the meta device skip their parameters' random init (the checkpoint
    fills them). Not only wasted work: torch runs a meta tensor's ``normal_`` through a
    path that imports ``torch._dynamo``, which imports Triton where it is installed (it
    comes with xgrammar), whose bindings then print leak warnings at every exit."""
    names = ("normal_", "uniform_", "kaiming_uniform_", "ones_", "zeros_", "trunc_normal_")
    saved = {n: getattr(torch.nn.init, n) for n in names}
    for n in names:
        setattr(torch.nn.init, n, lambda tensor, *args, **kwargs: tensor)
    try:
        yield
    finally:
        for n, f in saved.items():
            setattr(torch.nn.init, n, f)


def model_class(spec: ModelSpec) -> type[LlamaForCausalLM]:
    """The module class that runs ``spec``'s architecture."""
    return GemmaForCausalLM if spec.gemma_norms else LlamaForCausalLM


def load_model(
    model_dir: str | Path,
    spec: ModelSpec,
    dtype: torch.dtype,
    device: torch.device,
    backend: AttentionBackend,
    ops: TorchOps,
    max_positions: int,
    tp: TPGroup | None = None,
    quantization: str = "auto",
) -> LlamaForCausalLM:
    """Build the model on ``device`` in ``dtype`` and fill it from the checkpoint (with
    ``tp``, only this rank's shard, reading just its slices of each tensor).

    Tensors the checkpoint stores as raw GGUF blocks (``model/quant_load.py``) stay
    quantized with ``quantization`` ``auto`` on a CPU with the C++ kernels (under tensor
    parallelism each rank keeps its rows, and its input columns where they are whole
    blocks); otherwise (``none`` included) they are dequantized into ``dtype``.
    ``int8`` also quantizes the float matrices ``int8_names`` picks to int8; it raises
    ``ModelConfigError`` where the quantized kernels cannot run.

    Raises ``WeightLoadError`` naming the file and tensor when a tensor is missing, has the
    wrong shape, or is not part of the architecture.
    """
    model_dir = Path(model_dir)
    with torch.device("meta"), _no_param_init():
        model = model_class(spec)(spec, backend, ops, tp)
        keep = _keeps_quantized(quantization, device)
        expected = model.expected_weights()
        int8 = int8_names(model, expected) if quantization == "int8" else []
        quant = QuantLoad(model, read_manifest(model_dir), keep, int8)
    model = model.to_empty(device=device).to(dtype)
    files = checkpoint_files(model_dir)
    ours = {n: text_tensor_name(spec, n) for n in files}  # checkpoint name → the model's
    present = {m for n in ours.values() if n is not None for m in model_names(spec, n)}
    missing = [n for n in expected if n not in present]
    if missing:
        raise WeightLoadError(
            f"{model_dir}: checkpoint lacks {len(missing)} tensor(s) the config requires, "
            f"e.g. {missing[:3]}"
        )
    by_file: dict[Path, list[str]] = {}
    for name, path in files.items():
        if not _is_kv_scale(name) and ours[name] is not None:  # kv scales: load_kv_scales
            by_file.setdefault(path, []).append(name)
    total = sum(len(names) for names in by_file.values())
    with tqdm(total=total, desc="Loading weights", unit="tensor", leave=False) as bar:
        for path, names in sorted(by_file.items()):
            with safe_open(str(path), framework="pt", device="cpu") as f:
                for name in names:
                    own: str = ours[name]  # type: ignore[assignment]
                    targets = model_names(spec, own)
                    if len(targets) == 1:  # read through the rank's slices
                        tslice = f.get_slice(name)
                        _load_one(model, expected, path, targets[0], tslice, dtype, quant)
                    elif targets:  # a stacked tensor: split into the model's (gpt-oss's experts)
                        scales = _scales_of(files, path, name)
                        parts = _expand(spec, path, own, f.get_tensor(name), scales)
                        for part, tensor in parts:
                            _load_one(model, expected, path, part, _Whole(tensor), dtype, quant)
                    bar.update(1)
    quant.finish(dtype)
    model.init_rope(device, max_positions)
    model.eval()
    return model


# a multimodal checkpoint's language model, as transformers 4 and 5 name it
_LANGUAGE_MODEL = (
    ("language_model.model.", "model."),
    ("model.language_model.", "model."),
    ("language_model.lm_head.", "lm_head."),
)
_VISION = ("vision_tower.", "multi_modal_projector.")


def text_tensor_name(spec: ModelSpec, name: str) -> str | None:
    """The model's name for checkpoint tensor ``name``; None for a tensor of a multimodal
    checkpoint's vision part (served text-only: ``spec.multimodal``)."""
    if not spec.multimodal:
        return name
    bare = name.removeprefix("model.")
    if bare.startswith(_VISION):
        return None
    for theirs, own in _LANGUAGE_MODEL:
        if name.startswith(theirs):
            return own + name[len(theirs) :]
    return name


def _is_kv_scale(name: str) -> bool:
    return name.endswith((".self_attn.k_scale", ".self_attn.v_scale"))


def has_kv_scales(model_dir: str | Path) -> bool:
    """Whether the checkpoint carries fp8 KV scales (``…self_attn.k_scale`` tensors)."""
    return any(_is_kv_scale(n) for n in checkpoint_files(Path(model_dir)))


def load_kv_scales(model_dir: str | Path, num_layers: int) -> list[tuple[float, float]] | None:
    """Per-layer ``(k_scale, v_scale)`` from ``model.layers.N.self_attn.{k,v}_scale`` tensors
    (the convention of fp8-KV checkpoints), or None when the checkpoint carries none.
    A per-head tensor is reduced to its maximum (the cache keeps one scale per head, so a
    larger scale is the safe direction)."""
    files = checkpoint_files(Path(model_dir))
    if not any(_is_kv_scale(n) for n in files):
        return None
    scales = []
    for i in range(num_layers):
        pair = []
        for which in ("k_scale", "v_scale"):
            name = f"model.layers.{i}.self_attn.{which}"
            if name not in files:
                raise WeightLoadError(f"{model_dir}: has KV scales but lacks {name!r}")
            with safe_open(str(files[name]), framework="pt", device="cpu") as f:
                pair.append(float(f.get_tensor(name).float().max()))
        scales.append((pair[0], pair[1]))
    return scales


def _expand(spec: ModelSpec, path: Path, name: str, tensor: torch.Tensor, scales):
    try:
        return expand(spec, name, tensor, scales)
    except ValueError as e:
        raise WeightLoadError(f"{path}: {e}") from None


def _scales_of(files: dict[str, Path], path: Path, name: str) -> torch.Tensor | None:
    """The MXFP4 scales of blocks tensor ``name`` (from whichever shard holds them); None
    for a tensor that is not MXFP4 blocks. Raises ``WeightLoadError`` when they are missing."""
    if not name.endswith(MXFP4_BLOCKS):
        return None
    scales = name.removesuffix(MXFP4_BLOCKS) + MXFP4_SCALES
    if scales not in files:
        raise WeightLoadError(f"{path}: MXFP4 tensor {name!r} comes without {scales!r}")
    with safe_open(str(files[scales]), framework="pt", device="cpu") as f:
        return f.get_tensor(scales)


class _Whole:
    """A tensor in memory read as a safetensors slice is (``_load_one``'s argument)."""

    def __init__(self, tensor: torch.Tensor):
        self.tensor = tensor

    def get_shape(self) -> list[int]:
        return list(self.tensor.shape)

    def __getitem__(self, index) -> torch.Tensor:
        return self.tensor[index]


def _keeps_quantized(quantization: str, device: torch.device) -> bool:
    """Whether raw GGUF blocks are served quantized: ``auto`` or ``int8``, a CPU whose C++
    kernels load. Raises ``ModelConfigError`` for ``int8`` where that does not hold."""
    if quantization == "none":
        return False
    from kvserve.model.cpu_kernels import load_cpu_kernels

    ok = device.type == "cpu" and load_cpu_kernels()
    if quantization == "int8" and not ok:
        raise ModelConfigError(
            "quantization int8 needs a CPU (--device cpu) and the C++ CPU kernels"
        )
    return ok


def _load_one(
    model, expected, path: Path, name: str, tslice, dtype: torch.dtype, quant: QuantLoad
) -> None:
    shape = tuple(tslice.get_shape())
    ggml_type = quant.manifest.get(name)
    if name in quant.requantize:  # --quantization int8 (a wrong shape: refused below)
        if shape == expected[name] and quant.keeps(name):
            quant.take_dense(name, tslice[:])
            return
    elif ggml_type is not None and name in expected:  # raw blocks: [rows, row bytes]
        rows, k = expected[name]
        if shape != (rows, row_bytes(ggml_type, k)):
            raise WeightLoadError(
                f"{path}: raw {ggml_type} tensor {name!r} has shape {list(shape)}, config "
                f"implies {rows} rows of {k}"
            )
        if quant.keeps(name):
            quant.take(name, model.plan.read_blocks(name, tslice, *BLOCKS[ggml_type]))
            return
        tslice = dequantized(tslice[:], ggml_type)
        shape = tuple(tslice.shape)
    if name in expected and shape != expected[name]:
        raise WeightLoadError(
            f"{path}: tensor {name!r} has shape {list(shape)}, config implies "
            f"{list(expected[name])}"
        )
    tensor = model.plan.read(name, tslice)  # only this rank's part under tensor parallelism
    if not model.load_weight(name, tensor.to(dtype)):
        raise WeightLoadError(
            f"{path}: tensor {name!r} is not part of {model.spec.architecture} "
            "with this config.json"
        )
