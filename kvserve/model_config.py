"""Which checkpoint to load and how (``ModelConfig``), and the choices of its fields."""

from __future__ import annotations

from dataclasses import dataclass

ATTENTION_BACKENDS = ("auto", "torch", "cpu", "triton")
QUANTIZATION_MODES = ("auto", "none", "int8")


def check_choice(name: str, value: str, choices: tuple[str, ...]) -> None:
    """Raises ValueError naming ``name`` when ``value`` is not one of ``choices``."""
    if value not in choices:
        raise ValueError(f"{name} {value!r} is not one of {', '.join(choices)}")


@dataclass(frozen=True)
class ModelConfig:
    """Which checkpoint to load and how.

    ``dtype`` ``auto`` takes the checkpoint's dtype. ``max_model_len`` ``None`` takes the
    model's ``max_position_embeddings``. ``attention_backend`` ``auto`` uses the C++ CPU kernels
    (paged decode attention, fused RMSNorm/RoPE/SiLU) on CPU when they build, the Triton
    kernels on a GPU, else the portable PyTorch (SDPA) path; ``torch`` forces the latter,
    ``cpu`` and ``triton`` require theirs. Except with ``torch``, bf16/fp16 linear weights
    on a CPU are prepacked for oneDNN. ``enforce_eager``: no CUDA graphs (worker/cuda_graphs).
    ``batch_invariant``: Triton GEMMs and norms too (``model/triton_ops.py``), so on a GPU a
    row's output does not depend on the batch (the CPU kernels always keep that contract).
    ``quantization`` ``auto`` serves a GGUF file's Q4_0/Q4_1/Q4_K/Q5_K/Q6_K/Q8_0 matrices
    quantized on a CPU (``model/quantized.py``); ``none`` dequantizes them at load into ``dtype``;
    ``int8`` also quantizes a float checkpoint's projections, embeddings and LM head at load
    to int8 with a scale per output row (``model/quant_load.int8_names``,
    ``quantized.pack_int8``), CPU only.
    """

    model: str
    dtype: str = "auto"
    max_model_len: int | None = None
    device: str = "auto"
    seed: int = 0
    attention_backend: str = "auto"
    enforce_eager: bool = False
    batch_invariant: bool = False
    quantization: str = "auto"

    def __post_init__(self) -> None:
        check_choice("attention_backend", self.attention_backend, ATTENTION_BACKENDS)
        check_choice("quantization", self.quantization, QUANTIZATION_MODES)
        if self.quantization == "int8" and self.device.startswith("cuda"):
            raise ValueError("quantization int8 runs on the CPU kernels; drop it on a GPU")
        if self.max_model_len is not None and self.max_model_len <= 0:
            raise ValueError(f"max_model_len must be positive, got {self.max_model_len}")
