"""A pipeline's checkpoint: a directory holding one file per pipeline position and one manifest.

    ckpt/                       the path given to save_checkpoint (one per save, or written again)
      stage-0.pt                position 0's stages (model and optimizer), written by its first
      stage-0.pt.manifest.json  replica, with the manifest every file checkpoint has (checkpoint.py)
      stage-1.pt ...
      pipeline.json             the step, every position's file and SHA-256, what verified it

The checkpoint's identity (what an alarm names as ``last_good_checkpoint_sha256``) is the SHA-256
of ``pipeline.json``, which lists every stage file's: one number covers the whole pipeline. A load
verifies it, then each rank its own position's file (its bytes and the weights it loads); a failure
on any rank is raised on every rank.
"""
from __future__ import annotations

import dataclasses
import json
import os
import shutil
from pathlib import Path
from typing import Any, Callable

import torch
import torch.distributed as dist

from .. import checkpoint, recovery
from .. import manifest as manifest_codec
from ..checks.exchange import gather_objects
from ..checks.pipeline import Grid
from ..checks.topology import Topology
from ..contract.alarm import now_rfc3339
from ..contract.spool import write_json_atomic

MANIFEST = "pipeline.json"
SCHEMA = "sdcguard.pipeline-checkpoint/1"


def stage_file(position: int) -> str:
    return f"stage-{position}.pt"


class PipelineStore:
    """The :class:`~sdcguard.layouts.base.CheckpointStore` of a pipeline (see the module docstring)."""

    def __init__(self, *, module: torch.nn.Module, optimizer: torch.optim.Optimizer,
                 named_parameters: list[tuple[str, torch.nn.Parameter]], grid: Grid, topology: Topology,
                 device: torch.device, dp_group: dist.ProcessGroup, on_load: Callable[[], None]) -> None:
        self.module, self.optimizer = module, optimizer
        self.on_load = on_load
        """Told when a checkpoint was loaded (the layout's first step then reduces regularly)."""
        self.named_parameters = named_parameters
        self.grid, self.topology, self.device, self.dp_group = grid, topology, device, dp_group
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
        facts = checkpoint.Facts(
            step=step, weight_digest=weight_digest, parameters=[n for n, _ in self.named_parameters],
            model_key=model_key, history=dataclasses.replace(history, checkpoints=[]),
            replicas=self.grid.replicas, run_id=self.topology.run_id)
        mine = {"step": step, model_key: self.module.state_dict(), "optimizer": self.optimizer.state_dict(),
                "scaler": None}
        failure, sha = None, None
        try:  # collective within the position's replicas: its first replica writes
            written = checkpoint.save(os.path.join(path, stage_file(self.position)), mine, facts, keep=False,
                                      writer=self.replica == 0, device=self.device, group=self.dp_group)
            sha = written.checkpoints[-1].sha256
        except Exception as exc:  # noqa: BLE001 - every rank learns it below, none is left waiting
            failure = f"{type(exc).__name__}: {exc}"
        said = gather_objects([self.position, sha, failure], None, self.device)
        failures = sorted({f for _, _, f in said if f})
        if failures:
            raise checkpoint.CheckpointError(f"pipeline checkpoint {path} was not written: {failures[0]}")
        stages = {str(p): {"file": stage_file(p), "sha256": s} for p, s, _ in said}
        top = None
        if me == 0:
            write_json_atomic(Path(path) / MANIFEST, json.dumps({
                "schema": SCHEMA, "step": step, "verified": True, "stages": stages,
                "positions": self.grid.positions, "replicas": self.grid.replicas,
                "num_stages": self.grid.num_stages, "model_key": model_key,
                **manifest_codec.verification_fields(history, step, str(path), plan, kept),
                "verified_at": now_rfc3339(), "run_id": self.topology.run_id,
            }, indent=2, sort_keys=True))
            top = manifest_codec.sha256_file(Path(path) / MANIFEST)
            for victim in recovery.removable(plan.remove, str(Path(path).parent)):
                shutil.rmtree(victim, ignore_errors=True)
        top = gather_objects(top, None, self.device)[0]
        saved = recovery.Checkpoint(step, str(path), history.last_audited_step, top)
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
            entry = manifest["stages"][str(self.position)]
            first = next(self.module.parameters(), None)
            checkpoint.load_checkpoint(Path(path) / entry["file"], self.module, self.optimizer, None,
                                       map_location=first.device if first is not None else "cpu",
                                       model_key=model_key, expect_step=int(manifest["step"]),
                                       expect_sha256=entry["sha256"])
            digest = checkpoint.read_manifest(Path(path) / entry["file"])["weight_digest"]
        except (checkpoint.CheckpointError, KeyError, OSError, ValueError) as exc:
            failure = f"{type(exc).__name__}: {exc}"
        failures = sorted({f for f in gather_objects(failure, None, self.device) if f})
        if failures:  # on every rank alike: one position's bad file stops the whole pipeline
            raise checkpoint.CheckpointError(f"pipeline checkpoint {path} refused: {failures[0]}")
        self.on_load()
        return int(manifest["step"]), manifest_codec.resumed_history(path, manifest), digest


def read_manifest(path: str | os.PathLike[str], *, expect_step: int | None = None,
                  expect_sha256: str | None = None) -> dict[str, Any]:
    """``pipeline.json`` of ``path``, checked against what an alarm named (step, SHA-256)."""
    top = Path(path) / MANIFEST
    if not top.is_file():
        raise checkpoint.CheckpointError(f"{path} is not a pipeline checkpoint (no {MANIFEST})")
    sha = manifest_codec.sha256_file(top)
    if expect_sha256 is not None and sha != expect_sha256:
        raise checkpoint.CheckpointError(f"{path}: {MANIFEST} has SHA-256 {sha}, expected {expect_sha256} "
                                         "(not the checkpoint the alarm named, or modified)")
    manifest = json.loads(top.read_text())
    if manifest.get("schema") != SCHEMA:
        raise checkpoint.CheckpointError(f"{top}: unknown schema {manifest.get('schema')!r}")
    if expect_step is not None and int(manifest["step"]) != expect_step:
        raise checkpoint.CheckpointError(f"{path} holds step {manifest['step']}, expected {expect_step}")
    return {**manifest, "sha256": sha}  # the checkpoint's identity: what the history records


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
