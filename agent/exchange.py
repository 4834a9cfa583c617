"""Small collectives the checks share: fixed-size digests for everyone, objects for a few.

A check first exchanges digests of fixed size (16 bytes per rank), whatever the model size; only
when digests disagree are details fetched, and only from the ranks involved.
"""
from __future__ import annotations

import io
import pickle
from collections import Counter
from typing import Any

import torch
import torch.distributed as dist

DIGEST_BYTES = 16

# torch 2.13 renamed all_gather_into_tensor (now deprecated); older releases have only that.
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor

TRAFFIC: Counter[str] = Counter()
"""Bytes this rank has contributed to each kind of exchange (its own payload, not the copies a
collective algorithm makes): what `bench/exchange_bytes.py` reports and the stats export."""


def gather_tensor(tensor: torch.Tensor, group: dist.ProcessGroup | None, label: str) -> torch.Tensor:
    """All-gather one small tensor per rank into one tensor: ``result[rank]`` is that rank's."""
    TRAFFIC[label] += tensor.numel() * tensor.element_size()
    flat = tensor.reshape(-1)
    out = flat.new_empty(dist.get_world_size(group) * flat.numel())  # gloo wants it flat
    _all_gather_single(out, flat, group=group)
    return out.view(-1, *tensor.shape)


def gather_digests(digests: list[bytes], device: torch.device, group: dist.ProcessGroup | None) -> list[list[bytes]]:
    """All-gather a fixed number of 16-byte digests per rank: result[rank][k]."""
    words = [w for d in digests for w in _digest_to_words(d)]
    parts = gather_tensor(torch.tensor(words, dtype=torch.int64, device=device), group, "digests")
    out = []
    for part in parts:
        raw = _words_to_bytes(part)
        out.append([raw[k:k + DIGEST_BYTES] for k in range(0, len(raw), DIGEST_BYTES)])
    return out


def gather_objects(obj: Any, group: dist.ProcessGroup | None) -> list[Any]:
    """All-gather picklable objects; used only on a mismatch, for details (others send None)."""
    TRAFFIC["details"] += len(pickle.dumps(obj))
    out: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(out, obj, group=group)
    return out


def ring_exchange(payload: Any, send_to: int | None, recv_from: int | None, device: torch.device,
                  group: dist.ProcessGroup | None) -> Any:
    """Send ``payload`` to one rank and receive one from another, without deadlock.

    Sizes go first, then bytes; every transfer is posted non-blocking before any wait. Either
    side may be None (this rank only sends, or only receives). Ranks are group ranks.
    """
    blob = serialize(payload) if send_to is not None else None
    size_out = torch.tensor([blob.numel() if blob is not None else 0], dtype=torch.int64, device=device)
    size_in = torch.zeros(1, dtype=torch.int64, device=device)
    _wait(_post(size_out, send_to, size_in, recv_from, group))
    return ring_transfer(blob, send_to, recv_from, int(size_in.item()), device, group)


def ring_transfer(blob: torch.Tensor | None, send_to: int | None, recv_from: int | None, incoming: int,
                  device: torch.device, group: dist.ProcessGroup | None) -> Any:
    """:func:`ring_exchange` once the ``incoming`` size is known (the audit step learns every
    rank's payload size from check 1's all-gather: one synchronisation fewer)."""
    TRAFFIC["batches"] += blob.numel() if blob is not None and send_to is not None else 0
    buffer = torch.empty(incoming, dtype=torch.uint8, device=device) if recv_from is not None else None
    _wait(_post(blob.to(device) if blob is not None else None, send_to, buffer, recv_from, group))
    return _from_bytes(buffer, device) if buffer is not None else None


def broadcast_digest(digest: bytes | None, src: int, device: torch.device, group: dist.ProcessGroup | None) -> bytes:
    """Rank ``src`` tells everyone one 16-byte digest."""
    TRAFFIC["digests"] += DIGEST_BYTES if digest is not None else 0
    words = torch.tensor(_digest_to_words(digest or bytes(DIGEST_BYTES)), dtype=torch.int64, device=device)
    dist.broadcast(words, src=_global(group, src), group=group)
    return _words_to_bytes(words)


def _digest_to_words(digest: bytes) -> list[int]:
    """A 16-byte digest as two signed int64 words (what a collective can carry)."""
    return [int.from_bytes(digest[i:i + 8], "little", signed=True) for i in (0, 8)]


def _words_to_bytes(words: torch.Tensor) -> bytes:
    return b"".join(int(w).to_bytes(8, "little", signed=True) for w in words.tolist())


def _post(send: torch.Tensor | None, dst: int | None, recv: torch.Tensor | None, src: int | None,
          group: dist.ProcessGroup | None) -> list[Any]:
    works = []
    if recv is not None and src is not None:
        works.append(dist.irecv(recv, src=_global(group, src), group=group))
    if send is not None and dst is not None:
        works.append(dist.isend(send, dst=_global(group, dst), group=group))
    return works


def _wait(works: list[Any]) -> None:
    for work in works:
        work.wait()


def _global(group: dist.ProcessGroup | None, rank: int) -> int:
    return rank if group is None or group == dist.group.WORLD else dist.get_global_rank(group, rank)


def serialize(payload: Any) -> torch.Tensor:
    """A payload as the uint8 tensor :func:`ring_transfer` sends."""
    buf = io.BytesIO()
    torch.save(payload, buf)
    return torch.frombuffer(bytearray(buf.getvalue()), dtype=torch.uint8)


def _from_bytes(blob: torch.Tensor, device: torch.device) -> Any:
    """Unpickle; tensors that lived on a GPU of the sender land on this rank's GPU."""
    def remap(storage: Any, location: str) -> Any:
        return storage.to(device) if location.startswith("cuda") and device.type == "cuda" else storage
    # weights_only=False: the payload is a training batch from a peer rank of the same job.
    return torch.load(io.BytesIO(blob.cpu().numpy().tobytes()), map_location=remap, weights_only=False)
