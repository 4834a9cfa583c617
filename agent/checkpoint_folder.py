"""A checkpoint that is a folder of a framework's files (Hugging Face's ``checkpoint-N``), checked
with the standard library, torch and safetensors only: what ``sdcguard verify-checkpoint`` runs on
such a folder, without importing the framework that wrote it.

The manifest ``sdcguard-trainer.json`` in the folder (written by
``sdcguard.integrations.huggingface`` once check 3 passed) lists every file's SHA-256, the folder's
identity (one SHA-256 over that list: what an alarm names as ``last_good_checkpoint_sha256``), the
step, and the weight digest of the parameters in ``model.safetensors``.
"""
from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Any

from .checkpoint import CheckpointError, state_digest
from .sharding.dcp_manifest import identity, sha256_file

__all__ = ["MANIFEST_NAME", "SCHEMA", "WEIGHTS_FILE", "is_checkpoint_folder", "verify_folder",
           "hash_folder", "weights_digest"]

MANIFEST_NAME = "sdcguard-trainer.json"
SCHEMA = "sdcguard.dev/checkpoint-hf/v1"
WEIGHTS_FILE = "model.safetensors"


def is_checkpoint_folder(path: str | os.PathLike[str]) -> bool:
    """Whether ``path`` is a folder with a ``sdcguard-trainer.json`` manifest."""
    return (Path(path) / MANIFEST_NAME).is_file()


def verify_folder(path: str | os.PathLike[str], *, expect_step: int | None = None,
                  expect_sha256: str | None = None) -> dict[str, Any]:
    """Check a ``checkpoint-N`` folder against its manifest without a model or a process group:
    the step and identity an alarm named, every file's SHA-256 (none missing or added), and the
    weight digest of the parameters in ``model.safetensors``. Returns the manifest; raises
    ``CheckpointError`` naming what differs."""
    folder = Path(path)
    try:
        manifest = json.loads((folder / MANIFEST_NAME).read_text())
    except FileNotFoundError:
        raise CheckpointError(f"{folder} has no {MANIFEST_NAME}: not written by sdcguard after a passing check") from None
    except ValueError as exc:
        raise CheckpointError(f"{folder / MANIFEST_NAME} is not valid JSON: {exc}") from None
    if not isinstance(manifest, dict) or manifest.get("schema") != SCHEMA or manifest.get("verified") is not True:
        raise CheckpointError(f"{folder / MANIFEST_NAME} does not record a verified checkpoint")
    missing = [k for k in ("step", "sha256", "files", "weight_digest", "parameters") if k not in manifest]
    if missing:
        raise CheckpointError(f"{folder / MANIFEST_NAME} lacks {', '.join(map(repr, missing))}")
    if expect_step is not None and int(manifest["step"]) != int(expect_step):
        raise CheckpointError(f"{folder} holds step {manifest['step']}, not step {expect_step}")
    if expect_sha256 is not None and manifest["sha256"] != expect_sha256.strip().lower():
        raise CheckpointError(f"{folder} is not the checkpoint the alarm named: "
                              f"sha256 {manifest['sha256']} != {expect_sha256}")
    # model.safetensors is read once: the weights checked below are the very bytes hashed here.
    weights = folder / WEIGHTS_FILE
    data = weights.read_bytes() if weights.is_file() and not weights.is_symlink() else None
    found = hash_folder(folder, skip=frozenset({WEIGHTS_FILE}) if data is not None else frozenset())
    if data is not None:
        found[WEIGHTS_FILE] = hashlib.sha256(data).hexdigest()
    problems = [f"{n}: {'missing' if n not in found else 'modified'}" for n in sorted(manifest["files"])
                if found.get(n) != manifest["files"][n]]
    problems += [f"{n}: not in the manifest" for n in sorted(set(found) - set(manifest["files"]))]
    if problems:
        raise CheckpointError(f"{folder} differs from its manifest: {'; '.join(problems)}")
    if identity(found) != manifest["sha256"]:
        raise CheckpointError(f"{folder}: its file list does not hash to the manifest's sha256")
    digest = weights_digest(folder, manifest["parameters"], data=data)
    if digest != manifest["weight_digest"]:
        raise CheckpointError(f"{folder / WEIGHTS_FILE}: weight digest {digest}, manifest {manifest['weight_digest']}")
    return manifest


def weights_digest(folder: Path, names: list[str], *, data: bytes | None = None) -> str:
    """Check 3's digest of the parameters ``names`` as ``folder/model.safetensors`` holds them
    (``data``: that file's bytes, already read and hashed: they are parsed, the file is not reopened)."""
    from safetensors.torch import load, load_file
    weights = folder / WEIGHTS_FILE
    if data is not None:
        return state_digest({"model": load(data)}, "model", names, where=str(weights))
    if not weights.is_file():
        raise CheckpointError(f"{weights} is missing (save_safetensors=False is not supported)")
    return state_digest({"model": load_file(weights)}, "model", names, where=str(weights))


def hash_folder(folder: Path, *, skip: frozenset[str] = frozenset()) -> dict[str, str]:
    """relative path -> SHA-256 of every file under ``folder`` but the manifest (and ``skip``:
    relative paths the caller hashes itself)."""
    return {rel: sha256_file(p) for p in sorted(folder.rglob("*"))
            if p.is_file() and p.name != MANIFEST_NAME and (rel := p.relative_to(folder).as_posix()) not in skip}
