"""Check 3 with one replica: another rank re-runs this rank's optimizer update and compares.

With pure FSDP no other rank holds a rank's shard, so check 3 has nothing to compare it with, and
a fault in the optimizer's update of that shard reaches every rank's next all-gather alike (no
replay differs). An elementwise optimizer (AdamW, Adam, SGD) updates each element from that
element's parameter, gradient and state alone, so any rank can recompute any shard's update from
four inputs: the shard before the update, its gradient as the optimizer read it (after clipping),
its optimizer state before the update, and the hyper-parameters of the step. On weight-check steps
the owner keeps a copy of those (:func:`take_snapshot`, in an optimizer step pre-hook), its ring
neighbour re-runs the update (:func:`rerun`: a fresh optimizer of the same class over copies of
the tensors, the very code torch ran for the owner) and compares the fingerprints of the resulting
shard and state with the owner's (docs/sharded.md, "One replica: the update re-run").

Pure functions (no collectives): the ring and its tie-break are ``sharding/update_check.py``'s.
Bit for bit on the same device type and thread count: the re-run uses the owner's implementation
(single-tensor, foreach or fused), resolved from the owner's own tensors where torch would pick it.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import torch

from ..contract.alarm import CHECK_WEIGHTS
from ..fingerprint import Fingerprint, digest, fingerprint_sums, to_fingerprints
from .attribution import REPLAYER, attribute, suspects_after
from .verdict import Verdict, parameter_summary

__all__ = ["SUPPORTED", "UpdateSnapshot", "refusal", "take_snapshot", "owner_result", "rerun", "result_digest",
           "fingerprints", "differing", "pack", "unpack", "settle_alone", "tiebreaks", "update_verdict"]

SUPPORTED: dict[type, str] = {torch.optim.AdamW: "AdamW", torch.optim.Adam: "Adam", torch.optim.SGD: "SGD"}
"""Optimizers whose update is elementwise and re-run here (the exact classes: a subclass may
override ``step``)."""

_UNSUPPORTED_FLAGS = ("differentiable",)
"""Param-group settings the re-run refuses: a differentiable step keeps an autograd graph."""

Local = Callable[[torch.Tensor], torch.Tensor]


def _identity(t: torch.Tensor) -> torch.Tensor:
    return t


def refusal(optimizer: torch.optim.Optimizer) -> str | None:
    """Why this optimizer's update cannot be re-run elsewhere, or None."""
    kind = type(optimizer)
    if kind not in SUPPORTED:
        return (f"{kind.__module__}.{kind.__qualname__} is not one of torch.optim.AdamW, Adam, SGD "
                "(elementwise updates sdcguard re-runs bit for bit)")
    for i, group in enumerate(optimizer.param_groups):
        for flag in _UNSUPPORTED_FLAGS:
            if group.get(flag):
                return f"param group {i} sets {flag}=True"
    return None


@dataclass(slots=True)
class UpdateSnapshot:
    """What one rank's update started from (local shards, copies): all a re-run needs."""

    step: int
    hyper: list[dict[str, Any]]
    """Each param group's settings (everything but ``params``), foreach resolved as torch did."""
    groups: list[int]
    """Each parameter's group, in the optimizer's order."""
    names: list[str]
    before: list[torch.Tensor]
    """Each parameter's local shard before the update."""
    grads: list[torch.Tensor | None]
    """Each parameter's local gradient as the optimizer read it (None: not updated)."""
    states: list[dict[str, Any]]
    """Each parameter's optimizer state before the update (tensors copied; empty before the first)."""

    def to_wire(self) -> dict[str, Any]:
        """Every shard, gradient and state tensor packed into one byte buffer (one record to
        serialize, not hundreds), the rest as plain values."""
        states = [{k: v for k, v in st.items() if not isinstance(v, torch.Tensor)} for st in self.states]
        keys = [sorted(k for k, v in st.items() if isinstance(v, torch.Tensor)) for st in self.states]
        tensors = [*self.before, *self.grads, *(st[k] for st, ks in zip(self.states, keys) for k in ks)]
        flat, meta = pack(tensors)
        return {"step": self.step, "hyper": _to_json(self.hyper), "groups": self.groups, "names": self.names,
                "states": _to_json(states), "state_keys": keys, "flat": flat, "meta": meta}

    @classmethod
    def from_wire(cls, wire: dict[str, Any]) -> UpdateSnapshot:
        n = len(wire["names"])
        tensors = unpack(wire["flat"], wire["meta"])
        states, at = [dict(st) for st in _from_json(wire["states"])], 2 * n
        for st, keys in zip(states, wire["state_keys"]):
            for k in keys:
                st[k], at = tensors[at], at + 1
        return cls(int(wire["step"]), list(_from_json(wire["hyper"])), list(wire["groups"]), list(wire["names"]),
                   tensors[:n], tensors[n:2 * n], states)

    @property
    def nbytes(self) -> int:
        """Bytes of tensor data the snapshot holds (what travels to the re-running rank)."""
        tensors = [*self.before, *(g for g in self.grads if g is not None),
                   *(v for s in self.states for v in s.values() if isinstance(v, torch.Tensor))]
        return sum(t.numel() * t.element_size() for t in tensors)


