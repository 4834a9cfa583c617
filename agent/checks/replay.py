"""Recomputing a rank's local batch on another replica, leaving no trace behind.

A replay runs the same forward (same micro-batches, same per-(step, rank) RNG seed, the buffer
values the original forward saw) and the same backward with ``torch.autograd.grad`` on the bare
module, accumulating micro-batch gradients in the original order. It never writes parameters,
``.grad``, the caller's RNG streams or the optimizer, and puts the module's buffers back.
"""
from __future__ import annotations

import collections

import contextlib
import hashlib
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator, Sequence

import torch

from .norms import squared_norm
from ..fingerprint import Fingerprint, fingerprint_many
from .rng import forward_seed, seeded

_state = {"replaying": False}


def replaying() -> bool:
    """True while sdcguard replays another rank's batch (e.g. to keep metrics out of a loss_fn)."""
    return _state["replaying"]


@contextlib.contextmanager
def replay_mode() -> Iterator[None]:
    """Passes inside are sdcguard's own (``replaying()`` is True): what keeps metrics and planted
    faults out of a replay keeps them out of them, e.g. an integration's ``settle_buckets`` pass."""
    # A plain flag rather than a ContextVar: autograd may run hooks on its own threads.
    previous, _state["replaying"] = _state["replaying"], True
    try:
        yield
    finally:
        _state["replaying"] = previous


_replay_mode = replay_mode  # the name sdcguard's own modules use


@dataclass(frozen=True, slots=True)
class Weighting:
    """``loss * value`` or ``loss / value`` — recorded as the user wrote it, because the two round
    differently and a replay must reproduce the bits."""

    op: str  # "mul" or "div"
    value: float

    def apply(self, loss: torch.Tensor) -> torch.Tensor:
        return loss * self.value if self.op == "mul" else loss / self.value


@dataclass(slots=True)
class Payload:
    """What a rank sends so another can redo its step: batches and the buffers each forward saw."""

    step: int
    owner: int
    """The rank whose forward seeds the step used (the sender, or its tensor-parallel group's first)."""
    micro_batches: Sequence[Any]
    buffers: list[dict[str, torch.Tensor]] = field(default_factory=list)
    weighting: list[Weighting | None] = field(default_factory=list)
    """How each micro-batch's loss was weighted before its backward (None or empty: not at all)."""

    def to_wire(self) -> dict[str, Any]:
        """Plain containers and tensors only: what a peer loads with ``weights_only=True``."""
        return {"step": self.step, "owner": self.owner, "micro_batches": list(self.micro_batches),
                "buffers": self.buffers, "weighting": [None if w is None else [w.op, w.value] for w in self.weighting]}

    @classmethod
    def from_wire(cls, wire: Any) -> Payload:
        if isinstance(wire, Payload):
            return wire
        if not isinstance(wire, dict) or not {"step", "owner", "micro_batches"} <= set(wire):
            raise ValueError("not a replay payload")
        return cls(int(wire["step"]), int(wire["owner"]), list(wire["micro_batches"]), list(wire.get("buffers") or []),
                   [None if w is None else Weighting(str(w[0]), float(w[1])) for w in wire.get("weighting") or []])


@dataclass(slots=True)
class PassResult:
    """The bits of one pass worth comparing: per-micro-batch losses and local gradients."""

    loss_fps: list[Fingerprint]
    grad_fps: dict[int, Fingerprint]
    grad_sq_norm: float | None = None
    """Only where asked for (non-finite confirmation: is the replayed gradient finite?)."""
    nonfinite_micro: int | None = None
    """With ``grad_sq_norm``: the first micro-batch after which the loss or the accumulated
    gradient was no longer finite."""

    def to_json(self) -> dict[str, Any]:
        return {"loss": [list(fp) for fp in self.loss_fps], "grad": {str(i): list(fp) for i, fp in self.grad_fps.items()},
                "grad_sq_norm": self.grad_sq_norm, "nonfinite_micro": self.nonfinite_micro}

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> PassResult:
        return cls([Fingerprint(int(a), int(b)) for a, b in data["loss"]],
                   {int(i): Fingerprint(int(a), int(b)) for i, (a, b) in data["grad"].items()},
                   data.get("grad_sq_norm"), data.get("nonfinite_micro"))

    def digest(self) -> bytes:
        h = hashlib.blake2b(digest_size=16)
        for fp in self.loss_fps:
            h.update(b"L" + fp.s0.to_bytes(8, "little") + fp.s1.to_bytes(8, "little"))
        for index in sorted(self.grad_fps):
            fp = self.grad_fps[index]
            h.update(index.to_bytes(4, "little") + fp.s0.to_bytes(8, "little") + fp.s1.to_bytes(8, "little"))
        return h.digest()


