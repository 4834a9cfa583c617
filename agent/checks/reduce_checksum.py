"""Check 4, ``reduce-checksum``: a fault inside the gradient all-reduce that stays finite.

Such a fault hands every replica the same wrong gradient, so no replica comparison sees it. A
linear checksum commutes with the sum (algorithm-based fault tolerance): with weights ``w_i``,

    C = sum_i w_i G_i   must equal   (1/W) sum_r c_r,   c_r = sum_i w_i g_r,i

where ``g_r`` is rank r's local bucket before the all-reduce and ``G`` the averaged bucket after it,
up to the rounding of the reduction, bounded below from the operands (no tuned tolerance).

**Weights.** ``w`` is a fixed random table in [1, 2) per bucket (seeded by the run's seed), read at
an offset drawn per step from (seed, step): an error pattern cannot line up with the weights for
long, and two swapped elements change the checksum. To keep the CPU cost at a few passes over the
gradient, the bucket is folded into ``ROWS`` rows first: ``P_j = sum_k g[k*L + j]``, added pairwise
(``log2 ROWS`` roundings per element, in float32 or float64), and ``c = sum_j T_j P_j`` in float64;
the elements of one column share a weight.
The local operands' size ``A = sum_i |g_i|`` is bounded by Cauchy–Schwarz from the local squared
norm (``norms.abs_sum_bound``: rigorous, and within ~1.25x of the exact sum for dense gradients).

**The bound.** ``u_a`` is the unit roundoff of the folding precision (float32, or float64 for
float64 buckets), ``u_e`` that of the bucket's element type (the reduction adds in it), ``u`` that
of float64, ``gamma(n, u) = n u / (1 - n u)``, ``A_r >= sum_i |g_r,i|``, ``A_G = sum_i |G_i|``:
  - folding and the float64 dot: ``|c_r - sum_i w_i g_r,i| <= 2 eps_c A_r`` with
    ``eps_c = gamma(log2 ROWS, u_a) + gamma(L, u) (1 + gamma(log2 ROWS, u_a))`` (|w| < 2); same for C;
  - DDP's mean scales each element by fl(1/W) (two roundings: ``2 u_e + u_e^2``) and sums W terms
    in any order (``gamma(W - 1, u_e)``): ``|G_i - (1/W) sum_r g_r,i| <= eps_red (1/W) sum_r |g_r,i|
    + 2 W eta`` with ``eps_red = gamma(W - 1, u_e)(1 + u_e)^2 + 2 u_e + u_e^2`` and ``eta`` the
    element type's underflow error (half its smallest subnormal; additions of subnormals are exact);
  - the same inequality bounds the reduced operands by the local ones, ``A_G <= (1 + eps_red)
    (1/W) sum_r A_r + 2 W eta n``, so the reduced gradient is read once (its checksum) and never
    for its size: a corrupted reduced element cannot widen the bound at all;
  - so ``|C - (1/W) sum_r c_r| <= 2 kappa (eps_c + eps_red) (1/W) sum_r A_r + 2 kappa eps_c A_G
    + 4 W eta n <= k (1/W) sum_r A_r + 5 W eta n`` with ``k = 2 kappa (2 eps_c + eps_red + eps_c
    eps_red)`` (``kappa`` bounds the computed sums' own rounding), plus the float64 rounding of
    assembling X and Y (``gamma(B + W + 4, u)``, B buckets).
Everything the bound needs travels with check 1's existing all-reduce: each rank contributes
``x_r = sum_b c_rb / W - sum_b C_b / W`` and ``y_r = sum_b k_b A_rb / W``; the sums X and Y are the
same on every rank, so every rank reaches the same verdict. ``Y`` is finite exactly when every
local gradient is, and ``X`` when every reduced one is too (a NaN or Inf reaches the checksum of
the bucket that holds it): check 1 needs nothing else.

**Cost.** Per bucket and step: the local gradient's memory read once for its fold, its squared
norm and DDP's 1/W scaling (on CUDA the fused Triton kernel, ``fused_fold``; on CPU a cache-sized
block at a time, copied once and worked on in cache, ``blocked_fold``), the reduced one once (its
fold); per step, one stack of the buckets' terms and a dot with coefficients computed once per
bucket layout.

What it checks: the default DDP mean, or a reduce hook that declares it averages like DDP
(``averages_like_ddp = True``, e.g. the fault injector's). A compression hook changes the sum:
check 4 is then off, said at start-up. No rank can be named: the reduction is shared.
"""
from __future__ import annotations

