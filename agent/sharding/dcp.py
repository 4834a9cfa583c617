"""Checkpoints of a sharded (FSDP2) model: ``torch.distributed.checkpoint`` directories that are
written only after check 3 passed, carry a manifest, and are verified when loaded (docs/design.md
§3, Sharded models; the manifest's format is in ``dcp_manifest``).

Save (every rank calls; the Guard has run check 3 first): rank 0 prepares a staging directory
beside ``path``; every rank writes its shards of the model and optimizer state
(``get_state_dict``), with the step and your extra entries, through DCP; each rank hashes its own
files and fingerprints its local shards; rank 0 hashes ``.metadata``, writes the manifest into the
staging directory, and only then puts it in place: the directory ``path`` held before is renamed
to its kept name when a later alarm may still name it (``recovery.plan_save``; the same rules as a
DDP file), or removed. A reader sees the old checkpoint, then the new one, never a mix.

Load (every rank calls): rank 0 reads the manifest and checks the step and identity an alarm named
and the directory's file list; every file's SHA-256 is checked (the files shared out over the
ranks) before DCP opens any; DCP loads; each rank's local shards must then have the fingerprint
the manifest records for its shard. Any failure raises CheckpointError on every rank.
"""
from __future__ import annotations

import json
import logging
import os
import shutil
from contextlib import AbstractContextManager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Mapping

import torch
import torch.distributed as dist
from torch.distributed.checkpoint import FileSystemWriter
from torch.distributed.checkpoint import load as dcp_load
from torch.distributed.checkpoint import save as dcp_save
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.checkpoint.stateful import Stateful

from .. import recovery
from .. import manifest as manifest_codec
from ..checkpoint import CheckpointError
from ..checks.exchange import broadcast_json, gather_objects
from ..contract.alarm import now_rfc3339
from ..contract.spool import fsync_dir, write_json_atomic
from . import dcp_manifest
from .dcp_manifest import MANIFEST_NAME, WeightsOnlyLoadPlanner
from .layout import ShardLayout
from .shard_weights import fingerprint_shards

log = logging.getLogger("sdcguard")

STEP_KEY = "sdcguard"
"""The entry of the DCP state that holds sdcguard's own record (``{"step": N}``)."""
OPTIMIZER_KEY = "optimizer"
SCALER_KEY = "scaler"

ZeroStep = Callable[[], AbstractContextManager[Any]]
"""Lets DCP's optimizer-state initialisation (one step at lr 0 on zero gradients, inside
``get_state_dict`` of an optimizer without state) through the update gate."""


@dataclass(frozen=True, slots=True)
class Facts:
    """What a sharded checkpoint records, as the Guard knows it when check 3 has just passed."""

    step: int
    """The last step whose update the saved weights include."""
    history: recovery.History
    layout: ShardLayout
    weights_verified: bool
    """Check 3 compared every shard across its replicas (HSDP); False with one replica."""
    weight_digest: str | None
    """This rank's check-3 digest of its shards (HSDP), which the saved shards must have."""
    parameters: list[str]
    """The parameter names, in the order of their shards' fingerprints."""
    run_id: str


