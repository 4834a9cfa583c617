"""Fault specifications: the nine kinds, the check that must catch each, the grammar.

    KIND:rank=R:step=S[:magnitude=X][:every=K][:during=replay][:element=N][:site=PATH|:param=NAME]

``every=K`` makes a fault persistent (it fires on step S, S+K, S+2K, ...) and strikes every
computation of rank R on those steps, replays included. A transient fault strikes R's own pass;
``during=replay`` makes a transient compute fault strike R's replay of another rank's batch
instead (the culprit is then the replaying side). The ``reduce-*`` kinds corrupt the all-reduce
itself and hit every rank alike, so for them ``rank`` is optional.

Where it strikes: ``element=N`` indexes the flattened tensor (default 0); ``site=PATH`` names the
module whose output a ``forward-*`` fault corrupts (e.g. ``transformer.h.0.mlp``) and
``param=NAME`` the parameter every other kind corrupts (e.g. ``lm_head.weight``: its local
gradient, its slice of the reduced gradient, or its stored value). Without them the fault strikes
the defaults given to :meth:`FaultInjector.install`. Names are checked against the model there.
Standard library only: specs are parsed and checked before any process starts.
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Any

from ..contract.alarm import (
    CHECK_NONFINITE_LOCAL, CHECK_NONFINITE_REDUCED, CHECK_REDUCE_CHECKSUM, CHECK_REPLAY, CHECK_WEIGHTS,
)


@dataclass(frozen=True, slots=True)
class FaultKind:
    name: str
    corrupts: str
    """Where the fault strikes: forward, grad, reduce, optimizer or weights."""
    caught_by: str | None
    """The check that must catch it (None: none can)."""
    default_magnitude: float | None = None


KINDS: dict[str, FaultKind] = {k.name: k for k in (
    FaultKind("forward-nan", "forward", CHECK_NONFINITE_LOCAL),
    FaultKind("forward-scale", "forward", CHECK_REPLAY, 1e4),
    FaultKind("grad-inf", "grad", CHECK_NONFINITE_LOCAL),
    FaultKind("grad-bitflip", "grad", CHECK_REPLAY),
    FaultKind("reduce-nan", "reduce", CHECK_NONFINITE_REDUCED),
    FaultKind("reduce-scale", "reduce", CHECK_REDUCE_CHECKSUM, 1e4),
    FaultKind("optimizer-scale", "optimizer", CHECK_WEIGHTS, 1e4),
    FaultKind("weight-bitflip", "weights", CHECK_WEIGHTS),
    FaultKind("weight-swap", "weights", CHECK_WEIGHTS),
)}


SHARD_SIDE = ("reduce", "optimizer", "weights")
"""On a sharded model, what the kinds striking a rank's local shard corrupt: their ``element``
indexes that shard (``faults/sharded.py``); the ``grad-*`` kinds index the full parameter."""


class FaultSpecError(ValueError):
    """A malformed ``--inject`` value; the message is one line meant for the user."""


class FaultTargetError(FaultSpecError):
    """A fault's target does not exist in the model (a module path, a parameter name, an element
    out of range); the message names the closest existing names."""


@dataclass(frozen=True, slots=True)
class FaultSpec:
    kind: str
    rank: int | None
    step: int
    magnitude: float | None = None
    every: int | None = None
    during: str = "own"
    """Which computation a transient fault strikes: the rank's own pass, or its replay."""
    element: int | None = None
    """Index into the flattened target tensor (None: the injector's default, 0 unless told)."""
    site: str | None = None
    """Module path whose output a forward fault corrupts (None: the injector's default)."""
    param: str | None = None
    """Parameter name every other kind corrupts (None: the injector's default)."""

    @property
    def info(self) -> FaultKind:
        return KINDS[self.kind]

    @property
    def persistent(self) -> bool:
        return self.every is not None

    def fires_at(self, step: int) -> bool:
        if step == self.step:
            return True
        return self.every is not None and step > self.step and (step - self.step) % self.every == 0

    def hits_rank(self, rank: int) -> bool:
        return self.rank is None or self.rank == rank

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)

    def __str__(self) -> str:
        parts = [self.kind] + ([f"rank={self.rank}"] if self.rank is not None else []) + [f"step={self.step}"]
        if self.magnitude is not None:
            parts.append(f"magnitude={self.magnitude:g}")
        if self.every is not None:
            parts.append(f"every={self.every}")
        if self.during != "own":
            parts.append(f"during={self.during}")
        for key in ("element", "site", "param"):
            if getattr(self, key) is not None:
                parts.append(f"{key}={getattr(self, key)}")
        return ":".join(parts)


