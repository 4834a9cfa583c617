"""Check 4, ``reduce-checksum``: a fault inside the gradient all-reduce that stays finite.

Such a fault hands every replica the same wrong gradient, so no replica comparison sees it. A
linear checksum commutes with the sum (algorithm-based fault tolerance): with weights ``w_i``,

    C = sum_i w_i G_i   must equal   (1/W) sum_r c_r,   c_r = sum_i w_i g_r,i

where ``g_r`` is rank r's local bucket before the all-reduce and ``G`` the averaged bucket after it,
up to the rounding of the reduction, bounded below from the operands (no tuned tolerance).

**Weights.** ``w`` is a fixed random table in [1, 2) per bucket (seeded by the run's seed), read at
an offset drawn per step from (seed, step): an error pattern cannot line up with the weights for
long, and two swapped elements change the checksum. To keep the CPU cost at a few passes over the
gradient, the bucket is folded into ``ROWS`` rows first: ``P_j = sum_k g[k*L + j]`` (exact-ish, in
float32 or float64), and ``c = sum_j T_j P_j`` in float64; the elements of one column share a weight.
The operands' size ``A = sum_i |g_i|`` is bounded by Cauchy–Schwarz from check 1's squared norm
(``norms.abs_sum_bound``: rigorous, and within ~1.25x of the exact sum for dense gradients), so
check 4 adds one pass (the fold) to what check 1 already reads.

**The bound.** ``u_a`` is the unit roundoff of the folding precision (float32, or float64 for
float64 buckets), ``u_e`` that of the bucket's element type (the reduction adds in it), ``u`` that
of float64, ``gamma(n, u) = n u / (1 - n u)``, ``A_r >= sum_i |g_r,i|``, ``A_G >= sum_i |G_i|``:
  - folding and the float64 dot: ``|c_r - sum_i w_i g_r,i| <= 2 eps_c A_r`` with
    ``eps_c = gamma(ROWS - 1, u_a) + gamma(L, u) (1 + gamma(ROWS - 1, u_a))`` (|w| < 2); same for C;
  - DDP's mean scales each element by fl(1/W) (two roundings: ``2 u_e + u_e^2``) and sums W terms
    in any order (``gamma(W - 1, u_e)``): ``|G_i - (1/W) sum_r g_r,i| <= eps_red (1/W) sum_r |g_r,i|
    + 2 W eta`` with ``eps_red = gamma(W - 1, u_e)(1 + u_e)^2 + 2 u_e + u_e^2`` and ``eta`` the
    element type's underflow error (half its smallest subnormal; additions of subnormals are exact);
  - so ``|C - (1/W) sum_r c_r| <= 2 kappa (eps_c + eps_red) Y + 4 W eta n``, ``Y = A_G + (1/W)
    sum_r A_r`` from the computed sums (``kappa`` bounds their own rounding), plus the float64
    rounding of assembling X and Y (``gamma(B + W + 4, u)``, B buckets).
Everything the bound needs travels with check 1's existing all-reduce: each rank contributes
``x_r = sum_b (c_rb - C_b) / W`` and ``y_r = sum_b (k_local A_rb + k_reduced A_Gb) / W`` (the
coefficients above, per bucket); the sums X and Y are the same on every rank, so every rank
reaches the same verdict. ``Y`` is finite exactly when every
local and reduced gradient is (check 1's question), so check 1 needs nothing else.

What it checks: the default DDP mean, or a reduce hook that declares it averages like DDP
(``averages_like_ddp = True``, e.g. the fault injector's). A compression hook changes the sum:
check 4 is then off, said at start-up. No rank can be named: the reduction is shared.
"""
from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass

import torch

from ..contract.alarm import CHECK_REDUCE_CHECKSUM
from .norms import abs_sum_bound, squared_norm
from .verdict import Verdict

ROWS = 16
"""Rows a bucket is folded into before the weighted float64 sum."""

_UNIT_ROUNDOFF = {torch.float64: 2.0 ** -53, torch.float32: 2.0 ** -24, torch.bfloat16: 2.0 ** -8,
                  torch.float16: 2.0 ** -11}
# Half the smallest subnormal: the absolute error of a product that underflows.
_UNDERFLOW = {torch.float64: 2.0 ** -1075, torch.float32: 2.0 ** -150, torch.bfloat16: 2.0 ** -134,
              torch.float16: 2.0 ** -25}


def _gamma(n: int, u: float) -> float:
    return n * u / (1 - n * u)


