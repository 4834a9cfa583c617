"""sdcguard in a Hugging Face ``transformers.Trainer`` run, and in your own Accelerate loop.

Trainer (``transformers`` 5.x)::

    trainer = SdcguardTrainer(model=model, args=training_args, train_dataset=dataset,
                              sdcguard_config=sdcguard.Config.from_env())
    trainer.train()   # raises sdcguard.SDCDetected (the same on every rank) when a check fires

Each optimizer step of the Trainer becomes one ``guard.step``: ``training_step`` runs every
micro-batch through ``s.backward`` (the Trainer's ``compute_loss`` is sdcguard's ``loss_fn``, so a
replay on another rank recomputes exactly what this one did, ``num_items_in_batch`` included),
``s.check()`` runs after the last micro-batch's backward and so before the Trainer clips and calls
``optimizer.step()``; the step closes (check 3 on weight-check steps) in ``on_optimizer_step``.
The Trainer's own arithmetic is kept: its loss scaling for gradient accumulation, its
``no_sync``, clipping, scheduler and autocast (``bf16``). sdcguard's steps are the Trainer's
``global_step`` values: step N is the update that makes ``global_step`` N, so ``checkpoint-N``
holds step N and ``Config(checkpoint_every=save_steps)`` audits every saved step.

Checkpoints: every ``checkpoint-N`` folder is written only after check 3 passed, then gets
``sdcguard-trainer.json`` (every file's SHA-256, the weight digest of ``model.safetensors``, the
step, what the run had verified). ``save_total_limit`` still rotates the folders, but never
deletes one an alarm may still name as its resume point (for each check, the newest folder at or
before the step it last cleared); a folder it deletes leaves the history, so no alarm names it. :func:`verify_folder` (``sdcguard.checkpoint_folder``,
no transformers needed; ``sdcguard verify-checkpoint FOLDER``) checks a folder offline.

Accelerate (``accelerate`` 1.x), in your own loop::

    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    guard = accelerate_guard(accelerator, model, optimizer, loss_fn, config=sdcguard.Config.from_env())
    with guard.step(step, micro_batches=n) as s:
        for micro in micro_batches:
            s.backward(micro, divide_by=n)      # in place of accelerator.backward(loss / n)
        s.check()
        accelerator.clip_grad_norm_(model.parameters(), 1.0); optimizer.step(); optimizer.zero_grad()

DDP (``torchrun``, any backend) and a single process are supported; FSDP, DeepSpeed, Megatron,
SageMaker MP, ``DataParallel`` (several GPUs in one process) and context parallelism are refused
with a :class:`~sdcguard.errors.ConfigurationError` naming the setting.
"""
from __future__ import annotations

import json
import logging
import os
import shutil
from dataclasses import replace
from pathlib import Path
from typing import Any, Callable, Mapping

import torch
import torch.distributed as dist
from accelerate import Accelerator
from accelerate.utils import DistributedType
from transformers import Trainer, TrainerCallback
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR, get_last_checkpoint, sort_checkpoints

from .. import checkpoint as file_checkpoint
from .. import recovery
from ..buckets import settle_buckets
from ..checks.replay import replay_mode
from ..config import Config
from ..manifest import verification_fields
from ..contract.alarm import now_rfc3339
from ..contract.spool import write_json_atomic
from ..errors import ConfigurationError
from ..guard import Guard
from ..layouts import unwrap
from ..checkpoint_folder import MANIFEST_NAME, SCHEMA, WEIGHTS_FILE, verify_folder
from ..checkpoint_folder import hash_folder as _hash_folder
from ..checkpoint_folder import weights_digest as _weights_digest
from ..sharding.dcp_manifest import identity as _identity
from .base import HeldStep, adopt, rank0_outcome

__all__ = ["SdcguardTrainer", "SdcguardCallback", "accelerate_guard", "verify_folder", "MANIFEST_NAME"]

log = logging.getLogger("sdcguard")