def save(path: str | os.PathLike[str], *, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
         scaler: Any, model_key: str, named_parameters: list[tuple[str, torch.nn.Parameter]],
         extra: Mapping[str, Any], facts: Facts, keep: bool, device: torch.device,
         zero_step: ZeroStep) -> recovery.History:
    """Write the checkpoint directory ``path`` (collective: every rank calls, in the same order);
    return the history with the new entry. Raises CheckpointError on every rank when it was not
    written (``path`` then still holds what it held)."""
    _check_extra(extra, model_key)
    path = Path(path)
    rank = dist.get_rank()
    staging = path.with_name(f".{path.name}.sdcguard-tmp")
    plan = recovery.plan_save(facts.history, str(path), facts.step, keep=keep)
    ready = None
    if rank == 0:
        try:
            _prepare(path, staging)
        except Exception as exc:  # noqa: BLE001 - every rank learns it below
            ready = f"{type(exc).__name__}: {exc}"
    ready = broadcast_json({"failure": ready} if rank == 0 else None, 0, device, None)["failure"]
    if ready is not None:
        raise CheckpointError(f"checkpoint {path} was not written: {ready}")
    with zero_step():
        model_state, optim_state = get_state_dict(model, optimizer)
    state = {model_key: model_state, OPTIMIZER_KEY: optim_state, STEP_KEY: {"step": facts.step}, **extra}
    if scaler is not None:
        state[SCALER_KEY] = scaler
    try:
        dcp_save(state, storage_writer=FileSystemWriter(str(staging)))
    except Exception as exc:  # noqa: BLE001 - DCP raises the same error on every rank
        if rank == 0:
            shutil.rmtree(staging, ignore_errors=True)
        raise CheckpointError(f"checkpoint {path} was not written: DCP failed: {exc}") from None
    reports = gather_objects(_report(staging, rank, named_parameters, facts), None, device)
    outcome: dict[str, Any] = {"failure": None, "sha256": None, "kept": None}
    if rank == 0:
        try:
            outcome["sha256"], outcome["kept"] = _finish(path, staging, reports, facts, plan, model_key, list(state))
        except Exception as exc:  # noqa: BLE001 - every rank learns it below
            outcome["failure"] = f"{type(exc).__name__}: {exc}"
            shutil.rmtree(staging, ignore_errors=True)
    outcome = broadcast_json(outcome if rank == 0 else None, 0, device, None)
    if outcome["failure"] is not None:
        raise CheckpointError(f"checkpoint {path} was not written: {outcome['failure']}")
    saved = recovery.Checkpoint(facts.step, str(path), facts.history.last_audited_step, outcome["sha256"],
                                cross_checked=facts.weights_verified)
    if rank == 0:
        recovery.log_plan(plan, outcome["kept"], saved)
    return recovery.after_save(facts.history, plan, saved, outcome["kept"])


def load(path: str | os.PathLike[str], *, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
         scaler: Any, model_key: str, named_parameters: list[tuple[str, torch.nn.Parameter]],
         extra: dict[str, Any], layout: ShardLayout, device: torch.device, zero_step: ZeroStep,
         expect_step: int | None = None, expect_sha256: str | None = None) -> tuple[dict[str, Any], str]:
    """Verify and load the checkpoint directory ``path`` (collective); return its manifest and
    this rank's fingerprint digest of the loaded shards. ``extra``: the entries you saved besides
    the model and optimizer, loaded in place (a ``Stateful`` value through its ``load_state_dict``).
    Raises CheckpointError on every rank; the model is not touched when a file or the manifest
    is wrong, and must not be used when the loaded shards are."""
    _check_extra(extra, model_key)
    path = Path(path)
    rank, world = dist.get_rank(), dist.get_world_size()
    told: dict[str, Any] | None = None
    if rank == 0:
        try:
            manifest = dcp_manifest.read(path, expect_step=expect_step, expect_sha256=expect_sha256)
            listing = dcp_manifest.judge_files(manifest, {}, dcp_manifest.listed(path))
            told = {"manifest": manifest, "failure": "; ".join(listing) or None}
        except Exception as exc:  # noqa: BLE001 - every rank learns it below
            told = {"manifest": None, "failure": str(exc) if isinstance(exc, CheckpointError)
                    else f"{type(exc).__name__}: {exc}"}
    told = broadcast_json(told, 0, device, None)
    if told["failure"] is not None:
        raise CheckpointError(f"{path}: {told['failure']}" if told["manifest"] is not None else told["failure"])
    manifest = told["manifest"]
    _same_model(path, manifest, layout, model_key, [n for n, _ in named_parameters])
    mine = sorted(manifest["files"])[rank::world]  # every file hashed once, shared out over the ranks
    try:
        mine_judged: str | list[str] = dcp_manifest.judge_files(manifest, dcp_manifest.hash_files(path, mine))
    except OSError as exc:  # this rank cannot read its share (EIO, EACCES): said, not left alone with it
        mine_judged = f"rank {rank} could not read its files: {type(exc).__name__}: {exc}"
    problems = _everyone(mine_judged, device)
    if problems:
        raise CheckpointError(f"{path} was not loaded: " + "; ".join(problems))
    with zero_step():  # DCP loads into the optimizer's state, which must exist first
        model_state, optim_state = get_state_dict(model, optimizer)
    state: dict[str, Any] = {model_key: model_state, OPTIMIZER_KEY: optim_state, STEP_KEY: {"step": -1}, **extra}
    if scaler is not None:
        state[SCALER_KEY] = scaler
    try:
        # .metadata through sdcguard's reader: the bytes hashed are the bytes unpickled, with a
        # restricted unpickler (DCP's own reader would pickle.load whatever the file holds)
        reader = dcp_manifest.MetadataReader(str(path), manifest["files"][".metadata"])
        dcp_load(state, storage_reader=reader, planner=WeightsOnlyLoadPlanner())
    except Exception as exc:  # noqa: BLE001 - DCP raises the same error on every rank
        raise CheckpointError(f"{path} cannot be loaded: {exc}") from None
    set_state_dict(model, optimizer, model_state_dict=state[model_key], optim_state_dict=state[OPTIMIZER_KEY])
    for key, value in extra.items():
        if not isinstance(value, Stateful):
            extra[key] = state[key]  # DCP replaces a plain value in the dict it was given
    found = fingerprint_shards(named_parameters).digest.hex()
    where = layout.coordinates(rank)
    wrong = dcp_manifest.judge_shard(manifest, dcp_manifest.position(where, layout.shards), found)
    if state[STEP_KEY].get("step") != manifest["step"]:
        wrong = f"its files hold step {state[STEP_KEY].get('step')}, its manifest says {manifest['step']}"
    problems = _everyone(None if wrong is None else f"rank {rank} (replica {where['replica']}, shard {where['shard']}): "
                         f"{wrong}", device)
    if problems:
        raise CheckpointError(f"{path}: the loaded weights are not those fingerprinted at the save "
                              "(do not train on from them): " + "; ".join(problems))
    return manifest, found


