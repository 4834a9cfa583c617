"""Gradient norms: check 1's finiteness signal and check 4's bound on the operands' size.

``squared_norm`` accumulates in the gradient's own precision, at least float32 (a dot product for
float32 and float64: half the cost of ``vector_norm``, several times less than float64 on CPU), in
chunks of at most ``CHUNK`` elements whose results add in float64. Any summation order of ``k``
non-negative terms is within ``gamma(k + 3, u)`` of the exact sum (three more roundings for the
``vector_norm(...).square()`` path), so the chunking makes the rounding of the norm bounded for
buckets of any size — which check 4 relies on: ``abs_sum_bound`` turns a computed squared norm into
an upper bound of ``sum |g_i|`` by Cauchy–Schwarz (``sum |g_i| <= sqrt(n) ||g||``).

The one cost: a finite float32 gradient whose norm exceeds float32's range (~1.8e19) reads as
Inf; its NaN/Inf is then confirmed by a replay like any other, and reproduces.
"""
from __future__ import annotations

import math

import torch

CHUNK = 1 << 22
_U = {torch.float64: 2.0 ** -53}
_U32 = 2.0 ** -24


def squared_norm(tensor: torch.Tensor) -> torch.Tensor:
    """Squared L2 norm as a float64 scalar, without a device sync."""
    flat = tensor.reshape(-1)
    if flat.numel() <= CHUNK:
        return _squared(flat)
    return torch.stack([_squared(flat[i:i + CHUNK]) for i in range(0, flat.numel(), CHUNK)]).sum()


def _squared(flat: torch.Tensor) -> torch.Tensor:
    if flat.dtype in (torch.float32, torch.float64):
        return torch.dot(flat, flat).double()
    wide = torch.float32 if flat.element_size() < 4 else None  # complex keeps its own (|z|)
    return torch.linalg.vector_norm(flat, 2, dtype=wide).double().square()


def norm_roundoff(n: int, dtype: torch.dtype) -> float:
    """``gamma(k + 3, u)`` for the longest chunk of an ``n``-element ``dtype`` tensor: the computed
    squared norm is at least ``(1 - this)`` times the exact one."""
    k = min(n, CHUNK) + 3
    u = _U.get(dtype, _U32)
    return k * u / (1 - k * u)


def abs_sum_bound(n: int, squared: float, dtype: torch.dtype) -> float:
    """An upper bound of ``sum |g_i|`` over ``n`` elements from their computed squared norm."""
    exact_at_most = squared / (1 - norm_roundoff(n, dtype))
    return math.sqrt(n * exact_at_most) * (1 + 2.0 ** -50)  # and the float64 sqrt's own rounding