def replay(
    module: torch.nn.Module,
    loss_fn: Callable[[torch.nn.Module, Any], torch.Tensor],
    params: list[tuple[int, torch.nn.Parameter]],
    payload: Payload,
    *,
    seed: int,
    device: torch.device,
    scale: Callable[[torch.Tensor], torch.Tensor] | None = None,
    with_norm: bool = False,
) -> PassResult:
    """Recompute ``payload``'s local step on ``module``; ``params`` are (index, parameter)."""
    saved = snapshot_buffers(module)
    grads: dict[int, torch.Tensor] = {}
    losses: list[torch.Tensor] = []
    nonfinite_micro = None
    # Each parameter's gradient is added into its sum as the backward pass produces it, as
    # AccumulateGrad does (g0, then g0 + g1, ...: the same bits), and autograd.grad gets a
    # one-element stand-in back: so the sums and a whole micro-batch's gradients never coexist
    # (an audit step's peak stays within one gradient copy of a plain step's). One micro-batch
    # has nothing to add: autograd.grad's own answer is the sum, and no hook runs per parameter.
    single = len(payload.micro_batches) == 1
    holders: collections.Counter[int] = collections.Counter()
    handles = [] if single else [p.register_hook(_accumulator(grads, holders, index)) for index, p in params]
    try:
        with _replay_mode():
            for i, micro in enumerate(payload.micro_batches):
                if payload.buffers:
                    load_buffers(module, payload.buffers[i])
                with seeded(forward_seed(seed, payload.step, payload.owner, i), device):
                    loss = loss_fn(module, micro)
                weighting = payload.weighting[i] if payload.weighting else None
                scaled = weighting.apply(loss) if weighting is not None else loss
                if scale is not None:
                    scaled = scale(scaled)
                out = torch.autograd.grad(scaled, [p for _, p in params], allow_unused=True)
                if single:
                    grads = {index: g for (index, _), g in zip(params, out) if g is not None}
                del out
                losses.append(loss.detach())
                if with_norm and nonfinite_micro is None and not _finite(loss, grads.values()):
                    nonfinite_micro = i
    finally:
        for handle in handles:
            handle.remove()
        if saved:
            load_buffers(module, saved)
    result = _result(params, grads, losses, with_norm)
    result.nonfinite_micro = nonfinite_micro
    return result


def _accumulator(grads: dict[int, torch.Tensor], holders: collections.Counter[int],
                 index: int) -> Callable[[torch.Tensor], torch.Tensor]:
    """``holders`` counts the sums held per storage: the engine may hand one tensor to two
    parameters (``a + b``), and adding in place into it would change both sums."""
    def accumulate(grad: torch.Tensor) -> torch.Tensor:
        held = grads.get(index)
        if held is None:
            grads[index] = grad
            holders[_storage(grad)] += 1
        elif holders[_storage(held)] == 1 and held.dtype == grad.dtype and _dense(held):
            held.add_(grad)  # ours alone: no second sum beside it for an instant (the same bits)
        else:
            holders[_storage(held)] -= 1
            grads[index] = summed = held + grad
            holders[_storage(summed)] += 1
        return grad.new_zeros(()).expand(grad.shape)
    return accumulate


def _storage(t: torch.Tensor) -> int:
    return t.untyped_storage().data_ptr()


def _dense(t: torch.Tensor) -> bool:
    """No two elements share memory (contiguous in some order of its dimensions: a Linear
    weight's gradient is a transposed view), so adding in place adds each element once."""
    expected = 1
    for stride, size in sorted((st, sz) for st, sz in zip(t.stride(), t.shape) if sz > 1):
        if stride != expected:
            return False
        expected *= size
    return True


def _finite(loss: torch.Tensor, grads: Any) -> bool:
    parts = [squared_norm(g) for g in grads]
    return bool(torch.isfinite(loss).all()) and (not parts or bool(torch.isfinite(torch.stack(parts).sum())))


def snapshot_buffers(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    # a DTensor buffer (torchtitan's RoPE cache under tensor parallelism) travels as its local
    # tensor: the replaying rank holds the same placement in its own mesh
    return {name: _local(buf).detach().clone() for name, buf in module.named_buffers()}


class ForwardBuffers:
    """A forward pre-hook on the replayed module: the buffers each forward of the step being
    recorded sees (after DDP's broadcast), kept where a replay may need them. The step hands it
    the list to fill for the duration of one micro-batch's forward (:meth:`recording`)."""

    __slots__ = ("_into", "_index")

    def __init__(self) -> None:
        self._into: list[dict[str, torch.Tensor]] | None = None
        self._index = 0

    @contextlib.contextmanager
    def recording(self, into: list[dict[str, torch.Tensor]] | None, index: int) -> Iterator[None]:
        """Record micro-batch ``index``'s buffers into ``into`` (None: nothing to record)."""
        self._into, self._index = into, index
        try:
            yield
        finally:
            self._into = None

    def __call__(self, module: torch.nn.Module, args: Any) -> None:
        into = self._into
        if into is None or replaying() or len(into) != self._index:  # the first forward of the micro-batch only
            return
        into.append(snapshot_buffers(module))


def load_buffers(module: torch.nn.Module, values: dict[str, torch.Tensor]) -> None:
    with torch.no_grad():
        for name, buf in module.named_buffers():
            if name in values:
                _local(buf).copy_(values[name])


def _local(tensor: torch.Tensor) -> torch.Tensor:
    """A DTensor's local tensor (the same storage), or the tensor itself."""
    return tensor.to_local() if hasattr(tensor, "to_local") else tensor


def _result(params: list[tuple[int, torch.nn.Parameter]], grads: dict[int, torch.Tensor],
            losses: list[torch.Tensor], with_norm: bool) -> PassResult:
    # A parameter the batch did not reach has a zero gradient in DDP's bucket too.
    ordered = [grads.get(index) for index, _ in params]
    ordered = [torch.zeros_like(p) if g is None else g for g, (_, p) in zip(ordered, params)]
    # The losses with the gradients: one read of the sums to the host for the whole pass.
    every = fingerprint_many(ordered + losses)
    fps = dict(zip((index for index, _ in params), every))
    losses = every[len(ordered):]
    if not with_norm:
        return PassResult(losses, fps)
    # Only its finiteness matters (GradScaler confirmation), accumulated exactly as the comm hook
    # accumulates the original's, so a huge but finite gradient reads the same on both sides.
    sq = float(torch.stack([squared_norm(g) for g in ordered]).sum()) if ordered else 0.0
    return PassResult(losses, fps, sq)
