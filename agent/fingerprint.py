"""Tensor fingerprints: two exact integer sums that any device and any reduction order agree on.

Definition (SPEC §3, fixed): view the tensor's bytes as integers of the element's width (1 byte
unsigned; 2, 4, 8 bytes signed), widen each to int64 and return, modulo 2**64,

    s0 = sum(b_i)            s1 = sum(b_i * (i + 1))

over the flattened (row-major) tensor. ``s0`` catches any changed value, ``s1`` also catches two
values that traded places. Integer addition is associative, so the answer does not depend on how a
kernel splits the work: a CPU, a GPU and a pure-Python reference all give the same two numbers.

The flat tensor is processed in chunks so temporary memory stays bounded however large it is.
Inside a chunk of ``rows x C`` elements, with 0-based row r and column c (i = r*C + c):

    sum(b_i * (i + 1)) = C * sum_r r * rowsum_r + sum_c (c + 1) * colsum_c

so no position tensor as long as the chunk is needed, only integer reductions. On CPU, chunks of
about 1 MiB stay in cache between the row and the column reduction, and 1- and 2-byte elements
are reduced in int32 (exact: a chunk's row and column sums cannot overflow it), which halves the
work. On a GPU the same code runs with large chunks (few kernel launches); it has not yet been
timed on one (see bench/RESULTS.md).
"""
from __future__ import annotations

import functools
import hashlib
from typing import Iterable, Iterator, NamedTuple

import torch

__all__ = ["Fingerprint", "fingerprint", "digest", "fingerprint_reference"]

_MASK = (1 << 64) - 1
# Bytes per chunk on CPU: small enough to stay in cache for the second reduction over it.
CHUNK_BYTES = 1 << 20
# Elements per chunk on GPUs: reductions cast on load, so a chunk costs O(rows) temporary memory;
# large chunks keep the number of kernel launches per tensor small.
GPU_CHUNK_ELEMENTS = 1 << 26
# Narrow (1- and 2-byte) elements are summed in int32 when a chunk is at most this long.
_INT32_SAFE_ELEMENTS = 1 << 24
# Columns of the rows x C view of a chunk; the chunk size is a multiple of it.
_COLUMNS = 1 << 11

_INT_VIEW = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


class Fingerprint(NamedTuple):
    """``(s0, s1)`` as unsigned integers in ``[0, 2**64)``."""

    s0: int
    s1: int


def fingerprint(tensor: torch.Tensor, *, chunk_elements: int | None = None) -> Fingerprint:
    """Fingerprint ``tensor`` per the SPEC §3 definition, on the tensor's own device."""
    if chunk_elements is None:
        chunk_elements = GPU_CHUNK_ELEMENTS if tensor.is_cuda else max(_COLUMNS, CHUNK_BYTES // tensor.element_size())
    if chunk_elements < _COLUMNS or chunk_elements % _COLUMNS or chunk_elements > 1 << 30:
        raise ValueError(f"chunk_elements must be a multiple of {_COLUMNS} up to 2**30")
    # |b| <= 2**15 and at most 2**13 rows of 2**11: int32 row and column sums are exact.
    narrow = tensor.element_size() <= 2 and chunk_elements <= _INT32_SAFE_ELEMENTS
    acc = torch.int32 if narrow else torch.int64
    as_ints = _integer_view(tensor.detach())
    s0 = torch.zeros((), dtype=torch.int64, device=tensor.device)
    s1 = torch.zeros((), dtype=torch.int64, device=tensor.device)
    offset = 0
    for piece in _flat_chunks(as_ints, chunk_elements):
        c0, c1 = _chunk_sums(piece, acc)
        # Shift this chunk's positions by its offset: sum b*(offset + j + 1) = offset*sum b + ...
        s1 += c1 + c0 * offset
        s0 += c0
        offset += piece.numel()
    return Fingerprint(int(s0) & _MASK, int(s1) & _MASK)


def digest(fingerprints: Iterable[Fingerprint]) -> bytes:
    """A 16-byte digest of an ordered list of fingerprints (one per parameter)."""
    h = hashlib.blake2b(digest_size=16)
    for fp in fingerprints:
        h.update(fp.s0.to_bytes(8, "little"))
        h.update(fp.s1.to_bytes(8, "little"))
    return h.digest()


def fingerprint_reference(data: bytes, width: int) -> Fingerprint:
    """The definition written out in plain Python, for tests and for readers."""
    signed = width != 1
    s0 = s1 = 0
    for i in range(0, len(data), width):
        b = int.from_bytes(data[i:i + width], "little", signed=signed)
        s0 += b
        s1 += b * (i // width + 1)
    return Fingerprint(s0 & _MASK, s1 & _MASK)


def _integer_view(tensor: torch.Tensor) -> torch.Tensor:
    """Reinterpret the elements as integers of the same width: a view, never a copy."""
    width = tensor.element_size()
    if width not in _INT_VIEW:
        raise TypeError(f"fingerprint supports 1, 2, 4 and 8-byte dtypes, not {tensor.dtype}")
    # A same-width dtype view works for any strides, so non-contiguous input stays a view.
    return tensor if tensor.dtype == _INT_VIEW[width] else tensor.view(_INT_VIEW[width])


def _flat_chunks(tensor: torch.Tensor, limit: int) -> Iterator[torch.Tensor]:
    """Yield the tensor's elements in row-major order as contiguous 1-D pieces of <= limit."""
    if tensor.is_contiguous():
        flat = tensor.reshape(-1)
        for start in range(0, flat.numel(), limit):
            yield flat[start:start + limit]
        return
    if tensor.numel() <= limit:
        yield tensor.contiguous().reshape(-1)
        return
    # Too big to copy at once: walk the leading dimension, slabs of at most `limit` elements.
    per_slice = tensor[0].numel() if tensor.shape[0] else 1
    step = max(1, limit // max(per_slice, 1))
    for start in range(0, tensor.shape[0], step):
        slab = tensor[start:start + step]
        if slab.numel() <= limit:
            yield slab.contiguous().reshape(-1)
        else:  # one slice alone exceeds the limit: recurse into it
            yield from _flat_chunks(slab[0], limit)


@functools.lru_cache(maxsize=32)
def _positions(start: int, stop: int, device: torch.device) -> torch.Tensor:
    return torch.arange(start, stop, dtype=torch.int64, device=device)


def _chunk_sums(piece: torch.Tensor, acc: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """(sum b, sum b*(j+1)) of one contiguous 1-D chunk, j the position inside the chunk."""
    n = piece.numel()
    rows, tail = divmod(n, _COLUMNS)
    s0 = torch.zeros((), dtype=torch.int64, device=piece.device)
    s1 = torch.zeros((), dtype=torch.int64, device=piece.device)
    if rows:
        body = piece[: rows * _COLUMNS].view(rows, _COLUMNS)
        row_sums = body.sum(dim=1, dtype=acc).to(torch.int64)
        col_sums = body.sum(dim=0, dtype=acc).to(torch.int64)
        r = _positions(0, rows, piece.device)
        c1 = _positions(1, _COLUMNS + 1, piece.device)
        s0 += row_sums.sum()
        s1 += (r * row_sums).sum() * _COLUMNS + (c1 * col_sums).sum()
    if tail:
        rest = piece[rows * _COLUMNS:].to(torch.int64)
        pos = torch.arange(rows * _COLUMNS + 1, n + 1, dtype=torch.int64, device=piece.device)
        s0 += rest.sum()
        s1 += (rest * pos).sum()
    return s0, s1
