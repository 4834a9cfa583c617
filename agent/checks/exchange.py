"""Small collectives the checks share: fixed-size digests for everyone, objects for a few.

A check first asks whether every rank agrees (16 bytes per rank, whatever the model size); only
when they do not are the digests gathered and details fetched, and only from the ranks involved.
"""
from __future__ import annotations

import ctypes
import io
import json
import math
from collections import Counter, deque
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

DIGEST_BYTES = 16
# Digest bits compared by `agree`: a float64 holds integers below 2**53 exactly.
_AGREE_BITS = 52

# torch 2.13 renamed all_gather_into_tensor (now deprecated); older releases have only that.
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor

# Every collective this library runs keeps its Work handle here for a while, and what is here is
# never freed at interpreter exit. Why: a gloo worker thread lets go of a finished op some time
# after the caller's wait() returned; when that is the last reference, the op (and its tensors) is
# destroyed on the worker thread, which must take the GIL — and during interpreter shutdown a
# thread that takes the GIL is killed inside a C++ destructor: "terminate called without an
# active exception", SIGABRT, a finished job reported failed (seen under CPU load at the end of
# the DDP example of docs/library.md, 4 exits in 20; the core: ~AsyncBroadcastWork -> decref_pyobject -> take_gil
# -> pthread_exit). Held here, the op is destroyed later on the thread that drops it from the
# deque (with the GIL), or never.
_WORKS: deque[Any] = deque(maxlen=256)
ctypes.pythonapi.Py_IncRef(ctypes.py_object(_WORKS))  # leaked on purpose: see above


def hold(work: Any) -> None:
    """Keep a collective's handle past the moment gloo's worker thread lets go of it (``_WORKS``)."""
    _WORKS.append(work)


def wait(work: Any) -> None:
    """Wait for a collective started with ``async_op=True``, keeping its handle (see ``_WORKS``)."""
    if work is not None:
        hold(work)
        work.wait()


TRAFFIC: Counter[str] = Counter()
"""Bytes this rank has contributed to each kind of exchange (its own payload, not the copies a
collective algorithm makes): what `bench/exchange_bytes.py` reports and the stats export."""


def agree(digest: bytes, device: torch.device, group: dist.ProcessGroup | None, *, veto: bool = False) -> bool:
    """Whether every rank holds the same ``digest`` and none vetoes: one 16-byte all-reduce.

    Each rank sends ``[h, -h]``, h the digest's first 52 bits (exact in float64), or ``[h, +inf]``
    to veto; the maxima are ``[max h, -min h]``, so the answer is ``max h == min h``. Two floats,
    because on gloo an all-reduce of 3 or more elements, like an all-gather, has a ~4 ms tail
    (p90, 3 ranks; `bench/sync_latency.py`) where 1 or 2 elements take ~0.3 ms. Two different
    digests pass for equal with probability 2**-52 (the difference then escapes this check);
    the caller gathers the whole digests only when the answer is no."""
    both, work = start_agreement(digest, device, group, veto=veto)
    wait(work)
    return agreed(both.tolist())


def start_agreement(digest: bytes, device: torch.device, group: dist.ProcessGroup | None, *,
                    veto: bool = False) -> tuple[torch.Tensor, Any]:
    """:func:`agree`'s all-reduce, started and not waited for: the tensor :func:`agreed` reads
    once ``work`` is waited for, and ``work`` (an audit step reads it with check 1's sums)."""
    TRAFFIC["agreements"] += 16
    h = float(int.from_bytes(digest[:8], "big") >> (64 - _AGREE_BITS))  # its first 52 bits
    both = torch.tensor([h, math.inf if veto else -h], dtype=torch.float64, device=device)
    work = dist.all_reduce(both, op=dist.ReduceOp.MAX, group=group, async_op=True)
    hold(work)  # kept even if the caller never waits (an exception in between)
    return both, work


def agreed(both: list[float]) -> bool:
    """:func:`agree`'s answer from the all-reduced ``[max h, -min h]``."""
    highest, minus_lowest = both
    return highest == -minus_lowest


