"""The one codec of what every checkpoint manifest says about verification, for every store.

A checkpoint's format is its store's (one file, a DCP directory, a Hugging Face ``checkpoint-N``
folder, torchtitan's ``step-N``): what the files are and how their bytes are hashed. What a run
resumed from it must know is the same for all of them, and is written and read here only: the
checks that covered it (``audited_step``, ``reduction_verified_step``) and the earlier checkpoints
it knows of, so that a resumed run's suspect windows can reach back past its own starting point.
"""
from __future__ import annotations

import hashlib
import os
from pathlib import Path
from typing import Any, Callable, Mapping

from . import recovery

EARLIER_CHECKPOINTS = 16
"""How many earlier checkpoints a manifest lists (the newest ones)."""

StillHolds = Callable[[str, int, "str | None"], bool]


def sha256_file(path: str | os.PathLike[str]) -> str:
    """The SHA-256 of a file's bytes (hex)."""
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        for block in iter(lambda: fh.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def entry_to_json(c: recovery.Checkpoint) -> dict[str, Any]:
    return {"step": c.step, "path": c.path, "audited_step": c.audited_step, "sha256": c.sha256,
            "kept_from": c.kept_from, "cross_checked": c.cross_checked}


def entry_from_json(d: Mapping[str, Any]) -> recovery.Checkpoint:
    return recovery.Checkpoint(int(d["step"]), str(d["path"]), d.get("audited_step"), d.get("sha256"),
                               d.get("kept_from"), bool(d.get("cross_checked", True)))


def verification_fields(history: recovery.History, step: int, path: str, plan: recovery.SavePlan,
                        kept_as: str | None) -> dict[str, Any]:
    """What a manifest of the checkpoint of ``step`` at ``path`` records about verification: the
    checks that covered it, and the checkpoints before it as the history will list them once this
    save is recorded (``plan`` and ``kept_as``: what the save keeps and removes)."""
    after = recovery.after_save(history, plan, recovery.Checkpoint(step, path, None), kept_as)
    earlier = [c for c in after.checkpoints if c.step < step][-EARLIER_CHECKPOINTS:]
    return {"audited_step": history.last_audited_step, "audited": history.last_audited_step == step,
            "reduction_verified_step": history.last_reduction_verified_step,
            "earlier_checkpoints": [entry_to_json(c) for c in earlier]}


def resumed_history(path: str | os.PathLike[str], manifest: Mapping[str, Any], *,
                    still_holds: StillHolds | None = None) -> recovery.History:
    """What a run resumed from ``path`` inherits: the verification its manifest recorded and the
    earlier checkpoints it lists that still hold their step (a path written again holds another).
    A manifest that says its weights were not cross-checked (pure FSDP: one replica) counts for
    no check 3, and is never named by an alarm."""
    holds = still_holds if still_holds is not None else still_holds_any
    step = int(manifest["step"])
    audited = manifest.get("audited_step")
    verified = bool(manifest.get("weights_verified", True))
    earlier = [entry_from_json(c) for c in manifest.get("earlier_checkpoints") or []
               if holds(str(c["path"]), int(c["step"]), c.get("sha256"))]
    return recovery.History(
        last_audited_step=audited, last_weights_verified_step=step if verified else None,
        last_reduction_verified_step=manifest.get("reduction_verified_step"),
        checkpoints=[*earlier, recovery.Checkpoint(step, str(path), audited, manifest["sha256"], cross_checked=verified)])


def still_holds_any(path: str, step: int, sha256: str | None) -> bool:
    """Whether ``path`` still holds the checkpoint of ``step`` (and ``sha256``), whichever store
    wrote it: a DCP directory, a ``checkpoint-N`` folder, or a file with its manifest."""
    from .checkpoint import CheckpointError, read_manifest
    from .checkpoint_folder import is_checkpoint_folder, verify_folder
    from .sharding import dcp_manifest
    from .layouts import pipeline_store
    try:
        if pipeline_store.is_pipeline_checkpoint(path):
            pipeline_store.read_manifest(path, expect_step=step, expect_sha256=sha256)
        elif dcp_manifest.is_sharded_checkpoint(path):
            dcp_manifest.read(path, expect_step=step, expect_sha256=sha256)
        elif Path(path).is_dir() and is_checkpoint_folder(path):
            verify_folder(path, expect_step=step, expect_sha256=sha256)
        else:
            read_manifest(path, expect_step=step, expect_sha256=sha256)
        return True
    except (CheckpointError, OSError, ValueError, KeyError):
        return False
