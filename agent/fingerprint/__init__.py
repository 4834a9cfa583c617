"""Tensor fingerprints: two exact integer sums that any device and any reduction order agree on.

Definition (docs/design.md §3, fixed): view the tensor's bytes as integers of the element's width (1 byte
unsigned; 2, 4, 8 bytes signed), widen each to int64 and return, modulo 2**64,

    s0 = sum(b_i)            s1 = sum(b_i * (i + 1))

over the flattened (row-major) tensor. ``s0`` catches any changed value, ``s1`` also catches two
values that traded places. Integer addition is associative, so the answer does not depend on how a
kernel splits the work: a CPU, a GPU and a pure-Python reference all give the same two numbers.

The flat tensor is processed in chunks so temporary memory stays bounded however large it is; how
a chunk is reduced depends on the device: ``fingerprint_triton`` (a fused kernel, on GPUs where it
passed its self-test), ``fingerprint_torch`` (integer reductions on GPUs without it; exact float
BLAS blocks on CPU, small tensors packed together). Neither GPU path has been timed on a GPU yet (see
bench/RESULTS.md). ``fingerprint_sums`` keeps results on the device so that many tensors cost one
device-to-host transfer.
"""
from __future__ import annotations

import hashlib
import sys
import types
from typing import Any, Iterable, Iterator, NamedTuple, Sequence

import torch

from . import torch_path as fingerprint_torch
from . import triton_kernel as fingerprint_triton
from .torch_path import COLUMNS as _COLUMNS

__all__ = ["Fingerprint", "fingerprint", "fingerprint_many", "fingerprint_sums", "to_fingerprints", "to_fingerprints_together",
           "digest", "fingerprint_reference"]

_MASK = (1 << 64) - 1
# Elements per chunk (a non-contiguous tensor is copied chunk by chunk): on CPU a few MiB;
# on GPUs reductions cast on load, and large chunks keep kernel launches per tensor few.
CPU_CHUNK_ELEMENTS = 1 << 20
GPU_CHUNK_ELEMENTS = 1 << 26

_INT_VIEW = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


class Fingerprint(NamedTuple):
    """``(s0, s1)`` as unsigned integers in ``[0, 2**64)``."""

    s0: int
    s1: int


def fingerprint(tensor: torch.Tensor, *, chunk_elements: int | None = None,
                backend: str = "auto") -> Fingerprint:
    """Fingerprint ``tensor`` per the docs/design.md §3 definition, on the tensor's own device."""
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
    if backend not in ("auto", "torch", "triton"):
        raise ValueError(f"backend must be 'auto', 'torch' or 'triton', not {backend!r}")
    if not tensors:
        return torch.zeros((0, 2), dtype=torch.int64)
    if chunk_elements is None and backend != "triton" and any(map(fingerprint_torch.packable, tensors)):
        return _cpu_sums(tensors)
    if _use_triton(tensors[0], backend):
        return _triton_sums(tensors, chunk_elements)
    return torch.stack([_tensor_sums(t, chunk_elements) for t in tensors])


def _triton_sums(tensors: Sequence[torch.Tensor], chunk_elements: int | None) -> torch.Tensor:
    """Every chunk of every tensor through the fused kernel, summed per tensor in one go."""
    pieces = []
    for owner, tensor in enumerate(tensors):
        start = 0
        for piece in _flat_chunks(_integer_view(tensor.detach()), _chunk_limit(tensor, chunk_elements)):
            pieces.append((owner, start, piece))
            start += piece.numel()
    return fingerprint_triton.sums(pieces, len(tensors), tensors[0].device)


def _cpu_sums(tensors: Sequence[torch.Tensor]) -> torch.Tensor:
    """Small tensors packed together, the others one by one."""
    small = [i for i, t in enumerate(tensors) if fingerprint_torch.packable(t)]
    out = torch.empty((len(tensors), 2), dtype=torch.int64)
    out[small] = fingerprint_torch.packed_sums([_integer_view(tensors[i].detach()).reshape(-1) for i in small])
    for i in sorted(set(range(len(tensors))) - set(small)):
        out[i] = _tensor_sums(tensors[i], None)
    return out


def to_fingerprints(sums: torch.Tensor) -> list[Fingerprint]:
    """Turn :func:`fingerprint_sums` output into unsigned fingerprints (one host transfer:
    ``tolist`` copies a device tensor to the host itself, a ``.cpu()`` first would be a second call)."""
    return [Fingerprint(s0 & _MASK, s1 & _MASK) for s0, s1 in sums.tolist()]


def to_fingerprints_together(parts: Sequence[torch.Tensor]) -> list[list[Fingerprint]]:
    """:func:`to_fingerprints` of several ``(n, 2)`` sums in one host transfer (each on any
    device: moved to the first non-empty one's, as a fingerprint is the same everywhere)."""
    filled = [p for p in parts if len(p)]
    if not filled:
        return [[] for _ in parts]
    device = filled[0].device
    every = iter(to_fingerprints(torch.cat([p.to(device) for p in filled])))
    return [[next(every) for _ in range(len(p))] for p in parts]


def _use_triton(tensor: torch.Tensor, backend: str) -> bool:
    if backend == "torch":
        return False
    if backend == "triton":
        if not fingerprint_triton.available(tensor):
            raise RuntimeError("the Triton fingerprint needs the triton package and a CUDA tensor "
                               "(or TRITON_INTERPRET=1 for a CPU tensor)")
        return True
    return tensor.is_cuda and fingerprint_triton.ready(tensor.device)  # "auto"


def _chunk_limit(tensor: torch.Tensor, chunk_elements: int | None) -> int:
    if chunk_elements is None:
        return CPU_CHUNK_ELEMENTS if tensor.device.type == "cpu" else GPU_CHUNK_ELEMENTS
    if chunk_elements < _COLUMNS or chunk_elements % _COLUMNS or chunk_elements > 1 << 30:
        raise ValueError(f"chunk_elements must be a multiple of {_COLUMNS} up to 2**30")
    return chunk_elements


def _tensor_sums(tensor: torch.Tensor, chunk_elements: int | None) -> torch.Tensor:
    """``[s0, s1]`` of one tensor as int64 (wrapping) on its device, by the torch paths."""
    chunk_elements = _chunk_limit(tensor, chunk_elements)
    as_ints = _integer_view(tensor.detach())
    by_matmul = tensor.device.type == "cpu" and tensor.element_size() <= 4
    chunk_sums = fingerprint_torch.chunk_sums_by_matmul if by_matmul else fingerprint_torch.chunk_sums
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




class _CallableModule(types.ModuleType):
    """``sdcguard.fingerprint`` is both this package and the function of the same name (the lazy
    export in ``sdcguard/__init__``): once anything imports the package, Python binds the package
    to that name, so the package itself must answer a call as the function does."""

    def __call__(self, tensor: torch.Tensor, **kwargs: Any) -> Fingerprint:
        return fingerprint(tensor, **kwargs)


sys.modules[__name__].__class__ = _CallableModule