# -- Trainer --------------------------------------------------------------------------------------

class SdcguardCallback(TrainerCallback):
    """Closes each checked step once the Trainer's optimizer step ran (check 3 on weight-check
    steps) and flushes the statistics when training ends. :class:`SdcguardTrainer` adds it."""

    def __init__(self, trainer: SdcguardTrainer) -> None:
        self.trainer = trainer

    def on_optimizer_step(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self.trainer._held.close(None)

    def on_train_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if self.trainer.guard is not None:
            self.trainer.guard.flush_stats()


class SdcguardTrainer(Trainer):
    """``transformers.Trainer`` whose optimizer steps run through sdcguard's step API.

    ``sdcguard_config``: the Guard's settings (default ``Config.from_env()``);
    ``sdcguard_reduce_hook`` / ``sdcguard_reduce_state``: your own DDP reduction (see ``Guard``).
    Every other argument is the Trainer's. With ``save_strategy="steps"`` and no
    ``checkpoint_every`` of its own, the config's checkpoint interval is ``save_steps`` (saved steps
    are then audited, so the newest folder is a resume point). The Guard is built at the first
    training step, once the Trainer has wrapped the model (``self.guard``)."""

    def __init__(self, *args: Any, sdcguard_config: Config | None = None,
                 sdcguard_reduce_hook: Callable[..., Any] | None = None, sdcguard_reduce_state: Any = None,
                 **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        config = sdcguard_config if sdcguard_config is not None else Config.from_env()
        if not config.checkpoint_every and self.args.save_strategy == "steps" and self.args.save_steps >= 1:
            # the job's checkpoint interval is the Trainer's: saved steps are audited (audit_checkpoints)
            config = replace(config, checkpoint_every=int(self.args.save_steps))
        self.sdcguard_config = config
        self.sdcguard_reduce_hook = sdcguard_reduce_hook
        self.sdcguard_reduce_state = sdcguard_reduce_state
        self.guard: Guard | None = None
        self._held = HeldStep()
        """The optimizer step in progress: opened at its first micro-batch, closed in on_optimizer_step."""
        self._resumed: tuple[str, dict[str, Any]] | None = None
        self._settle_pending = False
        self.add_callback(SdcguardCallback(self))

    # -- the step ------------------------------------------------------------------------------

    def training_step(self, model: torch.nn.Module, inputs: dict[str, Any],
                      num_items_in_batch: torch.Tensor | int | None = None) -> torch.Tensor:
        """The Trainer's micro-batch (forward, loss scaling, backward) as ``s.backward``; after the
        last micro-batch of the optimizer step, ``s.check()``. Returns what the Trainer's own
        ``training_step`` returns: the loss as it was backpropagated, detached."""
        if self._settle_pending and (self.guard is None or self.guard.model is not model):
            self._settle_buckets(model, inputs, num_items_in_batch)
        guard = self._guard_for(model)
        s = self._held.current
        if s is None:
            s = self._held.open(guard, self.state.global_step + 1, self.current_gradient_accumulation_steps)
        try:
            cp_context, inputs = self._prepare_context_parallel_inputs(model, inputs)
            with cp_context():
                model.train()
                if hasattr(self.optimizer, "train") and callable(self.optimizer.train):
                    self.optimizer.train()
                micro = {"inputs": self._prepare_inputs(inputs), "num_items_in_batch": num_items_in_batch}
                divide_by = None if self._loss_is_scaled_for_ga(num_items_in_batch) else self.current_gradient_accumulation_steps
                loss = s.backward(micro, divide_by=divide_by)
            if len(s.batches) == s.micro_batches:
                s.check()  # before the Trainer clips and steps: raises on every rank alike
        except BaseException as exc:
            self._held.close(exc)
            raise
        return loss / divide_by if divide_by is not None else loss

    def sdcguard_loss(self, module: torch.nn.Module, micro: Mapping[str, Any]) -> torch.Tensor:
        """sdcguard's ``loss_fn``: the Trainer's ``compute_loss`` on one recorded micro-batch (for
        your pass, with the wrapped model, and for replays, with the bare module)."""
        with self.compute_loss_context_manager():
            return self.compute_loss(module, dict(micro["inputs"]), num_items_in_batch=micro["num_items_in_batch"])

    def train(self, resume_from_checkpoint: str | bool | None = None, *args: Any, **kwargs: Any) -> Any:
        """The Trainer's ``train``; a ``checkpoint-N`` folder to resume from is verified against its
        manifest first (``CheckpointError`` on every rank, before the Trainer reads it), and the
        run inherits what it had verified, so an alarm can name a folder from before it; DDP's
        buckets are settled on the first micro-batch (``sdcguard.settle_buckets``)."""
        self._resumed = None
        self._settle_pending = bool(resume_from_checkpoint)
        if resume_from_checkpoint:
            folder = (get_last_checkpoint(self.args.output_dir) if resume_from_checkpoint is True
                      else os.fspath(resume_from_checkpoint))
            if folder is not None and (Path(folder) / MANIFEST_NAME).is_file():
                self._resumed = (folder, verify_folder(folder))
            elif folder is not None:
                log.warning("sdcguard: %s has no %s: resuming from a folder sdcguard did not verify", folder, MANIFEST_NAME)
        try:
            return super().train(resume_from_checkpoint, *args, **kwargs)
        except BaseException as exc:
            self._held.close(exc)  # a step still open (an error between check and update) ends failed
            raise

    def _settle_buckets(self, model: torch.nn.Module, inputs: dict[str, Any], num_items_in_batch: Any) -> None:
        """A resumed run: one throw-away pass through DDP on its first micro-batch
        (``sdcguard.settle_buckets``, outside any check, faults and metrics off as in a replay), so
        that its first step reduces in the bucket layout the uninterrupted run had by then (the
        Trainer wraps a fresh DDP); then the Guard is built."""
        self._settle_pending = False
        ddp, _, _ = unwrap(model)
        if ddp is None:
            return
        model.train()
        micro = {"inputs": self._prepare_inputs(inputs), "num_items_in_batch": num_items_in_batch}
        sync, ddp.require_backward_grad_sync = ddp.require_backward_grad_sync, True  # also under no_sync
        try:
            with replay_mode():
                settle_buckets(model, self.sdcguard_loss, micro)
        finally:
            ddp.require_backward_grad_sync = sync

    def _loss_is_scaled_for_ga(self, num_items_in_batch: Any) -> bool:
        # The Trainer's own rule (training_step): a loss normalised over the accumulated batch is not divided again.
        if self.loss_is_scaled_for_ga is not None:
            return bool(self.loss_is_scaled_for_ga)
        return bool((self.model_accepts_loss_kwargs and num_items_in_batch is not None) or self.compute_loss_func is not None)

    def _guard_for(self, model: torch.nn.Module) -> Guard:
        if self.guard is None or self.guard.model is not model:
            _refuse_trainer_setup(self)
            self.guard = accelerate_guard(self.accelerator, model, self.optimizer, self.sdcguard_loss,
                                          config=self.sdcguard_config, reduce_hook=self.sdcguard_reduce_hook,
                                          reduce_state=self.sdcguard_reduce_state)
            if self._resumed is not None:
                folder, manifest = self._resumed
                adopt(self.guard, folder, manifest, manifest["weight_digest"])
        return self.guard

    # -- checkpoints ---------------------------------------------------------------------------

    def _save_checkpoint(self, model: torch.nn.Module, trial: Any) -> None:
        """The save gate (no save after an alarm, the step rule, check 3), the Trainer's
        ``checkpoint-N`` folder, its manifest, then the rotation."""
        guard = self.guard
        if guard is None:  # nothing trained in this call (e.g. a save right after resuming)
            return super()._save_checkpoint(model, trial)
        run_dir = self._get_output_dir(trial=trial)
        folder = os.path.join(run_dir, f"{PREFIX_CHECKPOINT_DIR}-{self.state.global_step}")
        # checkpoint-N holds the update of step N (sdcguard's steps are the Trainer's global_step values)
        step = guard.save_gate(folder, self.state.global_step)  # raises on every rank before anything is written
        limit = self.args.save_total_limit
        # The Trainer's rotation waits until the manifest is written: transformers 5.x rotates with the
        # module-level rotate_checkpoints(save_total_limit=self.args.save_total_limit) at the end of
        # _save_checkpoint, with no method to override, so the limit is lifted for that call and
        # _rotate applies it afterwards, sparing what an alarm may still name.
        self.args.save_total_limit = None
        try:
            super()._save_checkpoint(model, trial)
        finally:
            self.args.save_total_limit = limit
        guard.history = _record_folder(guard, folder, step)
        guard.history = _rotate(guard, run_dir, limit, self.state.best_model_checkpoint, self.args.should_save)


def _refuse_trainer_setup(trainer: Trainer) -> None:
    """What the Trainer integration cannot check: refuse it at the first step, naming the setting."""
    args = trainer.args
    if trainer.is_deepspeed_enabled or trainer.is_fsdp_enabled or getattr(trainer, "is_fsdp_xla_enabled", False):
        raise ConfigurationError("sdcguard's Trainer integration supports DDP and a single process; "
                                 "TrainingArguments(fsdp=...) / deepspeed=... is not supported yet")
    if args.n_gpu > 1:
        raise ConfigurationError(f"sdcguard: TrainingArguments puts {args.n_gpu} GPUs in one process (DataParallel); "
                                 "launch one process per GPU with torchrun instead")
    if getattr(trainer, "is_distributed_loading_by_transformers", False):
        raise ConfigurationError("sdcguard: a model sharded at load time (tp_plan / device_mesh) is not supported")
    pc = getattr(trainer.accelerator, "parallelism_config", None)
    if pc is not None and (getattr(pc, "cp_enabled", False) or getattr(pc, "sp_enabled", False)):
        raise ConfigurationError("sdcguard: context / sequence parallelism is not supported")
    if args.optim in ("lomo", "adalomo"):
        raise ConfigurationError(f"sdcguard: optim={args.optim!r} updates inside the backward, before any check")


# -- Accelerate -----------------------------------------------------------------------------------

def accelerate_guard(accelerator: Accelerator, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
                     loss_fn: Callable[[torch.nn.Module, Any], torch.Tensor], *, config: Config | None = None,
                     **guard_kwargs: Any) -> Guard:
    """The Guard for the model and optimizer ``accelerator.prepare`` returned: the torch optimizer
    inside Accelerate's wrapper, Accelerate's GradScaler (fp16), the checks for DDP or one process.

    In the loop, ``s.backward(micro, divide_by=n)`` replaces ``accelerator.backward(loss)`` (leave
    ``Accelerator(gradient_accumulation_steps=)`` at 1 and ``accumulate()`` out: the step's
    ``micro_batches`` and ``s.backward`` do both); autocast from ``mixed_precision`` applies to the
    replays too, since Accelerate puts it on the module's own ``forward``."""
    kind = accelerator.distributed_type
    if kind not in (DistributedType.NO, DistributedType.MULTI_CPU, DistributedType.MULTI_GPU):
        raise ConfigurationError(f"sdcguard supports Accelerate's DDP (MULTI_GPU / MULTI_CPU) and a single process, "
                                 f"not {kind}: FSDP, DeepSpeed and Megatron are not supported yet")
    if accelerator.gradient_accumulation_steps != 1:
        raise ConfigurationError(
            f"sdcguard: Accelerator(gradient_accumulation_steps={accelerator.gradient_accumulation_steps}) divides "
            "inside accelerator.backward and skips optimizer.step() between syncs; leave it at 1 and declare "
            "guard.step(step, micro_batches=N) with s.backward(micro, divide_by=N) instead")
    inner = getattr(optimizer, "optimizer", optimizer)  # AcceleratedOptimizer wraps the torch optimizer
    return Guard(model, inner, loss_fn, config=config, scaler=accelerator.scaler, **guard_kwargs)


# -- checkpoint-N folders -------------------------------------------------------------------------

def _record_folder(guard: Guard, folder: str, step: int) -> recovery.History:
    """Once every rank's files are in ``folder`` (the Trainer's save), rank 0 checks the saved
    weights against check 3's digest and writes the manifest; every rank learns the outcome and
    records the checkpoint in the history (the same on every rank)."""
    if not guard.solo:
        dist.barrier(group=guard.group)  # each rank writes its own rng_state_<rank>.pth
    history = guard.history
    plan = recovery.plan_save(history, folder, step, keep=False)  # a folder written again is not kept
    outcome = rank0_outcome(guard, lambda: {"sha256": _write_manifest(guard, Path(folder), step, plan)},
                            f"checkpoint {folder} has no manifest")
    saved = recovery.Checkpoint(step, folder, history.last_audited_step, outcome["sha256"])
    return recovery.after_save(history, plan, saved, None)


def _write_manifest(guard: Guard, folder: Path, step: int, plan: recovery.SavePlan) -> str:
    names = [n for n, _ in guard.named_parameters]
    found = _weights_digest(folder, names)
    if found != guard.last_weights_digest:
        raise file_checkpoint.CheckpointError(f"{folder / WEIGHTS_FILE} does not hold the weights check 3 just "
                                              f"verified (digest {found}, check 3 {guard.last_weights_digest})")
    files = _hash_folder(folder)
    history = guard.history
    identity = _identity(files)
    write_json_atomic(folder / MANIFEST_NAME, json.dumps({
        "schema": SCHEMA, "step": step, "verified": True, "sha256": identity, "files": files,
        "weight_digest": guard.last_weights_digest, "weights_file": WEIGHTS_FILE, "parameters": names,
        **verification_fields(history, step, str(folder), plan, None),
        "replicas": guard.topology.world_size, "verified_at": now_rfc3339(), "run_id": guard.topology.run_id,
    }, indent=2, sort_keys=True))
    return identity


def _rotate(guard: Guard, run_dir: str, limit: int | None, best: str | None, writer: bool) -> recovery.History:
    """The Trainer's ``save_total_limit`` rotation (oldest first; the newest and the best model
    kept), sparing the folders a later alarm may still name (``recovery.nameable``); rank 0
    deletes, every rank learns which, and deleted folders leave the history."""
    history = guard.history

    def rotate() -> dict[str, Any]:
        deleted: list[str] = []
        if not writer or limit is None or limit <= 0:
            return {"deleted": deleted}
        needed = {os.path.normpath(c.path) for c in recovery.nameable(history)}
        folders = [os.path.normpath(f) for f in sort_checkpoints(run_dir, use_mtime=False, best_model_checkpoint=best)]
        protected = (set(folders[-1:]) | needed | ({os.path.normpath(best)} if best else set())) & set(folders)
        remaining = len(folders)
        for folder in folders:
            if remaining <= max(limit, len(protected)):
                break
            if folder not in protected:
                shutil.rmtree(folder, ignore_errors=True)
                deleted.append(folder)
                remaining -= 1
        if remaining > limit:
            log.warning("sdcguard: %d checkpoint folders kept (save_total_limit=%d): a later alarm may still name %s",
                        remaining, limit, sorted(needed - set(folders[-1:])))
        return {"deleted": deleted}

    gone = set(rank0_outcome(guard, rotate, f"rotating the checkpoints in {run_dir}")["deleted"])
    return replace(history, checkpoints=[c for c in history.checkpoints if os.path.normpath(c.path) not in gone])