def _copy(value: Any, local: Local) -> Any:
    if isinstance(value, torch.Tensor):
        return local(value).detach().clone()
    if isinstance(value, (tuple, list)):
        return type(value)(_copy(v, local) for v in value)
    return value


def resolved_foreach(optimizer: torch.optim.Optimizer, group: dict[str, Any], params: list[torch.Tensor]) -> Any:
    """The ``foreach`` setting torch's step takes for ``group`` over ``params`` (its tensors with
    gradients, as the optimizer sees them: DTensors under FSDP2), so that the re-run on plain local
    tensors runs the same implementation; the group's own value when it set foreach or fused."""
    foreach = group.get("foreach")
    if foreach is not None or group.get("fused") is not None:
        return foreach
    from torch.optim.optimizer import _default_to_fused_or_foreach
    _, foreach = _default_to_fused_or_foreach(params, bool(group.get("differentiable", False)), use_fused=False)
    if foreach and type(optimizer) is not torch.optim.SGD and isinstance(group.get("lr"), torch.Tensor) \
            and not group.get("capturable", False):
        foreach = False  # Adam/AdamW: torch does not take foreach with a tensor lr and capturable=False
    return foreach


def take_snapshot(optimizer: torch.optim.Optimizer, step: int, names: dict[int, str] | None = None,
                  local: Local = _identity) -> UpdateSnapshot:
    """Copy what ``optimizer.step()`` is about to read (call it in a step pre-hook): each param
    group's settings, and per parameter its (local) shard, gradient and state."""
    names = names or {}
    hyper, groups, labels, before, grads, states = [], [], [], [], [], []
    for g, group in enumerate(optimizer.param_groups):
        settings = {k: _copy(v, local) for k, v in group.items() if k != "params"}
        settings["foreach"] = resolved_foreach(optimizer, group, [p for p in group["params"] if p.grad is not None])
        hyper.append(settings)
        for i, p in enumerate(group["params"]):
            groups.append(g)
            labels.append(names.get(id(p), f"group{g}.param{i}"))
            before.append(local(p).detach().clone())
            grads.append(None if p.grad is None else local(p.grad).detach().clone())
            states.append({k: _copy(v, local) for k, v in optimizer.state.get(p, {}).items()})
    return UpdateSnapshot(step, hyper, groups, labels, before, grads, states)


def owner_result(optimizer: torch.optim.Optimizer, names: list[str], local: Local = _identity
                 ) -> list[tuple[str, torch.Tensor]]:
    """The owner's shard and state after its update, in the order :func:`rerun` returns them."""
    params = [p for group in optimizer.param_groups for p in group["params"]]
    return _labelled(names, [local(p) for p in params],
                     [{k: local(v) if isinstance(v, torch.Tensor) else v for k, v in optimizer.state.get(p, {}).items()}
                      for p in params])


