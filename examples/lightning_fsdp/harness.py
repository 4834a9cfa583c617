"""What the example's two scripts share besides the training: the flags, the sharded fault
injector's wiring and the per-rank result file the tests read, as two Lightning callbacks.
train_plain.py and train.py use them alike, so that the difference between the scripts is the port.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
from pathlib import Path
from typing import Any

import lightning as L

from sdcguard.faults.sharded import ShardedFaultInjector


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description="Train a small classifier with Lightning's FSDP2 (torchrun, gloo).")
    add = p.add_argument
    add("--epochs", type=int, default=3)
    add("--samples", type=int, default=192, help="training samples (split across the ranks)")
    add("--batch-size", type=int, default=8, help="samples per micro-batch and rank")
    add("--accumulate", type=int, default=2, help="accumulate_grad_batches")
    add("--clip", type=float, default=1.0, help="gradient_clip_val; 0: off")
    add("--replicate", type=int, default=1, help="HSDP replicas (1: pure FSDP over every rank)")
    add("--tp", type=int, default=1, help="tensor_parallel_size (ModelParallelStrategy; 1: none)")
    add("--lr", type=float, default=1e-2)
    add("--seed", type=int, default=7, help="model initialisation seed (the same on every rank)")
    add("--out", default="out-lightning-fsdp", help="checkpoints and per-rank result files")
    add("--save-last", action=argparse.BooleanOptionalAction, default=True,
        help="ModelCheckpoint(save_last=...): last.ckpt beside the newest epoch checkpoint")
    add("--resume", metavar="PATH", help="trainer.fit(ckpt_path=PATH)")
    add("--expect-step", type=int, help="sdcguard: resume only if --resume holds this step (the alarm's last_good_checkpoint_step)")
    add("--expect-sha256", help="sdcguard: resume only if --resume has these bytes (the alarm's last_good_checkpoint_sha256)")
    add("--audit-every", type=int, default=4, help="sdcguard: replay audit every N steps (SDCGUARD_* wins)")
    add("--weight-check-every", type=int, default=2, help="sdcguard: weight check every N steps (HSDP)")
    add("--inject", action="append", default=[], metavar="SPEC",
        help="fault to inject (sdcguard.faults.sharded), KIND:rank=R:step=S[:element=N] (repeatable)")
    return p.parse_args(argv)


class Faults(L.Callback):
    """Plants ``--inject`` faults through the Guard the strategy built: forward faults strike the
    first GELU's output, the others the first Linear's weight (names relative to the FSDP root)."""

    SITE, PARAM = "2", "0.weight"

    def __init__(self, specs: list[str]) -> None:
        self.specs = specs
        self.injector: ShardedFaultInjector | None = None

    def on_fit_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        guard = getattr(trainer.strategy, "guard", None)
        if self.specs and guard is None:
            raise SystemExit("--inject needs sdcguard's strategy (train.py)")
        if guard is not None:
            self.injector = ShardedFaultInjector(self.specs, trainer.global_rank)
            self.injector.install(guard, param=self.PARAM, site=self.SITE)

    def on_train_batch_start(self, trainer: L.Trainer, pl_module: L.LightningModule, batch: Any, batch_idx: int) -> None:
        if self.injector is not None and batch_idx % trainer.accumulate_grad_batches == 0:  # a step's first micro-batch
            self.injector.begin_step(trainer.global_step)


class Results(L.Callback):
    """This rank's record of the run, written to ``OUT/result-rank<R>.json``: every micro-batch's
    loss (as float.hex), the checkpoints, what stopped the run, the SHA-256 of each local shard."""

    def __init__(self, out: str, faults: Faults) -> None:
        self.path = Path(out) / f"result-rank{os.environ.get('RANK', '0')}.json"
        self.faults = faults
        self.data: dict[str, Any] = {"losses": {}, "checkpoints": [], "alarms": [], "errors": [], "first_step": None}

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        if self.data["first_step"] is None:
            self.data["first_step"] = trainer.global_step
        self.data["losses"][f"{trainer.current_epoch}:{batch_idx}"] = float(outputs["loss"]).hex()

    def on_save_checkpoint(self, trainer: L.Trainer, pl_module: L.LightningModule, checkpoint: dict) -> None:
        self.data["checkpoints"].append(trainer.global_step)

    def on_fit_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self.finish(trainer, pl_module)

    def on_exception(self, trainer: L.Trainer, pl_module: L.LightningModule, exception: BaseException) -> None:
        alarm = getattr(exception, "alarm", None)
        if alarm is not None:
            self.data["alarms"].append(alarm)
        self.data["errors"].append({"step": trainer.global_step, "type": type(exception).__name__,
                                    "message": str(exception)})
        self.finish(trainer, pl_module)

    def finish(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self.data["final_step"] = trainer.global_step
        self.data["shards"] = {name: hashlib.sha256(p.to_local().detach().contiguous().numpy().tobytes()).hexdigest()
                               for name, p in pl_module.named_parameters()}
        injector = self.faults.injector
        self.data["fired"] = injector.fired if injector is not None else []
        guard = getattr(trainer.strategy, "guard", None)
        if guard is not None:
            self.data["plan"] = guard.plan_lines()
        self.path.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.path.with_name(f".{self.path.name}.tmp")
        tmp.write_text(json.dumps(self.data, indent=1, sort_keys=True, default=str))
        os.replace(tmp, self.path)


def callbacks(args: argparse.Namespace) -> list[L.Callback]:
    """The harness's callbacks for the Trainer: faults first, so they are planted before a step records."""
    faults = Faults(args.inject)
    return [faults, Results(args.out, faults)]
