"""A pipeline's checkpoint: a directory holding one file per pipeline position and one manifest.

    ckpt/                       the path given to save_checkpoint (one per save, or written again)
      stage-0.pt                position 0's stages (model and optimizer; FSDP2 stages' full state,
      stage-0.pt.manifest.json  gathered), written by its first replica, with the manifest every
                                file checkpoint has (checkpoint.py)
      stage-1.pt ...
      pipeline.json             the step, every position's file and SHA-256, what verified it

The checkpoint's identity (what an alarm names as ``last_good_checkpoint_sha256``) is the SHA-256
of ``pipeline.json``, which lists every stage file's: one number covers the whole pipeline. A load
verifies it, then each rank its own position's file (its bytes and the weights it loads); a failure
on any rank is raised on every rank.
"""
from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import os
import shutil
from pathlib import Path
from typing import Any, Callable, Mapping

import torch
import torch.distributed as dist

from .. import checkpoint, recovery
from .. import manifest as manifest_codec
from ..checks.exchange import DIGEST_BYTES, agree, gather_objects
from ..checks.pipeline import Grid
from ..checks.topology import Topology
from ..contract.alarm import now_rfc3339
from ..contract.spool import write_json_atomic
from .pipeline_stages import StageReplicas

MANIFEST = "pipeline.json"
SCHEMA = "sdcguard.pipeline-checkpoint/1"


def stage_file(position: int) -> str:
    return f"stage-{position}.pt"


