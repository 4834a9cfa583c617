"""Checkpoints you can trust: written only after check 3 passes, verified when loaded.

``save_checkpoint`` is collective: rank 0 decides whether to save (its ``when``), every rank runs
check 3, and rank 0 writes *your* state dict as it is (flat keys, e.g. nanoGPT's ``model``,
``optimizer``, ``model_args``, ``iter_num``) and, beside it, a manifest ``<path>.sdcguard.json``:
the step, the weight digest it was verified at, the parameter names that digest covers, the
file's SHA-256, and the last audited step the checkpoint is covered by (``recovery``).
``load_checkpoint`` (``weights_only=True`` by default) and ``verify_checkpoint`` (no process group,
no model: what ``sdcguard verify-checkpoint`` runs) refuse a file whose bytes or weights do not
match its manifest.
"""
from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Mapping

import torch
import torch.distributed as dist

from .checks.weights import fingerprint_weights
from .contract.alarm import now_rfc3339
from .contract.spool import write_json_atomic
from .fingerprint import digest, fingerprint_many
from .recovery import Checkpoint

if TYPE_CHECKING:
    from .guard import Guard

MANIFEST_SCHEMA = "sdcguard.dev/checkpoint/v1"
# Checkpoints before it that a manifest lists (a window rarely reaches further back).
EARLIER_CHECKPOINTS = 16
# Prefixes torch.compile and DDP put in front of a module's state-dict keys.
_WRAPPER_PREFIXES = ("_orig_mod.", "module.")


class CheckpointError(RuntimeError):
    """A checkpoint that must not be written or must not be trusted; the message says why."""


def manifest_path(path: str | os.PathLike[str]) -> Path:
    return Path(f"{os.fspath(path)}.sdcguard.json")


def save_checkpoint(guard: Guard, path: str | os.PathLike[str], step: int, state: Mapping[str, Any] | None = None,
                    *, when: bool = True, model_key: str = "model") -> Path | None:
    """Collective: rank 0's ``when`` decides; check 3; then rank 0 writes checkpoint + manifest."""
    if not _rank0_says(bool(when), guard):
        return None
    if guard.alarms_raised:
        raise CheckpointError(
            f"refusing to write {path}: this run raised {guard.alarms_raised} alarm(s) and its state "
            "is suspect; resume from the last good checkpoint instead")
    guard.check_weights(step)  # raises SDCDetected on every rank when a replica differs
    path = Path(path)
    if state is None:
        state = {"step": step, model_key: guard.module.state_dict(), "optimizer": guard.optimizer.state_dict(),
                 "scaler": guard.scaler.state_dict() if guard.scaler is not None else None}
    names = [n for n, _ in guard.named_parameters]
    history = guard.history
    failure = None
    if guard.topology.rank == 0:
        try:
            _write(guard, path, step, state, model_key, names)
        except (CheckpointError, OSError) as exc:
            failure = f"{type(exc).__name__}: {exc}"
    if not guard.solo:  # every rank learns whether rank 0 wrote it (and waits until it has)
        said = [failure]
        dist.broadcast_object_list(said, src=_global_rank0(guard), group=guard.group)
        failure = said[0]
    if failure is not None:
        raise CheckpointError(f"checkpoint {path} was not written: {failure}")
    history.checkpoints.append(Checkpoint(step, str(path), history.last_audited_step))
    return path


def _write(guard: Guard, path: Path, step: int, state: Mapping[str, Any], model_key: str, names: list[str]) -> None:
    saved_digest = _state_digest(state, model_key, names, where=str(path))
    if saved_digest != guard.last_weights_digest:
        raise CheckpointError(f"state[{model_key!r}] does not hold the weights check 3 just verified "
                              "(pass the model's own state_dict)")
    _save_atomic(dict(state), path)
    history = guard.history
    write_json_atomic(manifest_path(path), json.dumps({
        "schema": MANIFEST_SCHEMA, "step": step, "verified": True,
        "weight_digest": guard.last_weights_digest, "sha256": _sha256(path),
        "model_key": model_key, "parameters": names,
        "audited_step": history.last_audited_step,
        "audited": history.last_audited_step == step,
        "reduction_verified_step": history.last_reduction_verified_step,
        # What a run resumed from this file must know to name a checkpoint before a window that
        # reaches back past it.
        "earlier_checkpoints": [{"step": c.step, "path": c.path, "audited_step": c.audited_step}
                                for c in history.checkpoints[-EARLIER_CHECKPOINTS:] if c.step < step],
        "replicas": guard.topology.world_size,
        "verified_at": now_rfc3339(), "run_id": guard.topology.run_id,
    }, indent=2, sort_keys=True))


