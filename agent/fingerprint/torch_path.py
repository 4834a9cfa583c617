"""The fingerprint's torch implementations: integer reductions, and exact float BLAS on CPU.

All work on contiguous 1-D integer views (see ``fingerprint.py`` for the definition) and return
``(sum b, sum b*(j+1))`` as int64 scalars on the input's device, j the position in the input.
With a chunk seen as a ``rows x C`` matrix (0-based row r, column c, j = r*C + c):

    sum(b_j * (j + 1)) = C * sum_r r * rowsum_r + sum_c (c + 1) * colsum_c

so no position tensor as long as the chunk is needed.

- ``chunk_sums``: row and column sums in integers (GPUs, and 8-byte elements anywhere). 1- and
  2-byte elements are summed in int32 where a chunk's sums cannot overflow it.
- ``chunk_sums_by_matmul`` (CPU, elements of up to 4 bytes): each block of rows is converted to
  float64 in cache and read by two matrix-vector products: its row sums, and its column sums added
  into the chunk's; the positions are then applied in int64 as in ``chunk_sums``. Exact: a row sum
  is at most ``2048 * 2**31 = 2**42`` and a column sum ``2**19 * 2**31 = 2**50`` (a chunk has at
  most 2**30 elements), so every partial sum is an integer below 2**53, whatever order BLAS adds
  in. ~8 GB/s on one core, 2.6x a GEMM with the columns ``[1, c + 1]`` (skinny GEMMs are slow
  here). 1- and 2-byte elements use float32 blocks of 512 x 512 instead (exact below 2**24).
- ``packed_sums`` (CPU): many small tensors — biases, norms, the parameters of a small model —
  concatenated in one ``cat`` (each padded with zeros to whole rows of 128), converted once, one
  GEMM, and the rows summed per tensor: a handful of operations for the whole list, not a few per
  tensor (TinyGPT's 28 parameters, 1.75 MB: ~0.9 ms, of which the conversion and the GEMM take
  ~0.6 ms; a clone takes 0.19 ms).
"""
from __future__ import annotations

import functools
from typing import Sequence

import torch

# Columns of the rows x C view of a chunk; chunk sizes are multiples of it.
COLUMNS = 1 << 11
# Narrow (1- and 2-byte) elements are summed in int32 when a chunk is at most this long:
# |b| <= 2**15 and at most 2**13 rows of 2**11 keep int32 row and column sums exact.
INT32_SAFE_ELEMENTS = 1 << 24
# Rows converted to float64 at a time on CPU (2 MiB: stays in cache; 32 rows read at half the speed).
_BLOCK_ROWS = 128
# 1- and 2-byte elements on CPU: float32 blocks of this many rows and columns (1 MiB).
_NARROW_COLUMNS = 512
# Tensors of at most this many elements are packed, into float64 buffers of at most
# _PACK_ELEMENTS (4 MiB), in rows of _PACK_COLUMNS (narrow rows: little padding for a bias).
_PACK_MAX_ELEMENTS = 1 << 16
_PACK_ELEMENTS = 1 << 19
_PACK_COLUMNS = 128