import hashlib
import math
import threading
from dataclasses import dataclass

import torch

from ..contract.alarm import CHECK_REDUCE_CHECKSUM
from ..fingerprint import triton_checksum
from .norms import abs_sum_bound, squared_norm
from .verdict import Verdict

ROWS = 16
"""Rows a bucket is folded into before the weighted float64 sum."""

LEVELS = 4
"""``ROWS = 2 ** LEVELS``: the fold adds rows pairwise, in place, so each element is rounded
``LEVELS`` times (a sequential fold would round it up to ``ROWS - 1`` times, a bound 3.75x wider).
Both ways of adding pairs (``_fold``) round the same."""
assert ROWS == 2 ** LEVELS

DEPTH_FIRST_COLUMNS = 1 << 16
"""Above this many columns (a 4 MB float32 bucket) the fold adds its pairs depth first."""

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
        """Bucket ``index``'s weights for ``length`` elements: the ``L`` column weights, then the
        tail's (1/8 of a float32 bucket's bytes, made once)."""
        key = (index, length, str(device))
        found = self.tables.get(key)
        if found is None:
            g = torch.Generator().manual_seed(self.seed * 1_000_003 + index)
            found = (1.0 + torch.rand(length // ROWS + length % ROWS, generator=g, dtype=torch.float64)).to(device)
            self.tables[key] = found
        return found

    def checksum(self, index: int, flat: torch.Tensor) -> torch.Tensor:
        """``c``, the weighted checksum of one flat bucket (float64, on its device, no sync): one
        read of the bucket."""
        n = flat.numel()
        cols = n // ROWS
        main = cols * ROWS
        weights = self.table(index, n, flat.device)
        if cols:
            o = self.offset_seed % cols  # column j gets weight w[(j + o) mod L]
            folded = _fold(flat[:main].view(ROWS, cols))
            c = torch.dot(weights[o:cols], folded[:cols - o]) + torch.dot(weights[:o], folded[cols - o:])
        else:
            c = torch.zeros((), dtype=torch.float64, device=flat.device)
        if main < n:
            c = c + torch.dot(weights[cols:], flat[main:].to(torch.float64))
        return c

    def terms(self, index: int, flat: torch.Tensor, scale: float | None = None) -> torch.Tensor:
        """``[c, squared norm]`` (float64, no sync) of a local bucket: what check 4's vote needs
        of it, and check 1's finiteness; with ``scale``, the bucket is then multiplied by it in
        place (``flat.mul_(scale)``: DDP's 1/W before the all-reduce), bit for bit.

        Each path reads the bucket's memory once for all three (the fold, the squares, the
        scaling): on CUDA the fused Triton kernel (float32/bfloat16/float16, its self-test passed:
        ``fingerprint.triton_checksum``, :func:`fused_terms`); on CPU :func:`blocked_fold`, which
        copies the bucket a cache-sized block at a time into a scratch buffer and does the three
        from there. Elsewhere (float64, a GPU without the kernel) the fold, the norm and the
        scaling each read the bucket."""
        cols = flat.numel() // ROWS
        if cols and triton_checksum.available(flat) and triton_checksum.ready(flat.device):
            p, q = triton_checksum.fold(flat[:cols * ROWS].view(ROWS, cols), scale)
            return self._combine(index, flat, p, q.to(torch.float64).sum(), scale)
        if cols and flat.device.type == "cpu" and flat.dtype in _BLOCKED and flat.numel() * 4 > BLOCKED_FROM_BYTES:
            p, sq = blocked_fold(flat[:cols * ROWS].view(ROWS, cols), scale)
            return self._combine(index, flat, p, sq, scale)
        out = torch.stack([self.checksum(index, flat), squared_norm(flat)])
        if scale is not None:
            flat.mul_(scale)
        return out

    def fused_terms(self, index: int, flat: torch.Tensor, scale: float | None = None) -> torch.Tensor:
        """The fused kernel's result, computed with torch operations (:func:`fused_fold`): what the
        kernel must equal bit for bit on the same device."""
        cols = flat.numel() // ROWS
        p, q = fused_fold(flat[:cols * ROWS].view(ROWS, cols), scale)
        return self._combine(index, flat, p, q.to(torch.float64).sum(), scale)

    def _combine(self, index: int, flat: torch.Tensor, p: torch.Tensor, sq: torch.Tensor,
                 scale: float | None) -> torch.Tensor:
        """``[c, squared norm]`` from the columns' fold ``p`` and the main part's squared norm
        ``sq`` (float64), and the tail (the last ``n mod ROWS`` elements, still unscaled; scaled
        here after they are read).

        The squared norm is within ``norms.norm_roundoff`` of the exact one below. The fused
        kernel's: each square is rounded once and added ``LEVELS`` times in float32 (five
        roundings, against at least 19 that bound allows), then the columns add in float64.
        :func:`blocked_fold`'s: float32 dots of at most ``BLOCK_BYTES / 4`` elements, added in
        float64 (``norms.squared_norm``'s chunks, smaller)."""
        n = flat.numel()
        cols = n // ROWS
        main = cols * ROWS
        weights = self.table(index, n, flat.device)
        zero = torch.zeros((), dtype=torch.float64, device=flat.device)
        c = zero
        if cols:
            o = self.offset_seed % cols
            folded = p.to(torch.float64)
            c = torch.dot(weights[o:cols], folded[:cols - o]) + torch.dot(weights[:o], folded[cols - o:])
        else:
            sq = zero
        if main < n:
            tail = flat[main:].to(torch.float64)
            c = c + torch.dot(weights[cols:], tail)
            sq = sq + torch.dot(tail, tail)
            if scale is not None:
                flat[main:].mul_(scale)
        return torch.stack([c, sq])


def _fold(rows: torch.Tensor) -> torch.Tensor:
    """The ``ROWS`` rows summed pairwise, in float32 (float64 for float64), as float64.

    Small buckets add halves in place (five operations); large ones add pairs depth first, so that
    at most ``LEVELS`` partial rows are alive and every row is read once (on a 25 MB CPU bucket
    1.7 ms against 3.7 for halves, and 3.4 for one ``sum(0)``, which also rounds sequentially)."""
    acc = torch.float64 if rows.dtype == torch.float64 else torch.float32
    if rows.shape[1] <= DEPTH_FIRST_COLUMNS:
        half = ROWS // 2
        a = rows[:half] + rows[half:] if rows.dtype == acc else rows[:half].to(acc).add_(rows[half:])
        while half > 1:
            half //= 2
            a[:half] += a[half:2 * half]
        return a[0].to(torch.float64)
    return _pairs(rows, 0, ROWS, acc).to(torch.float64)


def fused_fold(rows: torch.Tensor, scale: float | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The fused kernel's formula in torch operations: ``(P, Q)`` (float32) of a ``(ROWS, L)``
    float32/bfloat16/float16 bucket view — ``P`` its rows added pairwise in :func:`_fold`'s tree
    (halves), ``Q`` the same over the rows' squares, each rounded to float32 before it is added —
    then, with ``scale``, the rows multiplied by it in place (``mul_``, as DDP's comm hook does)."""
    r = rows.to(torch.float32)
    p, q = _halves(r), _halves(r * r)
    if scale is not None:
        rows.mul_(scale)
    return p, q


def _halves(rows: torch.Tensor) -> torch.Tensor:
    half = ROWS // 2
    a = rows[:half] + rows[half:]
    while half > 1:
        half //= 2
        a[:half] += a[half:2 * half]
    return a[0]


def _pairs(rows: torch.Tensor, lo: int, hi: int, acc: torch.dtype) -> torch.Tensor:
    if hi - lo == 2:
        return rows[lo] + rows[lo + 1] if rows.dtype == acc else rows[lo].to(acc).add_(rows[lo + 1])
    mid = (lo + hi) // 2
    return _pairs(rows, lo, mid, acc).add_(_pairs(rows, mid, hi, acc))


BLOCK_BYTES = 1 << 21
""":func:`blocked_fold` copies a bucket ``ROWS`` x ``b`` columns at a time into a float32 scratch of at
most this size, so the bucket's memory is read once and the fold, the squares and the scaling read
the copy while it is in cache. Measured on this CPU (1 MiB L2, 32 MiB L3), one thread: a 25 MiB
bucket 4.3 ms against 6.5 for the three passes; 1 MiB blocks as fast, 512 KiB ones slower (more
operations per byte); a bucket that fits in a block costs one copy more than three passes over it
in cache (+30-40 us on TinyGPT's 0.7 and 1 MiB buckets)."""

BLOCKED_FROM_BYTES = BLOCK_BYTES
"""Buckets of at most this many float32 bytes take the three passes instead: they are in cache
already (the backward just wrote them), and the copy costs more than it saves. Measured with
``bench/overhead.py`` (TinyGPT, two buckets of 1 and 0.7 MiB, 3 ranks, idle machine): the blocked
path on every bucket cost +0.04-0.05 of a plain DDP step on ordinary steps (1.103-1.107 against
1.052-1.065 without it), where one process timed only +65 us per bucket: on CPU it pays only where
a bucket is read from memory (a 25 MiB bucket: 6.5 -> 4.3 ms)."""

_BLOCKED = (torch.float32, torch.bfloat16, torch.float16)
"""Element types :func:`blocked_fold` takes (float64 buckets fold in float64: the plain path)."""

_scratch = threading.local()
"""Per thread (buckets finish on gloo's thread too): ``block``, ``half``, the float32 buffers."""


def blocked_fold(rows: torch.Tensor, scale: float | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``(P, sq)`` of a ``(ROWS, L)`` CPU float32/bfloat16/float16 bucket view, reading the bucket's
    memory once: ``P`` (float32) is :func:`_fold`'s halves tree bit for bit (each column's 16
    elements meet in the same order, whatever the block), ``sq`` the squared norm (float64: float32
    dots of one block each, added in float64, within ``norms.norm_roundoff``); then, with ``scale``,
    the bucket multiplied by it, bit for bit ``rows.mul_(scale)`` (the same float32 product,
    rounded once to the element type), written from the copy.

    Per block of ``ROWS`` x ``b`` columns: one copy out of the bucket (its only read; a conversion
    to float32 for the narrow types, as ``_fold`` does before it adds), the four levels of the fold,
    one dot, and the scaled copy written back: seven operations."""
    cols = rows.shape[1]
    blocks = -(-cols // max(1, BLOCK_BYTES // (ROWS * 4)))
    width = -(-cols // blocks)
    block_buf, half_buf = _buffers(width)
    p = torch.empty(cols, dtype=torch.float32, device=rows.device)
    parts = torch.empty(blocks, dtype=torch.float32, device=rows.device)
    half = ROWS // 2
    for k in range(blocks):
        j0 = k * width
        j1 = min(j0 + width, cols)
        w = j1 - j0
        block = block_buf[:ROWS * w].view(ROWS, w)
        block.copy_(rows[:, j0:j1])  # the one read of the bucket
        a = half_buf[:half * w].view(half, w)
        torch.add(block[:half], block[half:], out=a)
        a[:4] += a[4:8]
        a[:2] += a[2:4]
        torch.add(a[0], a[1], out=p[j0:j1])
        flat = block.view(-1)
        torch.dot(flat, flat, out=parts[k])
        if scale is not None:
            torch.mul(block, scale, out=rows[:, j0:j1])
    return p, parts.to(torch.float64).sum()


def _buffers(width: int) -> tuple[torch.Tensor, torch.Tensor]:
    """This thread's scratch for blocks of ``width`` columns (made once, grown if needed)."""
    block = getattr(_scratch, "block", None)
    if block is None or block.numel() < ROWS * width:
        _scratch.block = block = torch.empty(ROWS * width, dtype=torch.float32, device="cpu")
        _scratch.half = torch.empty(ROWS // 2 * width, dtype=torch.float32, device="cpu")
    return block, _scratch.half


@dataclass(frozen=True, slots=True)
class Shape:
    """What the bound needs to know about the buckets (the same on every rank)."""

    world: int
    buckets: int
    elements: int
    dtypes: tuple[torch.dtype, ...]


def coefficient(n: int, dtype: torch.dtype, world: int, buckets: int) -> float:
    """``k``: the bound's weight of a bucket's local operand sizes (see the module docstring)."""
    u64 = _UNIT_ROUNDOFF[torch.float64]
    u_e = _UNIT_ROUNDOFF.get(dtype, u64)
    u_a = u64 if dtype == torch.float64 else _UNIT_ROUNDOFF[torch.float32]
    fold = n // ROWS + n % ROWS
    g_fold = _gamma(LEVELS, u_a)
    eps_c = g_fold + _gamma(fold, u64) * (1 + g_fold)
    kappa = 1 / ((1 - g_fold) * (1 - _gamma(fold + 1, u64)))
    eps_red = _gamma(max(world - 1, 0), u_e) * (1 + u_e) ** 2 + 2 * u_e + u_e ** 2
    delta = _gamma(buckets + world + 4, u64)
    eps_c = eps_c + (1 + eps_c) * delta  # and assembling X and Y in float64
    return 2 * kappa * (1 + delta) * (2 * eps_c + eps_red + eps_c * eps_red)


class Coefficients:
    """Each bucket's ``k * abs_sum_bound(n, 1)`` as one float64 vector, computed once per bucket
    layout (DDP keeps its buckets after the first step) rather than on every step."""

    __slots__ = ("key", "factors")

    def __init__(self) -> None:
        self.key: tuple | None = None
        self.factors = torch.zeros(0, dtype=torch.float64)

    def get(self, sizes: list[tuple[int, torch.dtype]], world: int, device: torch.device) -> torch.Tensor:
        key = (tuple(sizes), world, str(device))
        if key != self.key:
            # abs_sum_bound(n, s) = sqrt(s) * abs_sum_bound(n, 1)
            self.factors = torch.tensor([coefficient(n, d, world, len(sizes)) * abs_sum_bound(n, 1.0, d)
                                         for n, d in sizes], dtype=torch.float64, device=device)
            self.key = key
        return self.factors


def vote(local: list[torch.Tensor], reduced: list[torch.Tensor], sizes: list[tuple[int, torch.dtype]],
         world: int, coefficients: Coefficients | None = None) -> torch.Tensor:
    """This rank's ``[x, y]`` from each bucket's local ``[c, squared norm]`` and reduced checksum
    ``C``: summed over ranks, X is the checksum difference and Y the bound on honest rounding (less
    its tiny absolute underflow term), the same on every rank."""
    loc, red = torch.stack(local), torch.stack(reduced)
    f = (coefficients or Coefficients()).get(sizes, world, loc.device)
    x = (loc[:, 0].sum() - red.sum()) / world
    y = torch.dot(loc[:, 1].sqrt(), f) / world
    return torch.stack([x, y])


def _bound_terms(shape: Shape) -> tuple[float, float]:
    """``(a, b)`` with ``rounding_bound(y) = y * a + b``: one formula for the host and the device."""
    underflow = max((_UNDERFLOW.get(d, _UNDERFLOW[torch.float32]) for d in shape.dtypes), default=0.0)
    return 1 + _gamma(shape.world + 2, _UNIT_ROUNDOFF[torch.float64]), 5 * shape.world * underflow * shape.elements


def rounding_bound(y: float, shape: Shape) -> float:
    """The largest ``|X|`` honest rounding can produce, for the summed ``Y``: Y itself (each
    rank's share already carries its coefficients) plus the underflow term."""
    a, b = _bound_terms(shape)
    return y * a + b


def failed_on_device(total: torch.Tensor, shape: Shape | None) -> torch.Tensor:
    """What checks 1 and 4 decide from the summed ``[X, Y]``, on its device without a sync: a
    float32 scalar 1.0 when they would not let the update through (something not finite, or
    ``|X|`` past the bound ``judge_checksum`` computes, in the same float64 operations), else
    0.0 — the ``found_inf`` a fused optimizer reads (0-d, like GradScaler's) (``sdcguard.gate``). A non-finite sum
    holds the update back whatever the host decides later (the data's NaN, or a finite gradient
    whose float32 norm overflowed, is then a skipped step)."""
    passed = torch.isfinite(total).all()
    if shape is not None:
        a, b = _bound_terms(shape)
        passed = passed & (total[0].abs() <= total[1] * a + b)
    return torch.logical_not(passed).to(torch.float32)


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
