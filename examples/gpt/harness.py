"""What the example's two scripts share besides the training itself: the flags, the fault
injector's wiring, and the per-rank result file the tests read. train_plain.py and train.py use it
alike, so that the difference between them is exactly the port to sdcguard.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import traceback
from pathlib import Path
from typing import Any, Iterator

import torch

from sdcguard.faults import FaultInjector, parse_fault
from sdcguard.fingerprint import digest, fingerprint


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description="Train a small GPT on a synthetic character corpus (torchrun, gloo).")
    add = p.add_argument
    add("--steps", type=int, default=40, help="optimizer steps (max_iters)")
    add("--eval-interval", type=int, default=20, help="evaluate (and maybe checkpoint) every N steps; 0: never")
    add("--eval-iters", type=int, default=2, help="batches per split in an evaluation")
    add("--log-interval", type=int, default=10)
    add("--always-save", action="store_true", help="checkpoint at every evaluation, not only on a better val loss")
    add("--batch-size", type=int, default=4, help="sequences per micro-batch and rank")
    add("--block-size", type=int, default=32)
    add("--accum", type=int, default=2, help="gradient accumulation steps (micro-batches per step)")
    add("--n-layer", type=int, default=2)
    add("--n-head", type=int, default=2)
    add("--n-embd", type=int, default=32)
    add("--dropout", type=float, default=0.0)
    add("--lr", type=float, default=1e-3, help="peak learning rate")
    add("--min-lr", type=float, default=1e-4)
    add("--warmup", type=int, default=5, help="linear warm-up steps before the cosine decay")
    add("--weight-decay", type=float, default=0.1)
    add("--grad-clip", type=float, default=1.0, help="clip the gradient norm at this value; 0: off")
    add("--dtype", choices=("float32", "bfloat16", "float16"), default="float32", help="autocast dtype")
    add("--grad-scaler", action="store_true", help="enable the GradScaler (always on with float16)")
    add("--compile", action="store_true", help="torch.compile the model (before DDP, as nanoGPT)")
    add("--seed", type=int, default=1337, help="model initialisation seed (the same on every rank)")
    add("--out", default="out-gpt", help="checkpoints and per-rank result files")
    add("--resume", metavar="PATH", help="resume from this checkpoint")
    add("--expect-step", type=int, help="sdcguard: resume only if --resume holds this step (the alarm's last_good_checkpoint_step)")
    add("--expect-sha256", help="sdcguard: resume only if --resume has these bytes (the alarm's last_good_checkpoint_sha256)")
    add("--audit-every", type=int, default=10, help="sdcguard: replay audit every N steps (SDCGUARD_* wins)")
    add("--weight-check-every", type=int, default=5, help="sdcguard: weight check every N steps")
    add("--inject", action="append", default=[], metavar="SPEC",
        help="fault to inject, KIND:rank=R:step=S[:magnitude=X][:every=K] (repeatable)")
    add("--inf-sample-step", type=int, help="at this step, one sample of --inf-sample-rank has an Inf loss weight")
    add("--inf-sample-rank", type=int, default=1)
    add("--keep-going", action="store_true",
        help="after a step raises, record it and go on with the next step (tests: several faults in one run)")
    return p.parse_args(argv)


def install_faults(specs: list[str], model: torch.nn.Module, optimizer: torch.optim.Optimizer,
                   rank: int, world_size: int) -> FaultInjector:
    """The example's only contact with the fault injector: forward faults strike the first
    block's MLP output, gradient / optimizer / weight faults its first weight matrix."""
    injector = FaultInjector([parse_fault(s, world_size) for s in specs], rank)
    mlp = model.transformer.h[0].mlp
    injector.install(mlp, mlp.c_fc.weight, optimizer)
    return injector


class Results:
    """This rank's record of the run, written to ``OUT/result-rank<R>.json``."""

    def __init__(self, out: str, rank: int, keep_going: bool) -> None:
        self.path = Path(out) / f"result-rank{rank}.json"
        self.keep_going = keep_going
        self.data: dict[str, Any] = {"rank": rank, "losses": {}, "evals": {}, "alarms": [], "errors": [],
                                     "checkpoints": [], "first_step": None}

    @contextlib.contextmanager
    def step(self, step: int) -> Iterator[None]:
        """Record what a step raises; re-raise it unless ``--keep-going``. The next step starts
        with ``zero_grad``, so a refused step's gradients do not leak into it."""
        if self.data["first_step"] is None:
            self.data["first_step"] = step  # > 0 after --resume
        try:
            yield
        except Exception as exc:  # noqa: BLE001 - recorded, then re-raised unless keep_going
            self.record_error(step, exc)
            if not self.keep_going:
                self.write()
                raise

    def record_error(self, step: int, exc: BaseException) -> None:
        alarm = getattr(exc, "alarm", None)
        if alarm is not None:
            self.data["alarms"].append(alarm)
        error = {"step": step, "type": type(exc).__name__, "message": str(exc)}
        if hasattr(exc, "ranks"):  # NonFiniteGradient
            error.update(ranks={str(r): m for r, m in exc.ranks.items()}, confirmed=exc.confirmed)
        if alarm is None and not hasattr(exc, "ranks"):
            error["traceback"] = traceback.format_exc()
        self.data["errors"].append(error)

    def finish(self, model: torch.nn.Module, iter_num: int, **extra: Any) -> None:
        self.data["final_step"] = iter_num
        self.data["model"] = type(model).__name__  # OptimizedModule under --compile
        # a sharded model's digest is this rank's shards' (DTensor.to_local)
        self.data["weights_digest"] = digest(fingerprint(getattr(p, "to_local", p.detach)().detach())
                                             for p in model.parameters()).hex()
        self.data.update(extra)
        self.write()

    def write(self) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.path.with_name(f".{self.path.name}.tmp")
        tmp.write_text(json.dumps(self.data, indent=1, sort_keys=True, default=str))
        os.replace(tmp, self.path)
