"""Checkpoints you can trust: written only after check 3 passes, verified when loaded.

``save_checkpoint`` runs check 3 on every rank first and refuses to write when it fails or when an
earlier alarm left the run suspect. Rank 0 then writes the checkpoint and, beside it, a manifest
``<path>.sdcguard.json`` recording the step, the weight digest it was verified at and the file's
SHA-256. ``load_checkpoint`` refuses a file whose bytes or weights do not match its manifest.
"""
from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from .contract.alarm import now_rfc3339
from .contract.spool import write_json_atomic
from .checks.weights import fingerprint_weights

MANIFEST_SCHEMA = "sdcguard.dev/checkpoint/v1"


class CheckpointError(RuntimeError):
    """A checkpoint that must not be written or must not be trusted; the message says why."""


def manifest_path(path: str | os.PathLike[str]) -> Path:
    return Path(f"{os.fspath(path)}.sdcguard.json")


def save_checkpoint(guard: Any, path: str | os.PathLike[str], step: int, extra: dict[str, Any] | None = None) -> Path:
    """Collective: verify the weights (check 3), then rank 0 writes checkpoint + manifest."""
    if guard.alarms_raised:
        raise CheckpointError(
            f"refusing to write {path}: this run raised {guard.alarms_raised} alarm(s) and its state "
            "is suspect; resume from the last good checkpoint instead")
    guard.check_weights(step)  # raises SDCDetected on every rank when a replica differs
    path = Path(path)
    if guard.topology.rank == 0:
        state = {
            "step": step,
            "model": guard.model.module.state_dict(),
            "optimizer": guard.optimizer.state_dict(),
            "scaler": guard.scaler.state_dict() if guard.scaler is not None else None,
            "extra": extra or {},
        }
        _save_atomic(state, path)
        write_json_atomic(manifest_path(path), json.dumps({
            "schema": MANIFEST_SCHEMA, "step": step, "verified": True,
            "weight_digest": guard.last_weights_digest, "sha256": _sha256(path),
            "verified_at": now_rfc3339(), "run_id": guard.topology.run_id,
        }, indent=2, sort_keys=True))
    dist.barrier(group=guard.group)
    guard.checkpoints.append((step, str(path)))
    return path


def load_checkpoint(path: str | os.PathLike[str], model: torch.nn.Module,
                    optimizer: torch.optim.Optimizer | None = None,
                    scaler: torch.amp.GradScaler | None = None,
                    map_location: Any = "cpu") -> dict[str, Any]:
    """Load a checkpoint written by :func:`save_checkpoint` after verifying it; return its state.

    ``model`` is the bare module (not the DDP wrapper). Raises CheckpointError on any mismatch and
    leaves the model untouched when the file itself is wrong.
    """
    path = Path(path)
    manifest = read_manifest(path)
    actual = _sha256(path)
    if actual != manifest["sha256"]:
        raise CheckpointError(f"{path} was modified after it was verified: sha256 {actual} != manifest {manifest['sha256']}")
    state = torch.load(path, map_location=map_location, weights_only=False)
    if state.get("step") != manifest["step"]:
        raise CheckpointError(f"{path} holds step {state.get('step')} but its manifest says {manifest['step']}")
    model.load_state_dict(state["model"])
    digest = fingerprint_weights(list(model.named_parameters())).digest.hex()
    if digest != manifest["weight_digest"]:
        raise CheckpointError(f"{path}: loaded weights have digest {digest}, manifest says {manifest['weight_digest']}")
    if optimizer is not None:
        optimizer.load_state_dict(state["optimizer"])
    if scaler is not None and state.get("scaler") is not None:
        scaler.load_state_dict(state["scaler"])
    return state


def read_manifest(path: str | os.PathLike[str]) -> dict[str, Any]:
    where = manifest_path(path)
    try:
        manifest = json.loads(where.read_text())
    except FileNotFoundError:
        raise CheckpointError(f"{path} has no manifest {where.name}: it was not written by sdcguard after a passing check") from None
    except ValueError as exc:
        raise CheckpointError(f"manifest {where} is not valid JSON: {exc}") from None
    if manifest.get("schema") != MANIFEST_SCHEMA or manifest.get("verified") is not True:
        raise CheckpointError(f"manifest {where} does not record a verified checkpoint")
    for key in ("step", "weight_digest", "sha256"):
        if key not in manifest:
            raise CheckpointError(f"manifest {where} lacks {key!r}")
    return manifest


def _save_atomic(state: dict[str, Any], path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp")
    torch.save(state, tmp)
    with open(tmp, "rb+") as fh:
        os.fsync(fh.fileno())
    os.replace(tmp, path)


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        for block in iter(lambda: fh.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()