class PipelineStore:
    """The :class:`~sdcguard.layouts.base.CheckpointStore` of a pipeline (see the module docstring)."""

    def __init__(self, *, module: torch.nn.Module, optimizer: torch.optim.Optimizer,
                 named_parameters: list[tuple[str, torch.nn.Parameter]], grid: Grid, topology: Topology,
                 device: torch.device, replicas: StageReplicas, group: dist.ProcessGroup,
                 zero_update: Callable[[], contextlib.AbstractContextManager[None]], on_load: Callable[[], None]) -> None:
        """``group``: the ranks of this rank's pipeline position (they write one file together)."""
        self.module, self.optimizer = module, optimizer
        self.on_load = on_load
        """Told when a checkpoint was loaded (the layout's first step then reduces regularly)."""
        self.named_parameters = named_parameters
        self.grid, self.topology, self.device, self.group = grid, topology, device, group
        self.replicas = replicas
        self.zero_update = zero_update
        """A context in which the optimizer steps nothing (DCP's state-dict API creates missing state so)."""
        self.replica, self.position = grid.at[topology.rank]

    def save(self, path: str, *, step: int, state: dict[str, Any] | None, model_key: str,
             history: recovery.History, weight_digest: str | None, keep: bool) -> recovery.History:
        if state is not None:
            raise TypeError("sdcguard: a pipeline checkpoint holds each stage's model and optimizer; "
                            "save_checkpoint(state=) is not taken (save your scheduler's state beside it)")
        plan = recovery.plan_save(history, path, step, keep=keep)
        me = self.topology.rank
        kept, moved = None, None
        if me == 0 and plan.keep is not None:
            try:
                kept = _keep_directory(plan.keep)
            except OSError as exc:
                moved = f"keeping {plan.keep.path}: {type(exc).__name__}: {exc}"
        kept, moved = gather_objects([kept, moved], None, self.device)[0]  # every rank waits for rank 0
        if moved is not None:
            raise checkpoint.CheckpointError(f"pipeline checkpoint {path} was not written: {moved}")
        names = self.replicas.state_names([n for n, _ in self.named_parameters])
        failure, sha, digest, mine = None, None, None, {}
        try:
            with self.zero_update():
                model_state, optimizer_state = self.replicas.state(self.module, self.optimizer)  # FSDP2: collective per stage
            mine = {"step": step, model_key: model_state, "optimizer": optimizer_state, "scaler": None}
            digest = self.replicas.file_digest(weight_digest, mine, model_key, names)
        except Exception as exc:  # noqa: BLE001 - every rank learns it below, none is left waiting
            failure = f"{type(exc).__name__}: {exc}"
        # The position's ranks agree that each holds the state, and the same weights (FSDP2 gathered
        # them on every rank: one bad gather is not written as verified) before the first writes.
        if not agree(bytes.fromhex(digest)[:DIGEST_BYTES] if digest else bytes(DIGEST_BYTES), self.device,
                     self.group, veto=failure is not None):
            failure = failure or "the position's ranks hold different weights for its stages (a gather differed)"
        else:
            try:  # collective within the position's ranks: the first of them writes
                facts = checkpoint.Facts(
                    step=step, weight_digest=digest, parameters=names, model_key=model_key,
                    history=dataclasses.replace(history, checkpoints=[]), replicas=self.grid.replicas,
                    run_id=self.topology.run_id)
                written = checkpoint.save(os.path.join(path, stage_file(self.position)), mine, facts, keep=False,
                                          writer=dist.get_rank(self.group) == 0, device=self.device,
                                          group=self.group)
                sha = written.checkpoints[-1].sha256
            except Exception as exc:  # noqa: BLE001 - every rank learns it below, none is left waiting
                failure = f"{type(exc).__name__}: {exc}"
        said = gather_objects([self.position, sha, failure], None, self.device)
        failures = sorted({f for _, _, f in said if f})
        if failures:
            raise checkpoint.CheckpointError(f"pipeline checkpoint {path} was not written: {failures[0]}")
        stages = {str(p): {"file": stage_file(p), "sha256": s} for p, s, _ in said}
        top, failure, failed = None, None, None
        if me == 0:
            try:
                write_json_atomic(Path(path) / MANIFEST, json.dumps({
                    "schema": SCHEMA, "step": step, "verified": True, "stages": stages,
                    "weights_verified": self.replicas.weights_group is not None, "replication": self.replicas.kind,
                    "positions": self.grid.positions, "replicas": self.grid.replicas,
                    "num_stages": self.grid.num_stages, "model_key": model_key,
                    **manifest_codec.verification_fields(history, step, str(path), plan, kept),
                    "verified_at": now_rfc3339(), "run_id": self.topology.run_id,
                }, indent=2, sort_keys=True))
                top = manifest_codec.sha256_file(Path(path) / MANIFEST)
            except Exception as exc:  # noqa: BLE001 - every rank learns it below, none is left waiting
                failed, failure = exc, f"{type(exc).__name__}: {exc}"
            else:
                for victim in recovery.removable(plan.remove, str(Path(path).parent)):
                    shutil.rmtree(victim, ignore_errors=True)
        top, failure = gather_objects([top, failure], None, self.device)[0]
        if failure:
            raise checkpoint.CheckpointError(f"pipeline checkpoint {path} was not written: manifest: {failure}") from failed
        # pure FSDP over the stages: check 3 never compared these weights, so no alarm names them
        saved = recovery.Checkpoint(step, str(path), history.last_audited_step, top,
                                    cross_checked=self.replicas.weights_group is not None)
        if me == 0:
            recovery.log_plan(plan, kept, saved)
        return recovery.after_save(history, plan, saved, kept)

    def load(self, path: str, *, model_key: str, expect_step: int | None, expect_sha256: str | None,
             state: dict[str, Any] | None) -> tuple[int, recovery.History, str | None]:
        if state is not None:
            raise TypeError("sdcguard: load_checkpoint(state=) is for sharded models")
        failure, manifest, digest = None, None, None
        try:
            manifest = read_manifest(path, expect_step=expect_step, expect_sha256=expect_sha256)
            if (manifest["positions"], manifest["replicas"]) != (self.grid.positions, self.grid.replicas):
                raise checkpoint.CheckpointError(
                    f"{path} holds a pipeline of {manifest['positions']} positions x {manifest['replicas']} replicas, "
                    f"this job is {self.grid.positions} x {self.grid.replicas}")
            if manifest.get("replication", "DDP") != self.replicas.kind:
                raise checkpoint.CheckpointError(f"{path} holds {manifest.get('replication', 'DDP')} stages, this "
                                                 f"job's are {self.replicas.kind}")
            entry = manifest["stages"][str(self.position)]
            first = next(self.module.parameters(), None)
            state, file_manifest = checkpoint.read_verified_state(
                Path(path) / entry["file"], map_location=first.device if first is not None else "cpu",
                expect_step=int(manifest["step"]), expect_sha256=entry["sha256"])
            digest = file_manifest["weight_digest"]
        except (checkpoint.CheckpointError, KeyError, OSError, ValueError) as exc:
            failure = f"{type(exc).__name__}: {exc}"
        failures = sorted({f for f in gather_objects(failure, None, self.device) if f})
        if not failures:  # every file is good: load (collective per stage with FSDP2)
            try:
                with self.zero_update():
                    self.replicas.load_state(self.module, self.optimizer, state[model_key], state["optimizer"])
                digest = self.replicas.loaded_digest(digest, self.module, self.named_parameters, model_key)
            except Exception as exc:  # noqa: BLE001 - every rank learns it below (a load within a stage's mesh is collective)
                failure = f"{type(exc).__name__}: {exc}"
        failures = sorted({f for f in gather_objects(failure, None, self.device) if f})
        if failures:  # on every rank alike: one position's bad file stops the whole pipeline
            raise checkpoint.CheckpointError(f"pipeline checkpoint {path} refused: {failures[0]}")
        self.on_load()
        return int(manifest["step"]), manifest_codec.resumed_history(path, manifest), digest


