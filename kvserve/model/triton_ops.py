"""Batch-invariant GPU building blocks in Triton: RMSNorm (with the residual add), SiLU-and-
mul, RoPE and the linear layers' GEMM, for ``--batch-invariant`` on CUDA.

Every kernel computes a row from that row alone with a fixed shape of work: a norm's
reduction runs over one row in one program (the row's width fixes its order), and the GEMM
uses one tile shape and one K order whatever M is (no split-K, no shape-dependent
choice), so row i of a result has the same bits computed alone or among any other rows.
cuBLAS and torch's reductions pick their algorithm by shape, which is why a batch changes
their bits. With the Triton paged attention (``triton_attention.py``) the whole forward
pass keeps the contract the CPU kernels keep. Like the attention, these run under
Triton's interpreter on CPU tensors in the tests.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import nn

from kvserve.model.ops import TorchOps
from kvserve.model.triton_mode import interpreting

# the interpreter mishandles bf16 in dots and conversions from ints (triton_attention.py)
_WIDEN = tl.constexpr(interpreting())
GEMM_BM, GEMM_BN, GEMM_BK = 32, 64, 64  # fixed: part of the numerics


@triton.jit
def _rms_norm_kernel(X, R, W, Y, inner, sx_o, sx_i, sr, sy_o, sy_i, H, eps,
                     BH: tl.constexpr, ADD: tl.constexpr):  # fmt: skip
    """Row ``r`` (``r // inner``, ``r % inner`` over two strides): y = w * norm(x [+ res])."""
    row = tl.program_id(0)
    o, i = row // inner, row % inner
    h = tl.arange(0, BH)
    ok = h < H
    x = tl.load(X + o * sx_o + i * sx_i + h, mask=ok, other=0.0)
    if ADD:  # residual += x (rounded to the residual's type), the norm of the sum
        r_ptr = R + row * sr + h
        x = (tl.load(r_ptr, mask=ok, other=0.0).to(tl.float32) + x.to(tl.float32)).to(
            R.dtype.element_ty)  # fmt: skip
        tl.store(r_ptr, x, mask=ok)
    x32 = x.to(tl.float32)
    var = tl.sum(x32 * x32, 0) / H
    y = (x32 * (1.0 / tl.sqrt(var + eps))).to(Y.dtype.element_ty)
    w = tl.load(W + h, mask=ok, other=0.0).to(tl.float32)
    tl.store(Y + o * sy_o + i * sy_i + h, (w * y.to(tl.float32)).to(Y.dtype.element_ty), mask=ok)


@triton.jit
def _silu_mul_kernel(X, Y, sx, sy, inter, BI: tl.constexpr):
    row = tl.program_id(0)
    j = tl.program_id(1) * BI + tl.arange(0, BI)
    ok = j < inter
    gate = tl.load(X + row * sx + j, mask=ok, other=0.0).to(tl.float32)
    up = tl.load(X + row * sx + inter + j, mask=ok, other=0.0).to(tl.float32)
    act = (gate / (1.0 + tl.exp(-gate))).to(Y.dtype.element_ty).to(tl.float32)
    tl.store(Y + row * sy + j, (act * up).to(Y.dtype.element_ty), mask=ok)


@triton.jit
def _rope_kernel(X, POS, COS, SIN, sx_t, sx_h, sc, HALF: tl.constexpr):
    """One head of one token, rotated in place (NeoX halves)."""
    t = tl.program_id(0)
    h = tl.program_id(1)
    pos = tl.load(POS + t).to(tl.int64)
    d = tl.arange(0, HALF)
    base = X + t * sx_t + h * sx_h
    x1 = tl.load(base + d).to(tl.float32)
    x2 = tl.load(base + HALF + d).to(tl.float32)
    c1 = tl.load(COS + pos * sc + d).to(tl.float32)
    c2 = tl.load(COS + pos * sc + HALF + d).to(tl.float32)
    s1 = tl.load(SIN + pos * sc + d).to(tl.float32)
    s2 = tl.load(SIN + pos * sc + HALF + d).to(tl.float32)
    tl.store(base + d, (x1 * c1 - x2 * s1).to(X.dtype.element_ty))
    tl.store(base + HALF + d, (x2 * c2 + x1 * s2).to(X.dtype.element_ty))


@triton.jit
def _matmul_kernel(A, B, C, BIAS, M, N, K, sam, sbn, scm,
                   BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
                   HAS_BIAS: tl.constexpr):  # fmt: skip
    """C = A @ B^T (+ bias): A ``[M, K]``, B ``[N, K]`` (a linear layer's weight)."""
    rm = tl.program_id(0) * BM + tl.arange(0, BM)
    rn = tl.program_id(1) * BN + tl.arange(0, BN)
    rk = tl.arange(0, BK)
    acc = tl.zeros([BM, BN], tl.float32)
    for k0 in range(0, K, BK):
        kk = k0 + rk
        a = tl.load(A + rm[:, None] * sam + kk[None, :], mask=(rm[:, None] < M) & (kk[None, :] < K),
                    other=0.0)  # fmt: skip
        b = tl.load(B + rn[None, :] * sbn + kk[:, None], mask=(rn[None, :] < N) & (kk[:, None] < K),
                    other=0.0)  # fmt: skip
        if _WIDEN:
            acc += tl.dot(a.to(tl.float32), b.to(tl.float32))
        elif a.dtype == tl.float32:  # full float32 products, as torch's default (not TF32)
            acc += tl.dot(a, b, input_precision="ieee")
        else:
            acc += tl.dot(a, b)
    if HAS_BIAS:
        acc += tl.load(BIAS + rn, mask=rn < N, other=0.0).to(tl.float32)[None, :]
    tl.store(C + rm[:, None] * scm + rn[None, :], acc.to(C.dtype.element_ty),
             mask=(rm[:, None] < M) & (rn[None, :] < N))  # fmt: skip


def _rows(x: torch.Tensor) -> tuple[int, int, int, int]:
    """(rows, inner, outer stride, inner stride) of ``x``'s rows over its last dim (2-D,
    or 3-D with heads of any stride); the last dim must be contiguous."""
    assert x.stride(-1) == 1, "rows must be contiguous"
    if x.dim() == 2:
        return x.shape[0], 1, x.stride(0), 0
    assert x.dim() == 3
    return x.shape[0] * x.shape[1], x.shape[1], x.stride(0), x.stride(1)


def matmul(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``x @ weight.T (+ bias)`` for ``x`` ``[..., K]``, batch-invariant (module doc)."""
    shape = x.shape
    a = x.reshape(-1, shape[-1])
    if a.stride(-1) != 1:
        a = a.contiguous()
    m, k = a.shape
    n = weight.shape[0]
    out = torch.empty((m, n), dtype=x.dtype, device=x.device)
    if m:
        grid = (triton.cdiv(m, GEMM_BM), triton.cdiv(n, GEMM_BN))
        _matmul_kernel[grid](
            a, weight, out, bias if bias is not None else weight, m, n, k, a.stride(0),
            weight.stride(0), out.stride(0), BM=GEMM_BM, BN=GEMM_BN, BK=GEMM_BK,
            HAS_BIAS=bias is not None, enable_fp_fusion=False,
        )  # fmt: skip
    return out.view(*shape[:-1], n)


class TritonOps(TorchOps):
    """``TorchOps`` as batch-invariant Triton kernels (same rounding points; sums in
    another order, so bits may differ from torch's in the last place)."""

    def rms_norm(self, x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
        y = torch.empty(x.shape, dtype=x.dtype, device=x.device)
        self._norm(x, None, w, eps, y)
        return y

    def add_rms_norm(
        self, x: torch.Tensor, residual: torch.Tensor, w: torch.Tensor, eps: float
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Updates ``residual`` in place to ``residual + x``."""
        assert residual.is_contiguous() and residual.dim() == 2
        y = torch.empty(x.shape, dtype=x.dtype, device=x.device)
        self._norm(x, residual, w, eps, y)
        return y, residual

    @staticmethod
    def _norm(x, residual, w, eps, y) -> None:
        if x.stride(-1) != 1:
            x = x.contiguous()
        rows, inner, so, si = _rows(x)
        _, _, yo, yi = _rows(y)
        h = x.shape[-1]
        if rows:
            _rms_norm_kernel[(rows,)](
                x, residual if residual is not None else x, w, y, inner, so, si,
                h if residual is not None else 0, yo, yi, h, eps,
                BH=triton.next_power_of_2(h), ADD=residual is not None, enable_fp_fusion=False,
            )  # fmt: skip

    def silu_and_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        x = gate_up.reshape(-1, gate_up.shape[-1])
        if x.stride(-1) != 1:
            x = x.contiguous()
        inter = x.shape[1] // 2
        y = torch.empty((x.shape[0], inter), dtype=x.dtype, device=x.device)
        if x.shape[0]:
            grid = (x.shape[0], triton.cdiv(inter, 1024))
            _silu_mul_kernel[grid](x, y, x.stride(0), y.stride(0), inter, BI=1024)
        return y.view(*gate_up.shape[:-1], inter)

    def rope(self, positions, q, k, cos, sin):
        """Rotates ``q`` and ``k`` ``[T, H, D]`` in place (heads of any stride)."""
        for x in (q, k):
            assert x.stride(-1) == 1 and cos.is_contiguous()
            if x.shape[0]:
                _rope_kernel[(x.shape[0], x.shape[1])](
                    x, positions, cos, sin, x.stride(0), x.stride(1), cos.stride(0),
                    HALF=x.shape[-1] // 2, enable_fp_fusion=False,
                )  # fmt: skip
        return q, k


class BatchInvariantLinear(nn.Module):
    """A linear layer on the batch-invariant Triton GEMM (the weight is shared, not
    copied)."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None):
        super().__init__()
        self.weight = nn.Parameter(weight, requires_grad=False)
        self.bias = None if bias is None else nn.Parameter(bias, requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return matmul(x, self.weight, self.bias)


def make_batch_invariant(model: nn.Module) -> int:
    """Replace every ``nn.Linear`` in ``model`` by a ``BatchInvariantLinear``, in place;
    a model whose LM head is tied to its embeddings gets one as ``lm_head_packed`` (over
    the same matrix). Returns how many layers were replaced."""
    count = 0
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if isinstance(child, nn.Linear):
                parent.register_module(name, BatchInvariantLinear(child.weight, child.bias))
                count += 1
    if hasattr(model, "lm_head_packed") and getattr(model, "lm_head", None) is None:
        model.lm_head_packed = BatchInvariantLinear(model.embed_tokens.weight)
    return count
