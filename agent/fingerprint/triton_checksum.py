"""Check 4's local terms as one fused Triton kernel: one read of the local bucket.

``reduce_checksum.ChecksumWeights.terms`` needs two things of a local bucket: its fold ``P`` (the
``ROWS`` rows added pairwise, the weighted checksum's operand) and its squared norm (check 1's
finiteness, check 4's bound). The torch path reads the bucket twice for them (the fold, then a
dot). This kernel reads each element once and writes, per column ``j``, both ``P_j`` and
``Q_j`` — the same pairwise fold over the squares ``r_kj * r_kj`` — and, for DDP's comm hook, the
bucket scaled by ``1/W`` in place in the same pass (the hook's ``mul_`` before the all-reduce), so
that DDP reads each gradient byte twice in all (this pass, and the reduced bucket's checksum).

Bit for bit it computes ``reduce_checksum.fused_fold`` (the torch formula the CPU tests check it
against under ``TRITON_INTERPRET=1``): the same additions in the same tree, in float32, squares
rounded before they are added (``enable_fp_fusion=False``: no FMA contraction), and the scaled
element ``fl(fl32(x) * fl32(1/W))`` rounded to the bucket's type as torch's ``mul_`` does. The
float64 sums of ``P`` and ``Q`` (``reduce_checksum._combine``) are torch's on both paths.
``ready(device)`` self-tests the kernel once per device against that formula, scaling included;
a kernel that fails or disagrees is never used, and the torch path runs instead.

float32, bfloat16 and float16 buckets only (float64 keeps the torch path: its scale would have to
travel as a float64, and its rounding analysis is float64's).
"""
from __future__ import annotations

import functools
import logging
import os

import torch

__all__ = ["DTYPES", "available", "fold", "ready"]

log = logging.getLogger(__name__)

DTYPES = (torch.float32, torch.bfloat16, torch.float16)
_BLOCK = 512
"""Columns per program."""


def available(tensor: torch.Tensor) -> bool:
    """True when the kernel can run on ``tensor`` at all (CUDA, or CPU under TRITON_INTERPRET=1)."""
    on_device = tensor.is_cuda or (tensor.device.type == "cpu" and os.environ.get("TRITON_INTERPRET") == "1")
    return on_device and tensor.dtype in DTYPES and tensor.is_contiguous() and _triton() is not None


def fold(rows: torch.Tensor, scale: float | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``(P, Q)`` (float32, one value per column) of a contiguous ``(ROWS, L)`` view of a bucket;
    with ``scale``, the rows are multiplied by it in place in the same pass."""
    triton, _, kernel = _triton()
    rows_n, cols = rows.shape
    if rows_n != 16:
        raise ValueError(f"the fused fold adds 16 rows, got {rows_n}")
    p = torch.empty(cols, dtype=torch.float32, device=rows.device)
    q = torch.empty(cols, dtype=torch.float32, device=rows.device)
    if cols:
        kernel[(triton.cdiv(cols, _BLOCK),)](rows, p, q, cols, 1.0 if scale is None else float(scale),
                                             SCALE=scale is not None, BF16=rows.dtype == torch.bfloat16, BLOCK=_BLOCK,
                                             enable_fp_fusion=False)
    return p, q


@functools.lru_cache(maxsize=None)
def _triton():
    """``(triton, triton.language, kernel)``, or None without triton (imported on first use, so
    CPU-only jobs never pay for it; the kernel lives in its own module because Triton resolves a
    jitted function's callees among its module's globals)."""
    try:
        import triton
        import triton.language as tl

        from . import triton_checksum_kernel
    except ImportError:
        return None
    return triton, tl, triton_checksum_kernel.fold_kernel


def ready(device: torch.device) -> bool:
    """Whether the kernel runs on ``device`` and agrees bit for bit with the torch formula
    (checked once per device; without triton, False)."""
    return _triton() is not None and _self_test(str(device))


def self_test_cases(device: torch.device):
    """``(name, tensor, scale)``: every dtype, ragged column counts around the block size, values
    over a wide range with ties for the scaling's rounding, the world sizes 2, 3 and 6."""
    gen = torch.Generator().manual_seed(0)
    for dtype in DTYPES:
        for cols, scale in ((1, None), (_BLOCK - 1, 1 / 3), (_BLOCK + 7, 0.5), (3 * _BLOCK + 5, 1 / 6)):
            wide = torch.randn(16 * cols, generator=gen, dtype=torch.float64)
            wide = wide * 10.0 ** torch.randint(-6, 7, (16 * cols,), generator=gen)
            if dtype == torch.float16:
                wide = wide.clamp(-6e4, 6e4)
            yield f"{dtype}-{cols}-{scale}", wide.to(dtype).to(device), scale


@functools.lru_cache(maxsize=None)
def _self_test(device: str) -> bool:
    from ..checks.reduce_checksum import fused_fold

    try:
        for name, tensor, scale in self_test_cases(torch.device(device)):
            rows_fast, rows_slow = tensor.clone().view(16, -1), tensor.clone().view(16, -1)
            fast = fold(rows_fast, scale)
            slow = fused_fold(rows_slow, scale)
            same = all(torch.equal(a.view(torch.int32), b.view(torch.int32)) for a, b in zip(fast, slow))
            if not (same and torch.equal(rows_fast.view(torch.uint8), rows_slow.view(torch.uint8))):
                log.warning("sdcguard: Triton checksum fold disagrees with the torch formula on %s (%s); "
                            "using the torch path", device, name)
                return False
    except Exception as exc:  # a broken toolchain must cost speed, never the check
        log.warning("sdcguard: Triton checksum fold unusable on %s (%s); using the torch path", device, exc)
        return False
    return True
