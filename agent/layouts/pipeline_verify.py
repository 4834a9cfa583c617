"""A pipeline checkpoint checked offline (``sdcguard verify-checkpoint DIR``): no model, no process group.

What a load checks (``pipeline_store.PipelineStore.load``, each rank its own position), done here for
every position at once: ``pipeline.json`` against the step and SHA-256 an alarm named
(``last_good_checkpoint_step`` / ``_sha256``: the SHA-256 of ``pipeline.json``), then each
position's stage file against what ``pipeline.json`` records for it (its SHA-256 and the step), its
bytes against its own manifest and the weights it holds against the digest check 3 verified at the
save (``checkpoint.verify_checkpoint``: ``torch.load(weights_only=True)`` of the bytes hashed, only
the classes ``allow_globals`` names besides tensors and plain values).

``pipeline.json`` is read once and hashed from the bytes parsed. Without ``expect_sha256`` an edit
to it that keeps every stage file's SHA-256 and the step (its ``verified_at``, say) is not seen:
the alarm's SHA-256 is what names the whole checkpoint.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

from .. import checkpoint
from .pipeline_store import MANIFEST, read_manifest


@dataclass(frozen=True, slots=True)
class PipelineVerification:
    path: str
    step: int
    sha256: str
    """Of ``pipeline.json``: what an alarm names."""
    positions: int
    replicas: int
    num_stages: int
    audited_step: int | None
    audited: bool
    replication: str
    """How each stage is replicated ("DDP", "FSDP2"; a manifest without the field: DDP)."""
    weights_verified: bool
    """Whether check 3 compared the weights across replicas before the save (pure FSDP stages: no)."""
    stages: tuple[checkpoint.Verification, ...]
    """Each position's file as ``checkpoint.verify_checkpoint`` found it, by position."""

    @property
    def parameters(self) -> int:
        return sum(s.parameters for s in self.stages)


def verify_pipeline(path: str | os.PathLike[str], *, expect_step: int | None = None,
                    expect_sha256: str | None = None, allow_globals: Sequence[Any] = ()) -> PipelineVerification:
    """Check the pipeline checkpoint directory ``path`` (see the module docstring). Raises
    CheckpointError naming every position that differs; :class:`checkpoint.UnsafeGlobals` when the
    files match but one holds objects not allowed (and nothing else is wrong)."""
    allow_globals = checkpoint.check_allowed(allow_globals)
    top = read_manifest(path, expect_step=expect_step, expect_sha256=expect_sha256)
    step = int(top["step"])
    found: list[checkpoint.Verification] = []
    problems: list[str] = []
    unsafe: list[checkpoint.UnsafeGlobals] = []
    for position in range(int(top["positions"])):
        entry = top["stages"][str(position)]
        file = Path(path) / entry["file"]
        if not file.is_file():
            problems.append(f"position {position}: {entry['file']} is missing")
            continue
        try:
            said = checkpoint.read_manifest(file)
            if int(said["step"]) != step:
                problems.append(f"position {position}: {entry['file']} holds step {said['step']}, {MANIFEST} "
                                f"says step {step}")
                continue
            if said["sha256"] != entry["sha256"]:
                problems.append(f"position {position}: {entry['file']}'s manifest records sha256 {said['sha256']}, "
                                f"{MANIFEST} {entry['sha256']} (not the file saved with this {MANIFEST})")
                continue
            found.append(checkpoint.verify_checkpoint(file, expect_step=step, expect_sha256=entry["sha256"],
                                                      allow_globals=allow_globals))
        except checkpoint.UnsafeGlobals as exc:
            unsafe.append(exc)
        except checkpoint.CheckpointError as exc:
            problems.append(f"position {position}: {exc}")
        except OSError as exc:
            problems.append(f"position {position}: {entry['file']} cannot be read: {exc}")
        except (TypeError, ValueError) as exc:  # a manifest whose step is not a number
            problems.append(f"position {position}: {entry['file']}'s manifest is malformed: {exc}")
    if problems:
        raise checkpoint.CheckpointError(f"{path}: " + "; ".join(problems + [str(u) for u in unsafe]))
    if unsafe:
        raise unsafe[0]
    return PipelineVerification(str(path), step, top["sha256"], int(top["positions"]), int(top["replicas"]),
                                int(top["num_stages"]), top.get("audited_step"), bool(top.get("audited")),
                                str(top.get("replication", "DDP")), bool(top.get("weights_verified", True)),
                                tuple(found))
