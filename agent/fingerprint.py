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

so no position tensor as long as the chunk is needed, only integer reductions. On a GPU the chunks
are large (few kernel launches) and 1- and 2-byte elements are reduced in int32 where a chunk's
sums cannot overflow it — unless the fused Triton kernel of ``fingerprint_triton`` is available
and passed its self-test; neither has yet been timed on a GPU (see bench/RESULTS.md).

On CPU, elements of up to 4 bytes go through BLAS instead: one float64 matrix product of the
``rows x C`` chunk (in blocks of 32 rows) with the two columns ``[1, c + 1]`` gives every row's ``rowsum_r`` and
``sum_c (c + 1) b[r, c]``. It is exact: ``|b| <= 2**31`` and ``sum(c + 1) < 2**22`` keep every
product and partial sum an integer below 2**53, whatever order BLAS adds in. Each block is converted in cache and read once, 2-3x faster than two integer reductions. ``fingerprint_sums`` keeps results on the device so that many
tensors cost one device-to-host transfer.
"""
from __future__ import annotations

import functools
import hashlib
from typing import Iterable, Iterator, NamedTuple, Sequence

import torch

from . import fingerprint_triton

__all__ = ["Fingerprint", "fingerprint", "fingerprint_many", "fingerprint_sums", "to_fingerprints",
           "digest", "fingerprint_reference"]

_MASK = (1 << 64) - 1
# Elements per chunk on CPU (a non-contiguous tensor is copied chunk by chunk) ...
CPU_CHUNK_ELEMENTS = 1 << 20
# ... converted to float64 in blocks of this many rows (512 KiB), which stay in cache.
_CPU_BLOCK_ROWS = 32
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


def fingerprint(tensor: torch.Tensor, *, chunk_elements: int | None = None,
                backend: str = "auto") -> Fingerprint:
    """Fingerprint ``tensor`` per the SPEC §3 definition, on the tensor's own device."""
    return to_fingerprints(fingerprint_sums([tensor], chunk_elements=chunk_elements, backend=backend))[0]


def fingerprint_many(tensors: Iterable[torch.Tensor], *, backend: str = "auto") -> list[Fingerprint]:
    """Fingerprint several tensors with one device-to-host transfer per device, not one per tensor
    (each transfer waits for the device: hundreds of parameters would mean hundreds of stalls)."""
    tensors = list(tensors)
    by_device: dict[torch.device, list[int]] = {}
    for i, t in enumerate(tensors):
        by_device.setdefault(t.device, []).append(i)
    out: list[Fingerprint] = [Fingerprint(0, 0)] * len(tensors)
    for indices in by_device.values():
        sums = fingerprint_sums([tensors[i] for i in indices], backend=backend)
        for i, fp in zip(indices, to_fingerprints(sums)):
            out[i] = fp
    return out


def fingerprint_sums(tensors: Sequence[torch.Tensor], *, chunk_elements: int | None = None,
                     backend: str = "auto") -> torch.Tensor:
    """``(len(tensors), 2)`` int64 sums on the tensors' (one) device, without waiting for it.

    ``backend``: ``"auto"`` (the Triton kernel on GPUs where it passed its self-test, else torch),
    ``"torch"``, or ``"triton"`` (an error where it cannot run)."""
    if not tensors:
        return torch.zeros((0, 2), dtype=torch.int64)
    return torch.stack([_tensor_sums(t, chunk_elements, _use_triton(t, backend)) for t in tensors])


def to_fingerprints(sums: torch.Tensor) -> list[Fingerprint]:
    """Turn :func:`fingerprint_sums` output into unsigned fingerprints (one host transfer)."""
    return [Fingerprint(s0 & _MASK, s1 & _MASK) for s0, s1 in sums.cpu().tolist()]


def _use_triton(tensor: torch.Tensor, backend: str) -> bool:
    if backend == "torch":
        return False
    if backend == "triton":
        if not fingerprint_triton.available(tensor):
            raise RuntimeError("the Triton fingerprint needs the triton package and a CUDA tensor "
                               "(or TRITON_INTERPRET=1 for a CPU tensor)")
        return True
    if backend == "auto":
        return tensor.is_cuda and fingerprint_triton.ready(tensor.device)
    raise ValueError(f"backend must be 'auto', 'torch' or 'triton', not {backend!r}")