def gather_tensor(tensor: torch.Tensor, group: dist.ProcessGroup | None, label: str) -> torch.Tensor:
    """All-gather one small tensor per rank into one tensor: ``result[rank]`` is that rank's."""
    TRAFFIC[label] += tensor.numel() * tensor.element_size()
    flat = tensor.reshape(-1)
    out = flat.new_empty(dist.get_world_size(group) * flat.numel())  # gloo wants it flat
    wait(_all_gather_single(out, flat, group=group, async_op=True))
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


def gather_objects(obj: Any, group: dist.ProcessGroup | None, device: torch.device | None = None) -> list[Any]:
    """All-gather small JSON values (numbers, strings, lists, dicts; others send None): used at
    start-up and on a mismatch, for details. JSON in a uint8 tensor, never a pickle: a peer that
    reaches this rank's collectives can send it wrong data, not make it run code."""
    device = device or torch.device("cpu")
    data = json.dumps(obj).encode()
    TRAFFIC["details"] += len(data)
    sizes = gather_tensor(torch.tensor([len(data)], dtype=torch.int64, device=device), group, "details").view(-1)
    longest = int(sizes.max())
    padded = torch.zeros(longest, dtype=torch.uint8, device=device)
    if data:
        padded[:len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
    parts = gather_tensor(padded, group, "details")
    return [json.loads(part[:int(n)].cpu().numpy().tobytes().decode()) for part, n in zip(parts, sizes.tolist())]


@dataclass(slots=True)
class Incoming:
    """A peer's batch on its way (see :func:`ring_post`): its note now, its bytes on demand."""

    note: bytes
    """The 16-byte note the sender attached (the audit: the digest of its own pass)."""
    buffer: torch.Tensor | None
    works: list[Any]
    device: torch.device
    sending: torch.Tensor | None
    """This rank's own bytes in flight, kept alive until they are sent."""

    def receive(self) -> Any:
        """Wait for the bytes (and for this rank's own send) and unpickle them."""
        _wait(self.works)
        self.works, self.sending = [], None
        return _from_bytes(self.buffer, self.device) if self.buffer is not None else None


def ring_post(blob: torch.Tensor | None, note: bytes, send_to: int | None, recv_from: int | None,
              device: torch.device, group: dist.ProcessGroup | None) -> Incoming:
    """Send ``blob`` and a 16-byte ``note`` to one rank and start receiving another's.

    The sizes and notes cross first (one small round trip: the receiver must size its buffer),
    then the bytes are left in flight, so the caller can work while they travel. Either side may
    be None (this rank only sends, or only receives). Ranks are group ranks."""
    sending = blob is not None and send_to is not None
    receiving = recv_from is not None
    head_out = torch.tensor([blob.numel() if sending else 0, *_digest_to_words(note)], dtype=torch.int64, device=device)
    head_in = torch.zeros(3, dtype=torch.int64, device=device)
    TRAFFIC["batches"] += 8 + blob.numel() if sending else 0
    TRAFFIC["digests"] += DIGEST_BYTES if sending else 0
    _wait(_post(head_out if sending else None, send_to, head_in if receiving else None, recv_from, group))
    size, *note_words = head_in.tolist()  # one read to the host for the size and the note
    buffer = torch.empty(size, dtype=torch.uint8, device=device) if receiving else None
    outgoing = blob.to(device) if sending else None
    works = _post(outgoing, send_to, buffer, recv_from, group)
    return Incoming(_ints_to_bytes(note_words), buffer, works, device, outgoing)


def ring_exchange(payload: Any, send_to: int | None, recv_from: int | None, device: torch.device,
                  group: dist.ProcessGroup | None) -> Any:
    """Send ``payload`` to one rank and receive one from another, without deadlock."""
    blob = serialize(payload) if send_to is not None else None
    return ring_post(blob, bytes(DIGEST_BYTES), send_to, recv_from, device, group).receive()


def broadcast_digest(digest: bytes | None, src: int, device: torch.device, group: dist.ProcessGroup | None) -> bytes:
    """Rank ``src`` tells everyone one 16-byte digest."""
    TRAFFIC["digests"] += DIGEST_BYTES if digest is not None else 0
    words = torch.tensor(_digest_to_words(digest or bytes(DIGEST_BYTES)), dtype=torch.int64, device=device)
    wait(dist.broadcast(words, src=_global(group, src), group=group, async_op=True))
    return _words_to_bytes(words)


def broadcast_json(obj: Any, src: int, device: torch.device, group: dist.ProcessGroup | None) -> Any:
    """Rank ``src`` tells everyone a small JSON value (the others pass None): bytes in a tensor,
    never a pickle, so a peer cannot make this rank run code."""
    data = json.dumps(obj).encode() if obj is not None else b""
    size = torch.tensor([len(data)], dtype=torch.int64, device=device)
    wait(dist.broadcast(size, src=_global(group, src), group=group, async_op=True))
    blob = torch.frombuffer(bytearray(data), dtype=torch.uint8).to(device) if data else torch.empty(
        int(size), dtype=torch.uint8, device=device)
    TRAFFIC["details"] += len(data)
    wait(dist.broadcast(blob, src=_global(group, src), group=group, async_op=True))
    return json.loads(blob.cpu().numpy().tobytes().decode())


def _digest_to_words(digest: bytes) -> list[int]:
    """A 16-byte digest as two signed int64 words (what a collective can carry)."""
    return [int.from_bytes(digest[i:i + 8], "little", signed=True) for i in (0, 8)]


def _words_to_bytes(words: torch.Tensor) -> bytes:
    return _ints_to_bytes(words.tolist())


def _ints_to_bytes(words: list[int]) -> bytes:
    return b"".join(int(w).to_bytes(8, "little", signed=True) for w in words)


def _post(send: torch.Tensor | None, dst: int | None, recv: torch.Tensor | None, src: int | None,
          group: dist.ProcessGroup | None) -> list[Any]:
    """Start one receive and one send as a batch (NCCL would deadlock on a pair of ranks that
    both post a receive before their send, one by one)."""
    ops = []
    if recv is not None and src is not None:
        ops.append(dist.P2POp(dist.irecv, recv, _global(group, src), group))
    if send is not None and dst is not None:
        ops.append(dist.P2POp(dist.isend, send, _global(group, dst), group))
    return dist.batch_isend_irecv(ops) if ops else []


def _wait(works: list[Any]) -> None:
    for work in works:
        wait(work)


def _global(group: dist.ProcessGroup | None, rank: int) -> int:
    return rank if group is None or group == dist.group.WORLD else dist.get_global_rank(group, rank)


def serialize(payload: Any) -> torch.Tensor:
    """A payload (tensors, numbers, strings and lists / tuples / dicts of them; an object with
    ``to_wire()`` is sent as what that returns) as the uint8 tensor :func:`ring_post` sends."""
    buf = io.BytesIO()
    torch.save(payload.to_wire() if hasattr(payload, "to_wire") else payload, buf)
    return torch.frombuffer(bytearray(buf.getvalue()), dtype=torch.uint8)


class WireError(ValueError):
    """Bytes from a peer that are not a plain payload (tensors and containers of them)."""


def _from_bytes(blob: torch.Tensor, device: torch.device) -> Any:
    """Load a peer's payload with torch's restricted loader (``weights_only=True``: tensors,
    numbers, strings and containers only, never code); tensors that lived on a GPU of the
    sender land on this rank's GPU."""
    def remap(storage: Any, location: str) -> Any:
        return storage.to(device) if location.startswith("cuda") and device.type == "cuda" else storage
    try:
        host = blob if blob.device.type == "cpu" else blob.cpu()
        return torch.load(io.BytesIO(host.numpy().tobytes()), map_location=remap, weights_only=True)
    except Exception as exc:  # noqa: BLE001 - the unpickler raises many kinds
        raise WireError("a replayed batch must be tensors, numbers, strings and lists / tuples / dicts of them "
                        f"(it is loaded with weights_only=True): {exc}") from None
