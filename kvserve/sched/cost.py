"""What it costs to bring a preempted request back, from rates measured while serving.

- **Recompute** re-prefills the request's ``L`` computed tokens. Each engine step's time is
  modelled as ``t = c0 + c_tok·tokens + c_attn·pairs`` where ``pairs`` counts query-key
  pairs of the step's attention (``Σ n·(start + (n+1)/2)`` over its chunks), fitted online
  by exponentially-forgetting least squares over the measured steps. Re-prefilling ``L``
  tokens then costs ``c_tok·L + c_attn·L(L+1)/2``: linear for the MLPs, quadratic for
  attention — less the leading tokens whose blocks other requests keep in the prefix
  cache, which a recompute gets back for free.
- **Swap** copies the blocks out and back: ``2·(s0 + bytes/bandwidth)``, fitted the same
  way from the measured copies (and seeded with a memcpy of a few MiB at start).

Before the first measurements the fits rest on weak priors. ``crossover_tokens`` is the
sequence length above which swapping is cheaper than recomputing.
"""

from __future__ import annotations

import math
import time

import torch


class DecayedLeastSquares:
    """``y ≈ θ·x`` fitted over observations weighted by ``decay ** age``, regularized
    toward ``prior`` (``prior_weight`` scales how hard), with non-negative coefficients."""

    def __init__(self, prior: list[float], scale: list[float], prior_weight: float, decay: float):
        self.n = len(prior)
        self.scale = scale  # features are divided by these to keep the system well-posed
        self.prior = [p * s for p, s in zip(prior, scale, strict=True)]
        self.prior_weight = prior_weight
        self.decay = decay
        # plain floats: observe() runs once per engine step, a few µs of Python
        self.xx = [[0.0] * self.n for _ in range(self.n)]
        self.xy = [0.0] * self.n
        self.count = 0
        self._theta: list[float] | None = None

    def observe(self, x: list[float], y: float) -> None:
        v = [a / s for a, s in zip(x, self.scale, strict=True)]
        d = self.decay
        for i in range(self.n):
            row = self.xx[i]
            for j in range(self.n):
                row[j] = row[j] * d + v[i] * v[j]
            self.xy[i] = self.xy[i] * d + v[i] * y
        self.count += 1
        self._theta = None

    def coefficients(self) -> list[float]:
        """θ per unscaled feature."""
        if self._theta is None:
            # ridge toward the prior, scaled by each feature's own weight in the data
            # (plus a floor), so the prior rules an empty fit and barely biases a full one
            xx = torch.tensor(self.xx, dtype=torch.float64)
            reg = self.prior_weight * (xx.diagonal() * 1e-4 + 1e-3)
            a = xx + torch.diag(reg)
            b = torch.tensor(self.xy, dtype=torch.float64)
            b = b + reg * torch.tensor(self.prior, dtype=torch.float64)
            theta = _nonnegative_solve(a, b)
            self._theta = [t / s for t, s in zip(theta, self.scale, strict=True)]
        return self._theta


def _nonnegative_solve(a: torch.Tensor, b: torch.Tensor) -> list[float]:
    """argmin over θ ≥ 0 of θᵀaθ − 2θᵀb (least squares in normal form), by trying every
    subset of free coefficients — fine for the two or three features used here."""
    n = a.shape[0]
    best, best_obj = [0.0] * n, 0.0
    for mask in range(1, 1 << n):
        idx = [i for i in range(n) if mask >> i & 1]
        sub = torch.linalg.solve(a[idx][:, idx], b[idx])
        if (sub < 0).any():
            continue
        theta = torch.zeros(n, dtype=a.dtype)
        theta[idx] = sub
        obj = float(theta @ a @ theta - 2 * theta @ b)
        if obj < best_obj:
            best, best_obj = theta.tolist(), obj
    return best


class PreemptionCostModel:
    """Seconds to restore a preempted request by swap or by recompute."""

    def __init__(self, bytes_per_token: int, *, decay: float = 0.995):
        self.bytes_per_token = bytes_per_token
        # priors: 50 µs/token, 2 ns per attention pair, 1 ms per step; 5 GB/s copies
        self.step = DecayedLeastSquares([1e-3, 5e-5, 2e-9], [1.0, 1e2, 1e5], 1.0, decay)
        self.copy = DecayedLeastSquares([2e-5, 2e-10], [1.0, 1e6], 1.0, decay)

    def calibrate_copy(self, device: torch.device, nbytes: int = 8 << 20) -> None:
        """Seed the copy fit with one timed copy of ``nbytes`` on ``device``."""
        src = torch.empty(nbytes, dtype=torch.uint8, device=device)
        dst = torch.empty_like(src, device="cpu")
        for _ in range(2):  # the first one pays for page faults
            t0 = time.perf_counter()
            dst.copy_(src)
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            self.observe_copy(nbytes, time.perf_counter() - t0)

    # ---- measurements ------------------------------------------------------------------
    def observe_step(self, num_tokens: int, attention_pairs: float, seconds: float) -> None:
        self.step.observe([1.0, float(num_tokens), float(attention_pairs)], seconds)

    def observe_copy(self, nbytes: int, seconds: float) -> None:
        self.copy.observe([1.0, float(nbytes)], seconds)

    # ---- estimates ---------------------------------------------------------------------
    def recompute_seconds(self, num_tokens: int, cached: int = 0) -> float:
        """Re-prefilling tokens ``cached .. num_tokens`` (the first ``cached`` come back
        from the prefix cache)."""
        _, c_tok, c_attn = self.step.coefficients()
        n = max(num_tokens - cached, 0)
        return c_tok * n + c_attn * (num_tokens * (num_tokens + 1) - cached * (cached + 1)) / 2

    def swap_seconds(self, num_blocks: int, block_size: int) -> float:
        """Out and back in."""
        s0, per_byte = self.copy.coefficients()
        return 2 * (s0 + per_byte * num_blocks * block_size * self.bytes_per_token)

    def crossover_tokens(self, block_size: int) -> int | None:
        """The shortest whole-block length at which swapping is cheaper than recomputing
        (None when recomputing stays cheaper up to 1M tokens)."""
        lo, hi = 1, 1 << 16  # in blocks
        if self.swap_seconds(hi, block_size) >= self.recompute_seconds(hi * block_size):
            return None
        while lo < hi:
            mid = (lo + hi) // 2
            if self.swap_seconds(mid, block_size) < self.recompute_seconds(mid * block_size):
                hi = mid
            else:
                lo = mid + 1
        return lo * block_size

    def rates(self) -> dict[str, float]:
        c0, c_tok, c_attn = self.step.coefficients()
        s0, per_byte = self.copy.coefficients()
        return {
            "step_overhead_s": c0,
            "prefill_s_per_token": c_tok,
            "attention_s_per_pair": c_attn,
            "copy_overhead_s": s0,
            "copy_bytes_per_s": 1 / per_byte if per_byte > 0 else math.inf,
        }


def attention_pairs(chunks: list[tuple[int, int]]) -> float:
    """Query-key pairs of causal attention over chunks ``(start, n)``: token ``start + i``
    attends to ``start + i + 1`` keys."""
    return sum(n * (start + (n + 1) / 2) for start, n in chunks)