# -- rank 0's part of a save ----------------------------------------------------------------------

def _prepare(path: Path, staging: Path) -> None:
    """Refuse to replace anything but an sdcguard checkpoint (or an empty directory); make a fresh
    staging directory."""
    if path.is_symlink() or (path.exists() and not path.is_dir()):
        raise CheckpointError(f"{path} exists and is not a directory (a sharded checkpoint is a directory)")
    if path.is_dir() and (names := dcp_manifest.listed(path)):
        try:
            manifest = dcp_manifest.read(path)
        except CheckpointError:
            raise CheckpointError(f"refusing to replace {path}: it holds files and no sdcguard manifest") from None
        if foreign := sorted(set(names) - set(manifest["files"])):
            raise CheckpointError(f"refusing to replace {path}: it holds files sdcguard did not write: {foreign[:5]}")
    if staging.exists():
        shutil.rmtree(staging)  # an earlier save that did not finish
    staging.mkdir(parents=True)


def _report(staging: Path, rank: int, named_parameters: list[tuple[str, torch.nn.Parameter]],
            facts: Facts) -> dict[str, Any]:
    """This rank's part of the manifest: the SHA-256 of the files it wrote (DCP names them
    ``__<rank>_<n>.distcp``), its shards' fingerprint digest and where each shard lies."""
    prefix = f"__{rank}_"
    failure = None
    try:
        files = {p.name: dcp_manifest.sha256_file(p) for p in sorted(staging.iterdir()) if p.name.startswith(prefix)}
    except OSError as exc:  # told to rank 0, which fails the save on every rank
        files, failure = {}, f"rank {rank} could not read its files: {exc}"
    digest = fingerprint_shards(named_parameters).digest.hex()
    if facts.weight_digest is not None and digest != facts.weight_digest:
        failure = f"rank {rank}'s shards changed between check 3 and the save"
    return {"files": files, "digest": digest, "failure": failure,
            "chunks": [dcp_manifest.chunk_of(p) for _, p in named_parameters]}


def _finish(path: Path, staging: Path, reports: list[dict[str, Any]], facts: Facts, plan: recovery.SavePlan,
            model_key: str, state_keys: list[str]) -> tuple[str, str | None]:
    """Hash what no rank reported, write the manifest, put the directory in place; return its
    identity and where the directory it replaced was kept (None: not kept)."""
    failures = [r["failure"] for r in reports if r["failure"]]
    if failures:
        raise CheckpointError("; ".join(failures))
    files = {name: sha for r in reports for name, sha in r["files"].items()}
    present = dcp_manifest.listed(staging)
    for name in present:
        if name not in files:
            files[name] = dcp_manifest.sha256_file(staging / name)  # .metadata, rank 0's own
    if ".metadata" not in files or set(files) != set(present):
        raise CheckpointError(f"DCP left an unexpected file set in {staging}: {sorted(present)}")
    kept = keep_directory(plan.keep) if plan.keep is not None else None
    history = facts.history
    recorded = {**manifest_codec.verification_fields(history, facts.step, str(path), plan, kept),
                "verified_at": now_rfc3339(), "run_id": facts.run_id, "torch": torch.__version__}
    manifest = dcp_manifest.build(
        step=facts.step, files=files, grid=facts.layout.grid, weights_verified=facts.weights_verified,
        model_key=model_key, state_keys=[k for k in state_keys if k != model_key],
        parameters=facts.parameters, reports=reports, recorded=recorded,
        columns=facts.layout.columns or None)
    try:
        write_json_atomic(staging / MANIFEST_NAME, json.dumps(manifest, indent=2, sort_keys=True))
        _put_in_place(staging, path)
    except OSError:
        if kept is not None and not path.exists():
            os.rename(kept, path)  # the save failed: the path holds what it held
        raise
    _remove(plan.remove, path.parent)
    return manifest["sha256"], kept


