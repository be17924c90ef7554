"""Triton KV writes (``reshape_and_cache``): a step's new K/V rows stored at their slots,
copied into a 16/32-bit cache or quantized into int8/fp8 codes with per-token float16
scales (``model/kv_quant.py``'s formats and arithmetic, with its K shift). One program per
(token, KV head); a negative slot is skipped (a padded row).

An fp8 row takes, of the candidate scales ``amax / qmax * steps[c]``, the one whose
decoded row is nearest (the first on a tie), as ``QuantizedKVCache.quantize`` does; the
candidates' steps come from the host so both compute the same scales.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kvserve.model.kv_quant import QuantizedKVCache

_F16_TINY = tl.constexpr(6.103515625e-05)  # float16's smallest normal


@triton.jit
def _round_even(y):
    """Round half to even (``torch.round``) of |y| < 2**22."""
    r = tl.floor(y + 0.5)
    odd = (r - 2.0 * tl.floor(r * 0.5)) != 0
    return tl.where(((r - y) == 0.5) & odd, r - 1.0, r)


@triton.jit
def _fp8_round(y, MBITS: tl.constexpr, EMIN: tl.constexpr):
    """``y`` (within the format's range) rounded half to even to an fp8 value of
    ``MBITS`` mantissa bits and smallest normal exponent ``EMIN``, as float32: converting
    it is then exact, whatever rounding the conversion uses (the interpreter's rounds
    ties away from zero)."""
    e = ((y.to(tl.int32, bitcast=True) >> 23) & 0xFF) - 127
    quantum = ((tl.maximum(e, EMIN) - MBITS + 127) << 23).to(tl.float32, bitcast=True)
    return _round_even(y / quantum) * quantum


@triton.jit
def _write_plain_kernel(X, C, SLOTS, sx_t, sx_h, sc_slot, sc_h,
                        D: tl.constexpr, DP: tl.constexpr):  # fmt: skip
    t = tl.program_id(0)
    h = tl.program_id(1)
    slot = tl.load(SLOTS + t).to(tl.int64)
    if slot >= 0:
        d = tl.arange(0, DP)
        x = tl.load(X + t * sx_t + h * sx_h + d, mask=d < D)
        tl.store(C + slot * sc_slot + h * sc_h + d, x.to(C.dtype.element_ty), mask=d < D)


@triton.jit
def _write_quant_kernel(X, C, S, SLOTS, SHIFT, STEPS, qmax, sx_t, sx_h, sc_slot, sc_h,
                        ss_slot, D: tl.constexpr, DP: tl.constexpr, INT8: tl.constexpr,
                        NCAND: tl.constexpr, SHIFTED: tl.constexpr, MBITS: tl.constexpr,
                        EMIN: tl.constexpr):  # fmt: skip
    t = tl.program_id(0)
    h = tl.program_id(1)
    slot = tl.load(SLOTS + t).to(tl.int64)
    if slot >= 0:
        d = tl.arange(0, DP)
        ok = d < D
        x = tl.load(X + t * sx_t + h * sx_h + d, mask=ok, other=0.0).to(tl.float32)
        if SHIFTED:
            x = x - tl.load(SHIFT + h * D + d, mask=ok, other=0.0)
        amax = tl.max(tl.abs(x), 0)
        if INT8:
            s = tl.maximum(tl.div_rn(amax, qmax), 1e-8).to(tl.float16)
            sf = s.to(tl.float32)  # 0 for an all-zero row (1e-8 underflows float16)
            y = tl.minimum(tl.maximum(tl.div_rn(x, tl.where(sf > 0, sf, 1.0)), -qmax), qmax)
            code = _round_even(y).to(tl.int8)
        else:
            s = tl.maximum(tl.maximum(tl.div_rn(amax, qmax) * tl.load(STEPS), 1e-8).to(
                tl.float16), _F16_TINY)  # fmt: skip
            sf = s.to(tl.float32)
            code = _fp8_round(tl.minimum(tl.maximum(tl.div_rn(x, sf), -qmax), qmax), MBITS, EMIN)
            code = code.to(C.dtype.element_ty)
            diff = code.to(tl.float32) * sf - x
            err = tl.sum(tl.where(ok, diff * diff, 0.0), 0)
            for c in range(1, NCAND):
                s_c = tl.maximum(tl.maximum(tl.div_rn(amax, qmax) * tl.load(STEPS + c), 1e-8).to(
                    tl.float16), _F16_TINY)  # fmt: skip
                sf_c = s_c.to(tl.float32)
                code_c = _fp8_round(tl.minimum(tl.maximum(tl.div_rn(x, sf_c), -qmax), qmax),
                                    MBITS, EMIN).to(C.dtype.element_ty)  # fmt: skip
                diff = code_c.to(tl.float32) * sf_c - x
                err_c = tl.sum(tl.where(ok, diff * diff, 0.0), 0)
                better = err_c < err
                code = tl.where(better, code_c, code)
                s = tl.where(better, s_c, s)
                err = tl.where(better, err_c, err)
        tl.store(C + slot * sc_slot + h * sc_h + d, code, mask=ok)
        tl.store(S + slot * ss_slot + h, s)


def write_kv(k: torch.Tensor, v: torch.Tensor, slots: torch.Tensor, cache: torch.Tensor) -> None:
    """Copy ``k``/``v`` ``[T, H, D]`` into ``cache`` ``[2, slots, H, D]`` at ``slots``."""
    if k.shape[0] == 0:
        return
    d = k.shape[2]
    dp = triton.next_power_of_2(d)
    for which, x in ((0, k), (1, v)):
        c = cache[which]
        _write_plain_kernel[x.shape[:2]](
            x, c, slots, x.stride(0), x.stride(1), c.stride(0), c.stride(1), D=d, DP=dp
        )


def write_quantized(
    cache: QuantizedKVCache, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor
) -> None:
    """``cache.write`` for a cache of rows with per-token scales: the same codes and scales
    (an fp8 row may pick another of two candidates whose errors differ in the last bit:
    the sums' order differs)."""
    if k.shape[0] == 0:
        return
    d = k.shape[2]
    fp8 = cache.fmt.storage != torch.int8
    mbits, emin = (2, -14) if cache.fmt.storage == torch.float8_e5m2 else (3, -6)
    steps = 2 ** (torch.arange(cache.candidates, device=k.device) / cache.candidates)
    for which, x in ((0, k), (1, v)):
        shift = cache.k_shift if which == 0 else None
        c, s = cache.data[which], cache.scale[which]
        _write_quant_kernel[x.shape[:2]](
            x, c, s, slots, shift if shift is not None else s, steps, cache.qmax,
            x.stride(0), x.stride(1), c.stride(0), c.stride(1), s.stride(0), D=d,
            DP=triton.next_power_of_2(d), INT8=not fp8, NCAND=cache.candidates if fp8 else 1,
            SHIFTED=shift is not None, MBITS=mbits, EMIN=emin, enable_fp_fusion=False,
        )  # fmt: skip
