"""The fingerprint as one fused Triton kernel: one read of the tensor, integer adds only.

Each program reduces ``TILES`` consecutive tiles of ``BLOCK`` elements and keeps, per lane ``l``,
two accumulators over the tiles ``t = 0 .. TILES-1`` it has read so far:

    col_l = sum_t b[t, l]              run_l = sum_t col_l(after tile t) = sum_t (TILES - t) b[t, l]

so ``sum_t t * b[t, l] = TILES * col_l - run_l`` with two additions per element and no multiply.
At the end the program turns its lanes into ``(s0, s1)`` for its span (int64, wrapping modulo
2**64 exactly like the definition) and writes them to its own slot; the slots of all of a
tensor's chunks add up to its fingerprint, and ``sums`` adds them for many tensors at once with
one ``index_add_``. For 1- and 2-byte elements the accumulators are int32: with at most 256 tiles,
``|run| <= 256 * 257 / 2 * 2**15 < 2**31``, so they never wrap.

Runs on CUDA tensors, or on CPU tensors under ``TRITON_INTERPRET=1`` (how the tests check it bit
for bit against the definition on machines without a GPU). ``ready(device)`` self-tests the
kernel once per device against the torch path; a kernel that fails or disagrees is never used.
"""
from __future__ import annotations

import functools
import logging
import os
from typing import Sequence

import torch

__all__ = ["available", "ready", "sums"]

log = logging.getLogger(__name__)

# Bytes each program reads per tile, whatever the width: wide vector loads for every dtype.
_TILE_BYTES = 4096
# Tiles per program: int32 accumulators for narrow elements stay exact up to 256 (see above).
_TILES = 64


def available(tensor: torch.Tensor) -> bool:
    """True when the kernel can run on ``tensor``'s device at all."""
    on_device = tensor.is_cuda or (tensor.device.type == "cpu" and os.environ.get("TRITON_INTERPRET") == "1")
    return on_device and _triton() is not None


def sums(pieces: Sequence[tuple[int, int, torch.Tensor]], count: int, device: torch.device) -> torch.Tensor:
    """``(count, 2)`` int64 sums on ``device`` from ``(owner, start, piece)`` triples: each piece a
    contiguous 1-D integer view holding elements ``start ..`` of tensor ``owner``.

    One kernel launch per piece, every program writing its own slot of one shared buffer, then
    one ``index_add_`` for all tensors: a model's parameters cost about one launch each, without
    a device sync."""
    triton, tl, kernel = _triton()
    launches = []
    for owner, start, piece in pieces:
        if piece.numel():
            block = _TILE_BYTES // piece.element_size()
            launches.append((owner, start, piece, block, triton.cdiv(piece.numel(), _TILES * block)))
    programs = tuple((owner, n) for owner, _, _, _, n in launches)
    partial = torch.empty((sum(n for _, n in programs), 2), dtype=torch.int64, device=device)
    first = 0
    for owner, start, piece, block, n in launches:
        kernel[(n,)](piece, partial[first:], piece.numel(), start, TILES=_TILES, BLOCK=block,
                     ACC=tl.int32 if piece.element_size() <= 2 else tl.int64)
        first += n
    out = torch.zeros((count, 2), dtype=torch.int64, device=device)
    return out.index_add_(0, _owners(programs, str(device)), partial)


@functools.lru_cache(maxsize=64)
def _owners(programs: tuple[tuple[int, int], ...], device: str) -> torch.Tensor:
    """Which tensor each program's slot belongs to (the same model gives the same layout every
    step: cached, so the index is copied to the device once)."""
    owners = [owner for owner, n in programs for _ in range(n)]
    return torch.tensor(owners, dtype=torch.int64).to(device)


@functools.lru_cache(maxsize=None)
def _triton():
    """``(triton, triton.language, kernel)``, or None without triton: imported on first use only,
    so CPU-only jobs never pay for the import."""
    try:
        import triton
        import triton.language as tl
    except ImportError:
        return None

    @triton.jit
    def fingerprint_kernel(x_ptr, out_ptr, n, start, TILES: tl.constexpr, BLOCK: tl.constexpr,
                           ACC: tl.constexpr):
        pid = tl.program_id(0).to(tl.int64)
        first = pid * (TILES * BLOCK)  # this program's first element inside the chunk
        lanes = tl.arange(0, BLOCK)
        col = tl.zeros([BLOCK], dtype=ACC)
        run = tl.zeros([BLOCK], dtype=ACC)
        for t in range(TILES):
            index = first + t * BLOCK + lanes
            col += tl.load(x_ptr + index, mask=index < n, other=0).to(ACC)
            run += col
        col = col.to(tl.int64)
        run = run.to(tl.int64)
        s0 = tl.sum(col, axis=0)
        # The 1-based position of element [t, l] is start + first + t*BLOCK + l + 1.
        weighted = (lanes.to(tl.int64) + 1) * col + BLOCK * (TILES * col - run)
        s1 = tl.sum(weighted, axis=0) + (start + first) * s0
        tl.store(out_ptr + pid * 2, s0)
        tl.store(out_ptr + pid * 2 + 1, s1)

    return triton, tl, fingerprint_kernel


def ready(device: torch.device) -> bool:
    """Whether the kernel runs on ``device`` and agrees with the torch path (checked once)."""
    return _triton() is not None and _self_test(str(device))


@functools.lru_cache(maxsize=None)
def _self_test(device: str) -> bool:
    from . import fingerprint

    gen = torch.Generator().manual_seed(0)
    # Spans more than one program for every width, with a ragged tail.
    raw = torch.randint(0, 256, (2 * _TILES * _TILE_BYTES + 4 * 8 * 13,), dtype=torch.uint8, generator=gen)
    try:
        for dtype in (torch.uint8, torch.int16, torch.int32, torch.int64):
            probe = raw.view(dtype).to(device)
            fast = fingerprint(probe, backend="triton")
            slow = fingerprint(probe, backend="torch")
            if fast != slow:
                log.warning("sdcguard: Triton fingerprint disagrees with the torch path on %s (%s); "
                            "using the torch path", device, dtype)
                return False
    except Exception as exc:  # a broken toolchain must cost speed, never the check
        log.warning("sdcguard: Triton fingerprint unusable on %s (%s); using the torch path", device, exc)
        return False
    return True
