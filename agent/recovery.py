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
at step ``c`` holds the weights after ``c``'s update).

A path written again (nanoGPT's ``ckpt.pt``, Lightning's ``last.ckpt``) no longer holds the step
it held, so its entry leaves the history. When a later alarm could still name that entry (it is
at or after :func:`resume_floor`), the file is kept beside the new one first, under a name that
says its step (:func:`kept_path`), and the entry follows it; kept files below the floor are
removed. Pure functions: unit-tested in-process.
"""
from __future__ import annotations

import logging
import os
import re
from dataclasses import dataclass, field, replace

from .contract.alarm import (
    CHECK_NONFINITE_LOCAL, CHECK_NONFINITE_REDUCED, CHECK_REDUCE_CHECKSUM, CHECK_REPLAY, CHECK_WEIGHTS,
)


@dataclass(frozen=True, slots=True)
class Checkpoint:
    step: int
    path: str
    audited_step: int | None
    """The last passing audit at or before ``step`` (what the checkpoint is covered by)."""
    sha256: str | None = None
    """The file's SHA-256 as its manifest records it."""
    kept_from: str | None = None
    """When sdcguard kept this file because a save overwrote the path it was written to: that path."""
    cross_checked: bool = True
    """Whether check 3 compared these weights with another replica's before the save. False for a
    model with one replica per shard (pure FSDP, docs/design.md §3 Sharded models): nothing shows
    its weights were right, so an alarm never names it, and no save keeps it for one."""


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
    """The newest checkpoint taken before the window, never one inside it (nor one whose weights
    were never compared with another replica's)."""
    older = [c for c in history.checkpoints if c.step < window["first_step"] and c.cross_checked]
    return max(older, key=lambda c: c.step) if older else None


def _anchors(history: History) -> list[Checkpoint | None]:
    """For each check that has cleared a step (the last passing audit, check 3, check 4): the
    newest cross-checked checkpoint at or before that step, or None when there is none.

    The one rule of what a later alarm can name: its window starts after the step its check last
    cleared, and those steps only grow, so a check can from now on name its anchor or a newer
    checkpoint, never an older one."""
    anchors: list[Checkpoint | None] = []
    for cleared in (history.last_audited_step, history.last_weights_verified_step,
                    history.last_reduction_verified_step):
        if cleared is None:
            continue  # never ran, or will clear a step no older than every checkpoint that exists now
        older = [c for c in history.checkpoints if c.step <= cleared and c.cross_checked]
        anchors.append(max(older, key=lambda c: c.step) if older else None)
    return anchors


def nameable(history: History) -> list[Checkpoint]:
    """The checkpoints a later alarm can name besides the newest: each check's anchor (see
    :func:`_anchors`), oldest first, each once. A framework's rotation that keeps only some
    checkpoints (Hugging Face's ``save_total_limit``) spares these."""
    found = {id(c): c for c in _anchors(history) if c is not None}
    return sorted(found.values(), key=lambda c: c.step)


def resume_floor(history: History) -> int | None:
    """The oldest checkpoint step a later alarm can still name, or None when every one may be
    (a check cleared a step with no cross-checked checkpoint at or before it): the oldest anchor."""
    anchors = _anchors(history)
    if any(a is None for a in anchors):
        return None
    return min((a.step for a in anchors if a is not None), default=None)


def worth_keeping(history: History, path: str) -> Checkpoint | None:
    """The entry ``path`` holds, when a framework's rotation is about to remove it and a later alarm
    may still name it (cross-checked, at or after :func:`resume_floor`, and no other copy of its
    step in the history): keep it under :func:`kept_path` instead. None: let it go."""
    floor = resume_floor(history)
    others = [c for c in history.checkpoints if c.path != path]
    return next((c for c in history.checkpoints if c.path == path and c.cross_checked
                 and (floor is None or c.step >= floor) and not any(o.step == c.step for o in others)), None)


def kept_path(path: str, step: int) -> str:
    """Where an overwritten checkpoint of ``step`` is kept: ``ckpt.pt`` -> ``ckpt.sdcguard-step20.pt``."""
    head, name = os.path.split(path)
    stem, dot, suffix = name.rpartition(".")
    kept = f"{stem}.sdcguard-step{step}.{suffix}" if dot and stem else f"{name}.sdcguard-step{step}"
    return os.path.join(head, kept)


_KEPT_NAME = re.compile(r".+\.sdcguard-step[0-9]+(?:\.[^./]+)?")
"""The names :func:`kept_path` gives: ``<stem>.sdcguard-step<N>.<suffix>`` or ``<name>.sdcguard-step<N>``."""

_WRITTEN_HERE: set[str] = set()
"""The kept files and directories this process itself made (:func:`remember_kept`)."""


def remember_kept(path: str) -> None:
    """Record that this process made ``path`` (a kept file or directory): :func:`may_remove` may
    later remove it wherever it lies."""
    _WRITTEN_HERE.add(os.path.realpath(path))