def chunk_sums(piece: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Row and column sums in integers (int32 for narrow elements where exact)."""
    narrow = piece.element_size() <= 2 and piece.numel() <= INT32_SAFE_ELEMENTS
    acc = torch.int32 if narrow else torch.int64
    rows = piece.numel() // COLUMNS
    s0, s1 = _tail_sums(piece, rows * COLUMNS)
    if rows:
        body = piece[: rows * COLUMNS].view(rows, COLUMNS)
        row_sums = body.sum(dim=1, dtype=acc).to(torch.int64)
        col_sums = body.sum(dim=0, dtype=acc).to(torch.int64)
        r = _positions(0, rows, piece.device)
        c1 = _positions(1, COLUMNS + 1, piece.device)
        s0 += row_sums.sum()
        s1 += (r * row_sums).sum() * COLUMNS + (c1 * col_sums).sum()
    return s0, s1


def chunk_sums_by_matmul(piece: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Exact float64 GEMMs over blocks of rows (CPU, elements of up to 4 bytes)."""
    if piece.element_size() <= 2:
        return _narrow_sums_by_matvec(piece)
    rows = piece.numel() // COLUMNS
    s0, s1 = _tail_sums(piece, rows * COLUMNS)
    if rows:
        body = piece[: rows * COLUMNS].view(rows, COLUMNS)
        row_sums = torch.empty(rows, dtype=torch.float64)
        col_sums = torch.zeros(COLUMNS, dtype=torch.float64)
        block_rows = min(rows, _BLOCK_ROWS)
        buffer = torch.empty((block_rows, COLUMNS), dtype=torch.float64)
        ones = _ones64(max(block_rows, COLUMNS))
        for start in range(0, rows, _BLOCK_ROWS):
            block = body[start:start + _BLOCK_ROWS]
            converted = buffer[: block.shape[0]]
            converted.copy_(block)
            torch.mv(converted, ones[:COLUMNS], out=row_sums[start:start + block.shape[0]])
            col_sums.addmv_(converted.t(), ones[: block.shape[0]])
        exact_rows = row_sums.to(torch.int64)
        s0 += exact_rows.sum()
        s1 += ((_positions(0, rows, piece.device) * exact_rows).sum() * COLUMNS
               + (_positions(1, COLUMNS + 1, piece.device) * col_sums.to(torch.int64)).sum())
    return s0, s1


def _narrow_sums_by_matvec(piece: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """1- and 2-byte elements in float32, twice as fast to convert as float64 and still exact:
    in a ``512 x 512`` block every row and column sum, and every partial sum of them, is an
    integer of magnitude at most ``512 * 2**15 = 2**24``, which float32 represents exactly.
    Two matrix-vector products give the row and the column sums; the positions are applied in
    int64 as in :func:`chunk_sums`."""
    rows = piece.numel() // _NARROW_COLUMNS
    s0, s1 = _tail_sums(piece, rows * _NARROW_COLUMNS)
    if rows:
        body = piece[: rows * _NARROW_COLUMNS].view(rows, _NARROW_COLUMNS)
        row_sums = torch.empty(rows, dtype=torch.float32)
        col_sums = torch.zeros(_NARROW_COLUMNS, dtype=torch.int64)
        buffer = torch.empty((min(rows, _NARROW_COLUMNS), _NARROW_COLUMNS), dtype=torch.float32)
        ones = torch.ones(_NARROW_COLUMNS, dtype=torch.float32)
        for start in range(0, rows, _NARROW_COLUMNS):
            block = body[start:start + _NARROW_COLUMNS]
            converted = buffer[: block.shape[0]]
            converted.copy_(block)
            torch.mv(converted, ones, out=row_sums[start:start + block.shape[0]])
            col_sums += torch.mv(converted.t(), ones[: block.shape[0]]).to(torch.int64)
        exact_rows = row_sums.to(torch.int64)
        s0 += exact_rows.sum()
        s1 += ((_positions(0, rows, piece.device) * exact_rows).sum() * _NARROW_COLUMNS
               + (_positions(1, _NARROW_COLUMNS + 1, piece.device) * col_sums).sum())
    return s0, s1


def packable(tensor: torch.Tensor) -> bool:
    """Small CPU tensors of up to 4-byte elements go through :func:`packed_sums`."""
    return (tensor.device.type == "cpu" and tensor.element_size() <= 4
            and 0 < tensor.numel() <= _PACK_MAX_ELEMENTS)


def packed_sums(flats: Sequence[torch.Tensor]) -> torch.Tensor:
    """``(len(flats), 2)`` int64 sums of small 1-D integer views (see :func:`packable`)."""
    out = torch.empty((len(flats), 2), dtype=torch.int64)
    first = 0
    while first < len(flats):
        # Fill one buffer with as many whole tensors as fit.
        last, rows = first, 0
        while last < len(flats) and (rows + _rows(flats[last])) * _PACK_COLUMNS <= _PACK_ELEMENTS:
            rows += _rows(flats[last])
            last += 1
        out[first:last] = _one_pack(flats[first:last])
        first = last
    return out


def _one_pack(flats: Sequence[torch.Tensor]) -> torch.Tensor:
    """Each tensor starts a new row: ``s1`` of a tensor is then ``C * sum_r r * rowsum_r +
    sum_r w_r`` over its own rows, with ``w_r = sum_c (c + 1) b[r, c]`` from the GEMM. Exact:
    ``|b| <= 2**31`` and ``sum(c + 1) < 2**14`` keep every product and partial sum below 2**53.
    """
    counts = tuple(_rows(f) for f in flats)
    pieces = []
    for flat, count in zip(flats, counts):
        pieces.append(flat)
        if count * _PACK_COLUMNS > flat.numel():  # zeros add nothing to either sum
            pieces.append(_zeros(flat.dtype)[: count * _PACK_COLUMNS - flat.numel()])
    packed = torch.empty((sum(counts), _PACK_COLUMNS), dtype=torch.float64)
    torch.cat(pieces, out=packed.view(-1))  # converts as it copies: the data is read once
    per_row = torch.mm(packed, _row_weights(_PACK_COLUMNS)).to(torch.int64)
    owner, local_row = _layout(counts)
    s0 = torch.zeros(len(flats), dtype=torch.int64).index_add_(0, owner, per_row[:, 0])
    s1 = torch.zeros(len(flats), dtype=torch.int64).index_add_(
        0, owner, local_row * per_row[:, 0] * _PACK_COLUMNS + per_row[:, 1])
    return torch.stack([s0, s1], dim=1)


@functools.lru_cache(maxsize=64)
def _layout(counts: tuple[int, ...]) -> tuple[torch.Tensor, torch.Tensor]:
    """For each packed row: which tensor owns it, and its row index inside that tensor.
    (A model's parameters pack the same way every step: cached.)"""
    sizes = torch.tensor(counts, dtype=torch.int64)
    owner = torch.repeat_interleave(torch.arange(len(counts)), sizes)
    starts = torch.cumsum(sizes, 0) - sizes
    return owner, torch.arange(int(sizes.sum())) - starts[owner]


def _rows(flat: torch.Tensor) -> int:
    """Packed rows a tensor takes (its last one zero-padded)."""
    return -(-flat.numel() // _PACK_COLUMNS)


@functools.lru_cache(maxsize=8)
def _zeros(dtype: torch.dtype) -> torch.Tensor:
    """Padding for a packed row, sliced to length (never written to)."""
    return torch.zeros(_PACK_COLUMNS, dtype=dtype)


@functools.lru_cache(maxsize=2)
def _ones64(n: int) -> torch.Tensor:
    return torch.ones(n, dtype=torch.float64)


@functools.lru_cache(maxsize=2)
def _row_weights(columns: int = COLUMNS) -> torch.Tensor:
    """The ``columns x 2`` float64 matrix ``[1, c + 1]`` (CPU)."""
    ones = torch.ones(columns, dtype=torch.float64)
    return torch.stack([ones, torch.arange(1, columns + 1, dtype=torch.float64)], dim=1)


def _tail_sums(piece: torch.Tensor, start: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(sum b, sum b*(j+1)) over ``piece[start:]``, the part shorter than one row."""
    if start == piece.numel():
        zero = torch.zeros((), dtype=torch.int64, device=piece.device)
        return zero, zero.clone()
    rest = piece[start:].to(torch.int64)
    pos = torch.arange(start + 1, piece.numel() + 1, dtype=torch.int64, device=piece.device)
    return rest.sum(), (rest * pos).sum()


@functools.lru_cache(maxsize=32)
def _positions(start: int, stop: int, device: torch.device) -> torch.Tensor:
    return torch.arange(start, stop, dtype=torch.int64, device=device)