def rerun(optimizer_class: type, snap: UpdateSnapshot) -> list[tuple[str, torch.Tensor]]:
    """Re-run the update ``snap`` started from: a fresh ``optimizer_class`` over copies of the
    owner's shards with its settings, state and gradients, one ``step()``. Returns each parameter's
    shard and tensor state after it, labelled (``name``, ``name.<state key>``)."""
    if optimizer_class not in SUPPORTED:
        raise TypeError(f"{optimizer_class.__name__}: not an optimizer the update re-run supports")
    params = [t.detach().clone().requires_grad_(t.is_floating_point() or t.is_complex()) for t in snap.before]
    groups = [{**{key: _copy(v, _identity) for key, v in settings.items()},
               "params": [p for p, g in zip(params, snap.groups) if g == k]} for k, settings in enumerate(snap.hyper)]
    fresh = optimizer_class([g for g in groups if g["params"]])
    for p, grad, state in zip(params, snap.grads, snap.states):
        p.grad = None if grad is None else grad.clone()
        if state:
            fresh.state[p] = {k: _copy(v, _identity) for k, v in state.items()}
    fresh.step()
    return _labelled(snap.names, [p.detach() for p in params],
                     [{k: v for k, v in fresh.state.get(p, {}).items()} for p in params])


def _labelled(names: list[str], params: list[torch.Tensor], states: list[dict[str, Any]]
              ) -> list[tuple[str, torch.Tensor]]:
    out = []
    for name, p, state in zip(names, params, states):
        out.append((name, p))
        out += [(f"{name}.{k}", state[k]) for k in sorted(state) if isinstance(state[k], torch.Tensor)]
    return out


def fingerprints(result: list[tuple[str, torch.Tensor]]) -> list[Fingerprint]:
    """Every tensor's fingerprint (one device-to-host transfer per device)."""
    by_device: dict[torch.device, list[int]] = {}
    for i, (_, t) in enumerate(result):
        by_device.setdefault(t.device, []).append(i)
    out = [Fingerprint(0, 0)] * len(result)
    for indices in by_device.values():
        for i, fp in zip(indices, to_fingerprints(fingerprint_sums([result[i][1].detach() for i in indices]))):
            out[i] = fp
    return out


def result_digest(result: list[tuple[str, torch.Tensor]]) -> bytes:
    """One 16-byte digest of every tensor of a result, from one fingerprint of their bytes end to
    end (per-tensor fingerprints, :func:`fingerprints`, are taken only to say what differs)."""
    flat, _ = pack([t for _, t in result])
    return digest(to_fingerprints(fingerprint_sums([flat])))


def _to_json(value: Any) -> Any:
    """Settings and small state values as JSON (what travels besides the packed tensors): a tuple
    and a tensor (a learning rate may be one) are tagged so that :func:`_from_json` restores them."""
    if isinstance(value, torch.Tensor):
        return {"__tensor__": [str(value.dtype), list(value.shape), value.detach().cpu().reshape(-1).tolist()],
                "device": str(value.device)}
    if isinstance(value, tuple):
        return {"__tuple__": [_to_json(v) for v in value]}
    if isinstance(value, list):
        return [_to_json(v) for v in value]
    if isinstance(value, dict):
        return {str(k): _to_json(v) for k, v in value.items()}
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    raise TypeError(f"an optimizer setting of type {type(value).__name__} cannot be sent for a re-run")


def _from_json(value: Any) -> Any:
    if isinstance(value, list):
        return [_from_json(v) for v in value]
    if isinstance(value, dict):
        if "__tuple__" in value:
            return tuple(_from_json(v) for v in value["__tuple__"])
        if "__tensor__" in value:
            dtype_name, shape, items = value["__tensor__"]
            if dtype_name not in _DTYPES:
                raise ValueError(f"unexpected dtype {dtype_name!r} in an update re-run's settings")
            device = torch.device(value["device"])
            if device.type == "cuda" and not torch.cuda.is_available():
                device = torch.device("cpu")
            return torch.tensor(items, dtype=_DTYPES[dtype_name], device=device).reshape(shape)
        return {k: _from_json(v) for k, v in value.items()}
    return value


_DTYPES = {str(d): d for d in (torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int64,
                               torch.int32, torch.int16, torch.int8, torch.uint8, torch.bool,
                               torch.complex64, torch.complex128)}