def load_checkpoint(path: str | os.PathLike[str], model: torch.nn.Module,
                    optimizer: torch.optim.Optimizer | None = None,
                    scaler: torch.amp.GradScaler | None = None,
                    map_location: Any = "cpu", *, model_key: str | None = None,
                    weights_only: bool = True) -> dict[str, Any]:
    """Load a checkpoint written by :func:`save_checkpoint` after verifying it; return its state.

    ``model`` is the bare module (the DDP / torch.compile prefixes of the saved keys are removed).
    Raises CheckpointError on any mismatch and leaves the model untouched when the file is wrong."""
    path = Path(path)
    manifest = read_manifest(path)
    state = _verified_state(path, manifest, map_location, weights_only)
    key = model_key or manifest.get("model_key", "model")
    model.load_state_dict(_strip_prefixes(state[key]))
    loaded = fingerprint_weights(list(model.named_parameters())).digest.hex()
    if loaded != manifest["weight_digest"]:
        raise CheckpointError(f"{path}: loaded weights have digest {loaded}, manifest says {manifest['weight_digest']}")
    if optimizer is not None and state.get("optimizer") is not None:
        optimizer.load_state_dict(state["optimizer"])
    if scaler is not None and state.get("scaler") is not None:
        scaler.load_state_dict(state["scaler"])
    return state


@dataclass(frozen=True, slots=True)
class Verification:
    path: str
    step: int
    audited_step: int | None
    audited: bool
    weight_digest: str
    parameters: int


def verify_checkpoint(path: str | os.PathLike[str]) -> Verification:
    """Check a checkpoint file against its manifest without a model or a process group: its
    SHA-256, its step, and the digest of the parameters it holds. Raises CheckpointError."""
    path = Path(path)
    manifest = read_manifest(path)
    if "parameters" not in manifest:
        raise CheckpointError(f"manifest {manifest_path(path)} predates parameter lists: load it into the model "
                              "with sdcguard.load_checkpoint to verify its weights")
    state = _verified_state(path, manifest, "cpu", True)
    found = _state_digest(state, manifest.get("model_key", "model"), manifest["parameters"], where=str(path))
    if found != manifest["weight_digest"]:
        raise CheckpointError(f"{path}: its weights have digest {found}, manifest says {manifest['weight_digest']}")
    return Verification(str(path), int(manifest["step"]), manifest.get("audited_step"), bool(manifest.get("audited")),
                        manifest["weight_digest"], len(manifest["parameters"]))


def read_manifest(path: str | os.PathLike[str]) -> dict[str, Any]:
    where = manifest_path(path)
    try:
        manifest = json.loads(where.read_text())
    except FileNotFoundError:
        raise CheckpointError(f"{path} has no manifest {where.name}: it was not written by sdcguard after a passing check") from None
    except ValueError as exc:
        raise CheckpointError(f"manifest {where} is not valid JSON: {exc}") from None
    if not isinstance(manifest, dict) or manifest.get("schema") != MANIFEST_SCHEMA or manifest.get("verified") is not True:
        raise CheckpointError(f"manifest {where} does not record a verified checkpoint")
    for key in ("step", "weight_digest", "sha256"):
        if key not in manifest:
            raise CheckpointError(f"manifest {where} lacks {key!r}")
    return manifest


def _verified_state(path: Path, manifest: dict[str, Any], map_location: Any, weights_only: bool) -> dict[str, Any]:
    actual = _sha256(path)
    if actual != manifest["sha256"]:
        raise CheckpointError(f"{path} was modified after it was verified: sha256 {actual} != manifest {manifest['sha256']}")
    try:
        state = torch.load(path, map_location=map_location, weights_only=weights_only)
    except Exception as exc:  # noqa: BLE001 - torch raises many kinds for a file it cannot read
        raise CheckpointError(f"{path} cannot be loaded: {exc}") from None
    if not isinstance(state, dict):
        raise CheckpointError(f"{path} does not hold a state dict")
    if "step" in state and state["step"] != manifest["step"]:
        raise CheckpointError(f"{path} holds step {state['step']} but its manifest says {manifest['step']}")
    return state


def _state_digest(state: Mapping[str, Any], model_key: str, names: list[str], where: str) -> str:
    """The weight digest (check 3's) of the parameters ``names`` in ``state[model_key]``."""
    if model_key not in state or not isinstance(state[model_key], Mapping):
        raise CheckpointError(f"{where}: the checkpoint state has no model state dict under {model_key!r}")
    tensors = _strip_prefixes(state[model_key])
    missing = [n for n in names if n not in tensors]
    if missing:
        raise CheckpointError(f"{where}: state[{model_key!r}] lacks parameters {missing[:5]}"
                              + (f" and {len(missing) - 5} more" if len(missing) > 5 else ""))
    return digest(fingerprint_many(tensors[n] for n in names)).hex()


def _strip_prefixes(model_state: Mapping[str, Any]) -> dict[str, Any]:
    out = {}
    for key, value in model_state.items():
        while key.startswith(_WRAPPER_PREFIXES):
            key = key.split(".", 1)[1]
        out[key] = value
    return out


def _rank0_says(when: bool, guard: Guard) -> bool:
    if guard.solo:
        return when
    flag = torch.tensor([1 if when else 0], dtype=torch.int64, device=guard.device)
    dist.broadcast(flag, src=_global_rank0(guard), group=guard.group)
    return bool(flag.item())


def _global_rank0(guard: Guard) -> int:
    return 0 if guard.group is None else dist.get_global_rank(guard.group, 0)


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