def _tensor_sums(tensor: torch.Tensor, chunk_elements: int | None, use_triton: bool) -> torch.Tensor:
    """``[s0, s1]`` of one tensor as int64 (wrapping) on its device."""
    if chunk_elements is None:
        chunk_elements = CPU_CHUNK_ELEMENTS if tensor.device.type == "cpu" else GPU_CHUNK_ELEMENTS
    if chunk_elements < _COLUMNS or chunk_elements % _COLUMNS or chunk_elements > 1 << 30:
        raise ValueError(f"chunk_elements must be a multiple of {_COLUMNS} up to 2**30")
    as_ints = _integer_view(tensor.detach())
    if use_triton:
        sums = torch.zeros(2, dtype=torch.int64, device=tensor.device)
        offset = 0
        for piece in _flat_chunks(as_ints, chunk_elements):
            fingerprint_triton.chunk_sums(piece, offset, sums)
            offset += piece.numel()
        return sums
    if tensor.device.type == "cpu" and tensor.element_size() <= 4:
        chunk_sums = _chunk_sums_by_matmul
    else:
        # |b| <= 2**15 and at most 2**13 rows of 2**11: int32 row and column sums are exact.
        narrow = tensor.element_size() <= 2 and chunk_elements <= _INT32_SAFE_ELEMENTS
        chunk_sums = functools.partial(_chunk_sums, acc=torch.int32 if narrow else torch.int64)
    s0 = torch.zeros((), dtype=torch.int64, device=tensor.device)
    s1 = torch.zeros((), dtype=torch.int64, device=tensor.device)
    offset = 0
    for piece in _flat_chunks(as_ints, chunk_elements):
        c0, c1 = chunk_sums(piece)
        # Shift this chunk's positions by its offset: sum b*(offset + j + 1) = offset*sum b + ...
        s1 += c1 + c0 * offset
        s0 += c0
        offset += piece.numel()
    return torch.stack([s0, s1])


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
    rows = piece.numel() // _COLUMNS
    s0, s1 = _tail_sums(piece, rows * _COLUMNS)
    if rows:
        body = piece[: rows * _COLUMNS].view(rows, _COLUMNS)
        row_sums = body.sum(dim=1, dtype=acc).to(torch.int64)
        col_sums = body.sum(dim=0, dtype=acc).to(torch.int64)
        r = _positions(0, rows, piece.device)
        c1 = _positions(1, _COLUMNS + 1, piece.device)
        s0 += row_sums.sum()
        s1 += (r * row_sums).sum() * _COLUMNS + (c1 * col_sums).sum()
    return s0, s1


def _chunk_sums_by_matmul(piece: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Same as :func:`_chunk_sums` for CPU chunks of <= 4-byte integers, by exact float64 GEMMs.

    Blocks of ``_CPU_BLOCK_ROWS`` rows are converted into one reused float64 buffer (in cache)
    and multiplied by ``[1, c + 1]``; only the per-row results (16 bytes per row) outlive a block."""
    rows = piece.numel() // _COLUMNS
    s0, s1 = _tail_sums(piece, rows * _COLUMNS)
    if rows:
        body = piece[: rows * _COLUMNS].view(rows, _COLUMNS)
        per_row = torch.empty((rows, 2), dtype=torch.float64)  # [rowsum_r, sum_c (c+1) b[r, c]]
        buffer = torch.empty((min(rows, _CPU_BLOCK_ROWS), _COLUMNS), dtype=torch.float64)
        for start in range(0, rows, _CPU_BLOCK_ROWS):
            block = body[start:start + _CPU_BLOCK_ROWS]
            converted = buffer[: block.shape[0]]
            converted.copy_(block)
            torch.mm(converted, _row_weights(), out=per_row[start:start + block.shape[0]])
        exact = per_row.to(torch.int64)
        s0 += exact[:, 0].sum()
        s1 += (_positions(0, rows, piece.device) * exact[:, 0]).sum() * _COLUMNS + exact[:, 1].sum()
    return s0, s1


@functools.lru_cache(maxsize=1)
def _row_weights() -> torch.Tensor:
    """The ``C x 2`` float64 matrix ``[1, c + 1]`` (CPU)."""
    ones = torch.ones(_COLUMNS, dtype=torch.float64)
    return torch.stack([ones, torch.arange(1, _COLUMNS + 1, dtype=torch.float64)], dim=1)


def _tail_sums(piece: torch.Tensor, start: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(sum b, sum b*(j+1)) over ``piece[start:]``, the part shorter than one row."""
    if start == piece.numel():
        zero = torch.zeros((), dtype=torch.int64, device=piece.device)
        return zero, zero.clone()
    rest = piece[start:].to(torch.int64)
    pos = torch.arange(start + 1, piece.numel() + 1, dtype=torch.int64, device=piece.device)
    return rest.sum(), (rest * pos).sum()