class ChecksumWeights:
    """The weight tables, one per bucket, made on first use (seeded), and this step's offset."""

    __slots__ = ("seed", "tables", "offset_seed")

    def __init__(self, seed: int) -> None:
        self.seed = seed
        self.tables: dict[tuple[int, int, str], torch.Tensor] = {}
        self.offset_seed = 0

    def begin_step(self, step: int) -> None:
        key = f"{self.seed}:{step}:reduce-checksum".encode()
        self.offset_seed = int.from_bytes(hashlib.blake2b(key, digest_size=8).digest(), "little")

    def table(self, index: int, length: int, device: torch.device) -> torch.Tensor:
        key = (index, length, str(device))
        found = self.tables.get(key)
        if found is None:
            g = torch.Generator().manual_seed(self.seed * 1_000_003 + index)
            found = (1.0 + torch.rand(length, generator=g, dtype=torch.float64)).to(device)
            self.tables[key] = found
        return found

    def terms(self, index: int, flat: torch.Tensor) -> torch.Tensor:
        """``[c, squared norm]`` (float64, on the tensor's device, no sync) of one flat bucket."""
        acc = torch.float64 if flat.dtype == torch.float64 else torch.float32
        n = flat.numel()
        main = (n // ROWS) * ROWS
        cols = main // ROWS
        tail = flat[main:].to(torch.float64)
        weights = self.table(index, cols + tail.numel(), flat.device)
        c = torch.dot(weights[cols:], tail) if tail.numel() else tail.new_zeros(())
        if cols:
            p = flat[:main].view(ROWS, cols).sum(0, dtype=acc).to(torch.float64)
            o = self.offset_seed % cols
            c = c + torch.dot(weights[o:cols], p[:cols - o]) + torch.dot(weights[:o], p[cols - o:])
        return torch.stack([c, squared_norm(flat)])


@dataclass(frozen=True, slots=True)
class Shape:
    """What the bound needs to know about the buckets (the same on every rank)."""

    world: int
    buckets: int
    elements: int
    dtypes: tuple[torch.dtype, ...]


def coefficients(n: int, dtype: torch.dtype, world: int, buckets: int) -> tuple[float, float]:
    """``(k_local, k_reduced)``: the bound's weights of a bucket's local and reduced operand sizes
    (see the module docstring). Only the local sizes carry the reduction's rounding, so a corrupted
    reduced element cannot inflate the bound by much more than it moves the checksum."""
    u64 = _UNIT_ROUNDOFF[torch.float64]
    u_e = _UNIT_ROUNDOFF.get(dtype, u64)
    u_a = u64 if dtype == torch.float64 else _UNIT_ROUNDOFF[torch.float32]
    fold = n // ROWS + n % ROWS
    g_fold = _gamma(ROWS - 1, u_a)
    eps_c = g_fold + _gamma(fold, u64) * (1 + g_fold)
    kappa = 1 / ((1 - g_fold) * (1 - _gamma(fold + 1, u64)))
    eps_red = _gamma(max(world - 1, 0), u_e) * (1 + u_e) ** 2 + 2 * u_e + u_e ** 2
    delta = _gamma(buckets + world + 4, u64)
    common = 2 * kappa * (1 + delta) * (eps_c + (1 + eps_c) * delta)
    return common + 2 * kappa * (1 + delta) * eps_red, common


def vote(local: list[torch.Tensor], reduced: list[torch.Tensor], sizes: list[tuple[int, torch.dtype]],
         world: int) -> torch.Tensor:
    """This rank's ``[x, y]`` from each bucket's ``[c, squared norm]``, local and reduced: summed
    over ranks, X is the checksum difference and Y the bound on honest rounding (less its tiny
    absolute underflow term), the same on every rank."""
    loc, red = torch.stack(local), torch.stack(reduced)
    factors = []
    for n, dtype in sizes:
        k_local, k_reduced = coefficients(n, dtype, world, len(sizes))
        unit = abs_sum_bound(n, 1.0, dtype)  # abs_sum_bound(n, s) = sqrt(s) * abs_sum_bound(n, 1)
        factors.append([k_local * unit, k_reduced * unit])
    f = torch.tensor(factors, dtype=torch.float64, device=loc.device)
    x = (loc[:, 0].sum() - red[:, 0].sum()) / world
    y = (loc[:, 1].sqrt() * f[:, 0] + red[:, 1].sqrt() * f[:, 1]).sum() / world
    return torch.stack([x, y])


def rounding_bound(y: float, shape: Shape) -> float:
    """The largest ``|X|`` honest rounding can produce, for the summed ``Y``: Y itself (each
    rank's share already carries its coefficients) plus the underflow term."""
    underflow = max((_UNDERFLOW.get(d, _UNDERFLOW[torch.float32]) for d in shape.dtypes), default=0.0)
    return y * (1 + _gamma(shape.world + 2, _UNIT_ROUNDOFF[torch.float64])) + 4 * shape.world * underflow * shape.elements


def judge_checksum(x: float, y: float, shape: Shape) -> Verdict | None:
    """None when the reduced gradient's checksum is within rounding of the local ones' mean."""
    if not (math.isfinite(x) and math.isfinite(y)):
        return None  # non-finite: check 1's to judge
    bound = rounding_bound(y, shape)
    if abs(x) <= bound:
        return None
    return Verdict(CHECK_REDUCE_CHECKSUM, evidence={
        "difference": x, "bound": bound, "abs_sum": y, "exceeds_bound_by": abs(x) / bound if bound else math.inf,
        "world_size": shape.world, "buckets": shape.buckets,
    })