def pack(tensors: list[torch.Tensor | None]) -> tuple[torch.Tensor, list[Any]]:
    """Tensors (None kept as None) as one uint8 buffer on the first tensor's device, and what
    :func:`unpack` needs: ``[dtype, shape]`` per tensor."""
    present = [t.detach().reshape(-1) for t in tensors if t is not None]
    meta = [None if t is None else [str(t.dtype), list(t.shape)] for t in tensors]
    if not present:
        return torch.empty(0, dtype=torch.uint8), meta
    device = present[0].device
    return torch.cat([t.to(device).view(torch.uint8) if t.numel() else t.new_empty(0, dtype=torch.uint8)
                      for t in present]), meta


def unpack(flat: torch.Tensor, meta: list[Any]) -> list[torch.Tensor | None]:
    """The tensors :func:`pack` packed (copies, contiguous)."""
    out: list[torch.Tensor | None] = []
    at = 0
    for item in meta:
        if item is None:
            out.append(None)
            continue
        dtype_name, shape = item
        if dtype_name not in _DTYPES:
            raise ValueError(f"unexpected dtype {dtype_name!r} in an update re-run's payload")
        dtype = _DTYPES[dtype_name]
        numel = 1
        for d in shape:
            numel *= int(d)
        size = numel * torch.empty(0, dtype=dtype).element_size()
        out.append(flat[at:at + size].clone().view(dtype).reshape(shape))
        at += size
    if at != flat.numel():
        raise ValueError(f"an update re-run's payload holds {flat.numel()} bytes, its tensors {at}")
    return out


def differing(names: list[str], mine: list[Fingerprint], theirs: list[Fingerprint]) -> list[str]:
    """The labels whose fingerprints differ (all of them when the lists do not line up)."""
    if len(mine) != len(theirs):
        return list(names)
    return [n for n, a, b in zip(names, mine, theirs) if a != b]


def settle_alone(owner_digest: bytes, rerun_digest: bytes, own_rerun: bytes) -> str:
    """With two ranks there is no third: the owner re-runs its own update. Agreeing with the
    neighbour's re-run, its first result was the odd one (a transient fault): REPLAYER (the
    owner erred). Agreeing with its first result, the fault may be the neighbour's or a
    persistent one of the owner's: neither can be named (``"neither"``)."""
    if own_rerun == rerun_digest and own_rerun != owner_digest:
        return REPLAYER
    return "neither"


def tiebreaks(pairs: list[tuple[int, int]], world: int) -> list[tuple[int, int]]:
    """Pure: the mismatching pairs a third opinion must settle, in order (the same on every rank):
    check 2's rule (``attribution.attribute``) with three ranks or more; with two, a lone pair is
    settled by the owner's own re-run (two pairs: each rank's update and re-run both differ, and
    neither can be named)."""
    if world >= 3:
        return attribute(pairs, world).tiebreaks
    return list(pairs) if len(pairs) == 1 else []


def update_verdict(step: int, pairs: list[tuple[int, int]], world: int, settled: dict[tuple[int, int], str],
                   differing_labels: dict[int, list[str]]) -> Verdict | None:
    """Pure: from the mismatching ``(rerunner, owner)`` pairs and each tie-break's answer (OWNER,
    REPLAYER or neither, :func:`checks.attribution.settle`), the ranks named; None when no pair
    mismatched. A rank in two pairs (its update wrong and its re-run of another's wrong) is named
    alone, as check 2 names a persistent fault."""
    if not pairs:
        return None
    found = attribute(pairs, world)
    suspects, ambiguous = set(found.suspects), found.ambiguous
    if world < 3:
        # attribute() names both sides of every pair; a tie-break by the owner's own re-run may name one.
        suspects, ambiguous = set(), False
        for pair in pairs:
            named = suspects_after(settled.get(pair, "neither"), *pair)
            suspects |= named
            ambiguous |= len(named) > 1
    for pair in found.tiebreaks:
        named = suspects_after(settled.get(pair, "neither"), *pair)
        suspects |= named
        ambiguous |= len(named) > 1
    return Verdict(CHECK_WEIGHTS, suspects=sorted(suspects), ambiguous=ambiguous, evidence={
        "update_replay": {
            "step": step,
            "mismatching": [{"rerun_by": r, "owner": o, **({"tiebreak": settled[(r, o)]} if (r, o) in settled else {})}
                            for r, o in pairs],
            "differing": {o: parameter_summary(differing_labels.get(o, [])) for _, o in pairs},
        }})