def keep_directory(entry: recovery.Checkpoint) -> str | None:
    """Move the directory of ``entry`` (its path is about to be written again, or removed by a
    framework's rotation) to its kept name; return that name, or None when the path no longer
    holds the entry."""
    source = Path(entry.path)
    try:
        dcp_manifest.read(source, expect_step=entry.step, expect_sha256=entry.sha256)
    except CheckpointError:
        log.warning("sdcguard: %s no longer holds the checkpoint of step %d; nothing to keep", source, entry.step)
        return None
    target = Path(recovery.kept_path(str(source), entry.step))
    if target.exists():
        if not dcp_manifest.is_sharded_checkpoint(target):
            raise CheckpointError(f"cannot keep {source} as {target}: that path holds something else")
        shutil.rmtree(target)  # an earlier run's kept copy of the same step
    os.rename(source, target)  # the whole directory, its manifest included: nothing is copied
    recovery.remember_kept(str(target))
    return str(target)


def _put_in_place(staging: Path, path: Path) -> None:
    old = path.with_name(f".{path.name}.sdcguard-old")
    if old.exists():
        shutil.rmtree(old)
    if path.exists():
        os.rename(path, old)
    os.rename(staging, path)
    fsync_dir(path.parent)
    shutil.rmtree(old, ignore_errors=True)


def _remove(paths: tuple[str, ...], directory: Path) -> None:
    """Remove kept directories below the floor: only those ``recovery.removable`` allows (kept names
    in the checkpoint's own directory, or kept by this run) that hold a sharded checkpoint; never
    another path a manifest names."""
    for victim in map(Path, recovery.removable(paths, str(directory))):
        if dcp_manifest.is_sharded_checkpoint(victim):
            shutil.rmtree(victim)


# -- helpers ----------------------------------------------------------------------------------------

def _check_extra(extra: Mapping[str, Any], model_key: str) -> None:
    reserved = sorted({model_key, OPTIMIZER_KEY, STEP_KEY, SCALER_KEY} & set(extra))
    if reserved:
        raise CheckpointError(f"state= may not hold {reserved}: for a sharded model sdcguard saves the model, "
                              "optimizer, scaler and step itself; state= holds your extra entries")


def _same_model(path: Path, manifest: Mapping[str, Any], layout: ShardLayout, model_key: str,
                names: list[str]) -> None:
    """The checkpoint's shards are verified as they were saved: the same mesh, the same parameters."""
    grid = [list(row) for row in layout.grid]
    columns = [[list(row) for row in column] for column in layout.columns] or None
    # with tensor parallelism the grid recorded is rank 0's column: the columns say it all
    if (manifest["mesh"].get("columns") != columns) or (columns is None and manifest["mesh"]["grid"] != grid):
        saved = manifest["mesh"].get("columns") or manifest["mesh"]["grid"]
        raise CheckpointError(f"{path} was saved on the mesh {saved}, this run has {columns or grid}: "
                              "sdcguard verifies a sharded checkpoint's shards on the mesh it was saved on")
    if manifest["model_key"] != model_key:
        raise CheckpointError(f"{path} holds its model under {manifest['model_key']!r}, not {model_key!r}")
    if manifest["parameters"] != names:
        raise CheckpointError(f"{path} holds other parameters than this model's "
                              f"({len(manifest['parameters'])} saved, {len(names)} here)")


def _everyone(problem: str | list[str] | None, device: torch.device) -> list[str]:
    """Every rank's problems, on every rank (one small all-gather)."""
    said = gather_objects(problem, None, device)
    return [p for part in said for p in (part if isinstance(part, list) else [part]) if p]