def may_remove(path: str, directory: str, *, written: frozenset[str] | set[str] = frozenset(),
               is_link: bool = False) -> str | None:
    """Pure: why sdcguard may NOT delete ``path`` when pruning the kept copies beside a checkpoint
    saved in ``directory``, or None when it may. Paths come from manifests (``earlier_checkpoints``),
    which anyone who can write a checkpoint's folder can edit, so a path is deleted only when it is
    one this run itself kept (``written``: real paths), or it lies directly in ``directory`` and has
    a kept name (:func:`kept_path`: ``<stem>.sdcguard-step<N><suffix>``) and is not a symbolic link
    (``is_link``: what the file system says, given by the caller)."""
    real = os.path.realpath(path)
    if real in written and not is_link:
        return None
    if is_link:
        return "it is a symbolic link"
    if os.path.dirname(real) != os.path.realpath(directory):
        return f"it is not in the checkpoint's directory {directory}"
    if not _KEPT_NAME.fullmatch(os.path.basename(os.path.normpath(path))):
        return "its name is not one sdcguard gives a kept checkpoint (<stem>.sdcguard-step<N><suffix>)"
    return None


def removable(paths: tuple[str, ...], directory: str) -> list[str]:
    """The ``paths`` :func:`may_remove` lets a save in ``directory`` delete; each refused one is
    left alone with a warning. What every deleter of kept checkpoints calls first."""
    allowed = []
    for path in paths:
        why = may_remove(path, directory, written=_WRITTEN_HERE, is_link=os.path.islink(path))
        if why is None:
            allowed.append(path)
        else:
            logging.getLogger("sdcguard").warning(
                "sdcguard: refusing to delete %s, which a checkpoint manifest lists as an earlier kept checkpoint: "
                "%s; left alone", path, why)
    return allowed


@dataclass(frozen=True, slots=True)
class SavePlan:
    """What a save of ``path`` at ``step`` does to the files and to the history."""

    keep: Checkpoint | None
    """The entry ``path`` holds now, to keep at ``kept_path`` before the path is written again."""
    dropped: tuple[Checkpoint, ...]
    """Entries that leave the history: the one the path held (unless kept), and kept copies
    below the floor (their files are removed)."""
    remove: tuple[str, ...]
    """Kept files to delete (sdcguard made them; the user's own files are never deleted)."""


def plan_save(history: History, path: str, step: int, *, keep: bool) -> SavePlan:
    """Decide, before ``path`` is written with the checkpoint of ``step``, what to keep and remove."""
    same_path = [c for c in history.checkpoints if c.path == path]
    others = [c for c in history.checkpoints if c.path != path]
    # The history as it would be with every entry kept: which of them can an alarm still name?
    candidate = History(history.last_audited_step, max(step, history.last_weights_verified_step or step),
                        history.last_reduction_verified_step, [*history.checkpoints, Checkpoint(step, path, None)])
    floor = resume_floor(candidate)
    needed = [c for c in same_path if keep and c.cross_checked and c.step != step and (floor is None or c.step >= floor)
              and not any(o.step == c.step for o in others)]  # a copy of that step exists already
    kept = max(needed, key=lambda c: c.step) if needed else None
    stale = tuple(c for c in others if c.kept_from is not None and floor is not None and c.step < floor)
    dropped = tuple(c for c in same_path if c is not kept) + stale
    return SavePlan(kept, dropped, tuple(c.path for c in stale))


def log_plan(plan: SavePlan, kept_as: str | None, saved: Checkpoint) -> None:
    """Say what a save kept beside it and what it removed (both DDP files and DCP directories)."""
    log = logging.getLogger("sdcguard")
    if plan.keep is not None and kept_as is not None:
        log.warning("sdcguard: %s held step %d, which a later alarm may still name as its resume point: "
                    "kept as %s while %s now holds step %d", plan.keep.path, plan.keep.step, kept_as,
                    saved.path, saved.step)
    for path in plan.remove:
        log.info("sdcguard: removed %s: a newer verified checkpoint covers every window an alarm can open", path)


def after_save(history: History, plan: SavePlan, saved: Checkpoint, kept_as: str | None) -> History:
    """The history once ``saved`` was written as planned (``kept_as``: where the kept entry went,
    None when keeping it failed)."""
    gone = {id(c) for c in plan.dropped}
    entries = []
    for c in history.checkpoints:
        if id(c) in gone:
            continue
        if c is plan.keep:
            if kept_as is None:
                continue
            c = replace(c, path=kept_as, kept_from=c.path)
        entries.append(c)
    entries.append(saved)
    entries.sort(key=lambda c: c.step)
    return replace(history, checkpoints=entries)


def recovery_fields(check: str, step: int, history: History) -> dict[str, object]:
    """The alarm record's recovery fields (docs/design.md §3; the v1 additive ones included)."""
    window = suspect_window(check, step, history)
    good = last_good_checkpoint(window, history)
    return {
        "suspect_window": window,
        "last_verified_step": history.last_verified_step,
        "last_audited_step": history.last_audited_step,
        "last_weights_verified_step": history.last_weights_verified_step,
        "last_good_checkpoint": good.path if good else None,
        "last_good_checkpoint_step": good.step if good else None,
        "last_good_checkpoint_sha256": good.sha256 if good else None,
        # Set when sdcguard kept the file because the path it was saved to was written again.
        "last_good_checkpoint_kept_from": good.kept_from if good else None,
        # Resuming from a checkpoint at c recomputes c+1..step; with none, from the beginning.
        "steps_at_risk": step - (good.step if good else -1),
    }
