"""Where a run can safely resume after an alarm: the suspect window and the last good checkpoint.

A fault is caught where a check runs, not where it began. What each check proves, and so where its
window starts (the first step whose results the fault may have touched):

- ``replay`` — a finite compute fault. A failing unit usually stays failing, and its wrong
  gradient is averaged into every replica at once, so no later check can tell; only a passing
  audit clears the steps before it. Window: from the step after the last passing audit.
- ``nonfinite-local`` — a NaN/Inf that did not reproduce on another node: the same unit may have
  produced finite wrong values before it produced this one. Same rule as ``replay``.
- ``weights`` — a replica's stored weights differ. Every replica was equal at the last passing
  check 3, so the window starts after the last step whose post-update weights passed it.
- ``reduce-checksum`` and ``nonfinite-reduced`` — a fault inside the all-reduce. Replicas receive
  the same wrong sum and agree, so only check 4 clears a reduction: the window starts after the
  last step whose check 4 passed (the step before, when it runs on every step). Without check 4
  (a compression hook) nothing clears one: the window starts at step 0.

A resumed run inherits what its checkpoint's manifest recorded (the last audit it was covered by,
the checkpoints before it), so a window can reach back before the checkpoint it resumed from: a
checkpoint taken between audits is trusted for a weights fault, not for a compute fault.

``last_good_checkpoint`` is the newest checkpoint taken at a step before the window (a checkpoint
at step ``c`` holds the weights after ``c``'s update). Pure functions: unit-tested in-process.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from .contract.alarm import (
    CHECK_NONFINITE_LOCAL, CHECK_NONFINITE_REDUCED, CHECK_REDUCE_CHECKSUM, CHECK_REPLAY, CHECK_WEIGHTS,
)


@dataclass(frozen=True, slots=True)
class Checkpoint:
    step: int
    path: str
    audited_step: int | None
    """The last passing audit at or before ``step`` (what the checkpoint is covered by)."""


@dataclass(slots=True)
class History:
    """What this run has verified so far (the same on every rank)."""

    last_audited_step: int | None = None
    """The last audit step whose checks 1, 2 and 3 all passed."""
    last_weights_verified_step: int | None = None
    """The last step whose weights *after its update* every replica held identically."""
    last_reduction_verified_step: int | None = None
    """The last step whose gradient all-reduce check 4 verified."""
    checkpoints: list[Checkpoint] = field(default_factory=list)
    """Checkpoints this run wrote, resumed from, or inherited from that one's manifest, oldest first."""

    @property
    def last_verified_step(self) -> int | None:
        """The last step at which every check ran and passed: an audit step (checks 1, 2, 3);
        with audits off, the last step whose check 3 passed."""
        return self.last_audited_step if self.last_audited_step is not None else self.last_weights_verified_step


def suspect_window(check: str, step: int, history: History) -> dict[str, int]:
    """``{first_step, last_step}`` of the steps whose results the fault may have touched."""
    if check == CHECK_WEIGHTS:
        cleared = history.last_weights_verified_step
    elif check in (CHECK_REPLAY, CHECK_NONFINITE_LOCAL):
        cleared = history.last_audited_step
    elif check in (CHECK_NONFINITE_REDUCED, CHECK_REDUCE_CHECKSUM):
        cleared = history.last_reduction_verified_step
    else:  # a check this module does not know: trust nothing
        cleared = None
    first = 0 if cleared is None else cleared + 1
    return {"first_step": min(first, step), "last_step": step}


def last_good_checkpoint(window: dict[str, int], history: History) -> Checkpoint | None:
    """The newest checkpoint taken before the window, never one inside it."""
    older = [c for c in history.checkpoints if c.step < window["first_step"]]
    return max(older, key=lambda c: c.step) if older else None


def recovery_fields(check: str, step: int, history: History) -> dict[str, object]:
    """The alarm record's recovery fields (SPEC §3; the v1 additive ones included)."""
    window = suspect_window(check, step, history)
    good = last_good_checkpoint(window, history)
    return {
        "suspect_window": window,
        "last_verified_step": history.last_verified_step,
        "last_audited_step": history.last_audited_step,
        "last_weights_verified_step": history.last_weights_verified_step,
        "last_good_checkpoint": good.path if good else None,
        "last_good_checkpoint_step": good.step if good else None,
        # Resuming from a checkpoint at c recomputes c+1..step; with none, from the beginning.
        "steps_at_risk": step - (good.step if good else -1),
    }