def read_manifest(path: str | os.PathLike[str], *, expect_step: int | None = None,
                           expect_sha256: str | None = None) -> dict[str, Any]:
    """``pipeline.json`` of ``path``, checked against what an alarm named (its SHA-256 and step), read
    once so that the bytes hashed are the bytes parsed, and checked for form
    (:func:`manifest_problems`) before any stage file is opened."""
    top = Path(path) / MANIFEST
    try:
        data = top.read_bytes()
    except FileNotFoundError:
        raise checkpoint.CheckpointError(f"{path} is not a pipeline checkpoint (no {MANIFEST})") from None
    sha = hashlib.sha256(data).hexdigest()
    if expect_sha256 is not None and sha != expect_sha256.strip().lower():
        raise checkpoint.CheckpointError(f"{path}: {MANIFEST} has SHA-256 {sha}, expected {expect_sha256} "
                                         "(not the checkpoint the alarm named, or modified)")
    try:
        manifest = json.loads(data)
    except ValueError as exc:
        raise checkpoint.CheckpointError(f"{top} is not valid JSON: {exc}") from None
    problems = manifest_problems(manifest)
    if problems:
        raise checkpoint.CheckpointError(f"{top}: " + "; ".join(problems))
    if expect_step is not None and int(manifest["step"]) != int(expect_step):
        raise checkpoint.CheckpointError(f"{path} now holds the checkpoint of step {manifest['step']}, not step "
                                         f"{expect_step}: it was written again after the alarm named it; do not "
                                         "resume from it")
    return {**manifest, "sha256": sha}


def manifest_problems(manifest: Any) -> list[str]:
    """Pure: what is wrong with the form of a parsed ``pipeline.json`` (empty when nothing): the
    schema, a verified save, a step, and one entry per pipeline position naming that position's
    file as the store writes it (a manifest naming any other file, ``../`` included, is refused)."""
    if not isinstance(manifest, dict):
        return ["not a JSON object"]
    if manifest.get("schema") != SCHEMA:
        return [f"unknown schema {manifest.get('schema')!r}"]
    problems = []
    if manifest.get("verified") is not True:
        problems.append("does not record a verified checkpoint")
    for key, least in (("step", 0), ("positions", 1), ("replicas", 1), ("num_stages", 1)):
        if not _is_count(manifest.get(key), least):
            problems.append(f"{key!r} is {manifest.get(key)!r}, not a whole number from {least}")
    stages = manifest.get("stages")
    if not isinstance(stages, dict):
        return problems + ["'stages' is not an object"]
    if problems:
        return problems
    wanted = {str(p) for p in range(manifest["positions"])}
    if set(stages) != wanted:
        missing, extra = sorted(wanted - set(stages), key=int), sorted(set(stages) - wanted)
        problems.append(f"lists positions {sorted(stages)} for a pipeline of {manifest['positions']}"
                        + (f" (missing {missing})" if missing else "") + (f" (unexpected {extra})" if extra else ""))
    for key in sorted(wanted & set(stages), key=int):
        problems += _entry_problems(int(key), stages[key])
    return problems


def _entry_problems(position: int, entry: Any) -> list[str]:
    if not isinstance(entry, Mapping):
        return [f"position {position}: not an object"]
    problems = []
    if entry.get("file") != stage_file(position):
        problems.append(f"position {position}: names file {entry.get('file')!r}, not {stage_file(position)!r}")
    sha = entry.get("sha256")
    if not (isinstance(sha, str) and len(sha) == 64 and all(c in "0123456789abcdef" for c in sha)):
        problems.append(f"position {position}: sha256 {sha!r} is not a SHA-256")
    return problems


def _is_count(value: Any, least: int) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= least


def is_pipeline_checkpoint(path: str | os.PathLike[str]) -> bool:
    return (Path(path) / MANIFEST).is_file()


def _keep_directory(entry: recovery.Checkpoint) -> str | None:
    """Keep the directory of ``entry`` (about to be written again) under its kept name."""
    try:
        manifest = read_manifest(entry.path, expect_step=entry.step, expect_sha256=entry.sha256)
    except checkpoint.CheckpointError:
        return None
    del manifest
    target = recovery.kept_path(entry.path, entry.step)
    shutil.rmtree(target, ignore_errors=True)
    os.replace(entry.path, target)
    recovery.remember_kept(target)
    return target
