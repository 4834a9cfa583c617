"""What the example's two scripts share besides the training: the flags, the fault injector's
wiring and the per-rank result file the tests read, as two Lightning callbacks. train_plain.py and
train.py use them alike, so that the difference between the scripts is exactly the port.
"""
from __future__ import annotations

import argparse
import json
import os
from pathlib import Path
from typing import Any

import lightning as L

from sdcguard.faults import FaultInjector, parse_fault
from sdcguard.fingerprint import digest, fingerprint


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description="Train a small classifier with Lightning DDP (torchrun, gloo).")
    add = p.add_argument
    add("--epochs", type=int, default=3)
    add("--samples", type=int, default=144, help="training samples (split across the ranks)")
    add("--batch-size", type=int, default=8, help="samples per micro-batch and rank")
    add("--accumulate", type=int, default=2, help="accumulate_grad_batches")
    add("--clip", type=float, default=1.0, help="gradient_clip_val; 0: off")
    add("--precision", default="32-true", choices=("32-true", "bf16-mixed"))
    add("--lr", type=float, default=1e-2)
    add("--seed", type=int, default=7, help="model initialisation seed (the same on every rank)")
    add("--out", default="out-lightning", help="checkpoints and per-rank result files")
    add("--save-last", action=argparse.BooleanOptionalAction, default=True,
        help="ModelCheckpoint(save_last=...): last.ckpt beside the newest epoch checkpoint")
    add("--resume", metavar="PATH", help="trainer.fit(ckpt_path=PATH)")
    add("--expect-step", type=int, help="sdcguard: resume only if --resume holds this step (the alarm's last_good_checkpoint_step)")
    add("--expect-sha256", help="sdcguard: resume only if --resume has these bytes (the alarm's last_good_checkpoint_sha256)")
    add("--audit-every", type=int, default=4, help="sdcguard: replay audit every N steps (SDCGUARD_* wins)")
    add("--weight-check-every", type=int, default=2, help="sdcguard: weight check every N steps")
    add("--inject", action="append", default=[], metavar="SPEC",
        help="fault to inject, KIND:rank=R:step=S[:magnitude=X][:every=K] (repeatable)")
    return p.parse_args(argv)


class Faults(L.Callback):
    """Plants ``--inject`` faults: forward faults strike the first GELU's output, the others the
    first Linear's weight; ``reduce-*`` faults wrap the all-reduce (sdcguard's, or DDP's own)."""

    SITE, PARAM = "net.2", "net.0.weight"

    def __init__(self, specs: list[str]) -> None:
        world = int(os.environ.get("WORLD_SIZE", "1"))
        self.injector = FaultInjector([parse_fault(s, world) for s in specs], int(os.environ.get("RANK", "0")))
        self.reduces = any(f.info.corrupts == "reduce" for f in self.injector.faults)

    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        if self.reduces and hasattr(trainer.strategy, "reduce_hook"):  # sdcguard's strategy wraps it
            trainer.strategy.reduce_hook = self.injector.reduce_hook

    def on_fit_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self.injector.install(pl_module, trainer.optimizers[0], site=self.SITE, param=self.PARAM)
        if self.reduces and not hasattr(trainer.strategy, "reduce_hook"):
            trainer.strategy.model.register_comm_hook(None, self.injector.reduce_hook)

    def on_train_batch_start(self, trainer: L.Trainer, pl_module: L.LightningModule, batch: Any, batch_idx: int) -> None:
        if batch_idx % trainer.accumulate_grad_batches == 0:  # the first micro-batch of a step
            self.injector.begin_step(trainer.global_step)


class Results(L.Callback):
    """This rank's record of the run, written to ``OUT/result-rank<R>.json``: every micro-batch's
    loss (as float.hex), the checkpoints, what stopped the run, the final weights' digest."""

    def __init__(self, out: str, faults: Faults | None = None) -> None:
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
        self.data["weights_digest"] = digest(fingerprint(p.detach()) for p in pl_module.parameters()).hex()
        if self.faults is not None:
            self.data["fired"] = self.faults.injector.fired
        self.path.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.path.with_name(f".{self.path.name}.tmp")
        tmp.write_text(json.dumps(self.data, indent=1, sort_keys=True, default=str))
        os.replace(tmp, self.path)


def callbacks(args: argparse.Namespace) -> list[L.Callback]:
    """The harness's callbacks for the Trainer: faults first, so they are planted before a step records."""
    faults = Faults(args.inject)
    return [faults, Results(args.out, faults)]