_FIELDS = ("rank", "step", "magnitude", "every", "during", "element", "site", "param")


def parse_fault(text: str, world_size: int | None = None) -> FaultSpec:
    """Parse one ``--inject`` value and check it against the world size (when given)."""
    kind, *pairs = text.strip().split(":")
    if kind not in KINDS:
        raise FaultSpecError(f"unknown fault kind {kind!r} in {text!r}; kinds: {', '.join(KINDS)}")
    info = KINDS[kind]
    fields: dict[str, str] = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep or not value:
            raise FaultSpecError(f"malformed {pair!r} in {text!r}: expected key=value")
        if key not in _FIELDS:
            raise FaultSpecError(f"unknown field {key!r} in {text!r}; fields: {', '.join(_FIELDS)}")
        if key in fields:
            raise FaultSpecError(f"field {key!r} given twice in {text!r}")
        fields[key] = value
    if "step" not in fields:
        raise FaultSpecError(f"{text!r} lacks step=S")
    if "rank" not in fields and info.corrupts != "reduce":
        raise FaultSpecError(f"{text!r} lacks rank=R")
    rank = _int(fields, "rank", text, minimum=0) if "rank" in fields else None
    if rank is not None and world_size is not None and rank >= world_size:
        raise FaultSpecError(f"rank {rank} in {text!r} is out of range: the job has ranks 0..{world_size - 1}")
    step = _int(fields, "step", text, minimum=0)
    every = _int(fields, "every", text, minimum=1) if "every" in fields else None
    magnitude = info.default_magnitude
    if "magnitude" in fields:
        if info.default_magnitude is None:
            raise FaultSpecError(f"magnitude applies only to the *-scale kinds, not {kind!r}")
        try:
            magnitude = float(fields["magnitude"])
        except ValueError:
            raise FaultSpecError(f"magnitude must be a number in {text!r}") from None
        if not math.isfinite(magnitude):
            raise FaultSpecError(f"magnitude must be finite in {text!r}")
    during = fields.get("during", "own")
    if during not in ("own", "replay"):
        raise FaultSpecError(f"during must be 'own' or 'replay' in {text!r}")
    if during == "replay" and (info.corrupts not in ("forward", "grad") or every is not None):
        raise FaultSpecError(f"during=replay applies only to transient forward-* and grad-* faults, in {text!r}")
    element = _int(fields, "element", text, minimum=0) if "element" in fields else None
    forward = info.corrupts == "forward"
    if "site" in fields and not forward:
        raise FaultSpecError(f"site= names a module for the forward-* kinds; {kind!r} takes param=NAME, in {text!r}")
    if "param" in fields and forward:
        raise FaultSpecError(f"param= names a parameter; {kind!r} strikes a module's output: use site=PATH, in {text!r}")
    return FaultSpec(kind, rank, step, magnitude, every, during, element, fields.get("site"), fields.get("param"))


def _int(fields: dict[str, str], key: str, text: str, *, minimum: int) -> int:
    try:
        value = int(fields[key])
    except ValueError:
        raise FaultSpecError(f"{key} must be an integer in {text!r}") from None
    if value < minimum:
        raise FaultSpecError(f"{key} must be >= {minimum} in {text!r}")
    return value
