"""What the example's two scripts share besides the training loop: the flags, the tiny model and
its data (built in code: nothing is downloaded), the fault injector's wiring and the per-rank
result file the tests read. train_plain.py and train.py use it alike, so that the difference
between them is exactly the port to sdcguard. sdcguard's own settings come from the SDCGUARD_*
variables (``Config.from_env()``), e.g. ``SDCGUARD_AUDIT_EVERY=4 SDCGUARD_WEIGHT_CHECK_EVERY=2``.
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
import torch.distributed as dist

from sdcguard import replaying
from sdcguard.faults import FaultInjector, parse_fault
from sdcguard.fingerprint import digest, fingerprint

SITE = "body.0"          # forward faults strike the first layer's output
PARAM = "body.0.weight"  # gradient / reduction / optimizer / weight faults its weight


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description="Train a tiny classifier in a Lightning Fabric loop (torchrun, gloo).")
    add = p.add_argument
    add("--steps", type=int, default=12, help="optimizer steps")
    add("--accum", type=int, default=2, help="micro-batches per optimizer step (gradient accumulation)")
    add("--batch-size", type=int, default=8, help="samples per micro-batch and rank")
    add("--samples", type=int, default=1024, help="samples in the synthetic data set")
    add("--lr", type=float, default=3e-3)
    add("--max-grad-norm", type=float, default=0.5, help="fabric.clip_gradients(max_norm=)")
    add("--precision", default="32-true", help="Fabric(precision=): 32-true, bf16-mixed, bf16-true, ...")
    add("--save-every", type=int, default=0, help="fabric.save OUT/ckpt.pt every N steps (0: never)")
    add("--resume", metavar="PATH", help="fabric.load this checkpoint first (train.py verifies it)")
    add("--expect-step", type=int, help="the alarm's last_good_checkpoint_step (train.py)")
    add("--expect-sha256", help="the alarm's last_good_checkpoint_sha256 (train.py)")
    add("--seed", type=int, default=0)
    add("--out", default="out-fabric", help="checkpoints and per-rank result files")
    add("--inject", action="append", default=[], metavar="SPEC",
        help="fault to inject, KIND:rank=R:step=S[:magnitude=X] (train.py only; repeatable)")
    return p.parse_args(argv)


class Net(torch.nn.Module):
    """Linear, LayerNorm, GELU, Linear: small, with a normalisation that autocast keeps in float32."""

    def __init__(self) -> None:
        super().__init__()
        self.body = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.LayerNorm(32), torch.nn.GELU(),
                                        torch.nn.Linear(32, 4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.body(x)


def build_model(args: argparse.Namespace) -> Net:
    torch.manual_seed(args.seed)  # the same initial weights on every rank
    return Net()


def build_loader(args: argparse.Namespace) -> torch.utils.data.DataLoader:
    """Random points labelled by a fixed random projection: learnable, the same on every run."""
    g = torch.Generator().manual_seed(1234)
    x = torch.randn(args.samples, 16, generator=g)
    y = (x @ torch.randn(16, 4, generator=g)).argmax(dim=1)
    return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=args.batch_size)


class Harness:
    """This rank's record of the run (``OUT/result-rank<R>.json``) and, for train.py, its faults."""

    def __init__(self, args: argparse.Namespace, teardown: bool = True) -> None:
        self.args = args
        self.teardown = teardown
        self.rank = int(os.environ.get("RANK", "0"))
        self.path = Path(args.out) / f"result-rank{self.rank}.json"
        world = int(os.environ.get("WORLD_SIZE", "1"))
        self.injector = FaultInjector([parse_fault(s, world) for s in args.inject], self.rank)
        self.module: torch.nn.Module | None = None
        self._hooked = False
        self._losses: list[float] = []
        self.data: dict[str, Any] = {"rank": self.rank, "losses": {}, "weights": {}, "alarms": [], "errors": [],
                                     "final_step": None, "start": 0}

    @property
    def reduce_hook(self) -> Any:
        """For train.py's Guard: DDP's average with the planted ``reduce-*`` faults (None without faults)."""
        self._hooked = True
        return self.injector.reduce_hook if self.injector.faults else None

    def watch(self, model: Any, optimizer: Any) -> None:
        """What ``fabric.setup`` returned: the faults go on the bare module and the torch optimizer."""
        self.module = model.module
        self.injector.install(self.module, optimizer.optimizer, site=SITE, param=PARAM)

    def settle_batch(self, loader: Any) -> Any:
        """For a resumed train.py: a micro-batch of the usual shape (its loader's first, drawn
        without advancing Fabric's epoch count), else None."""
        return next(iter(loader._dataloader)) if self.args.resume else None

    def batches(self, loader: Any, start: int) -> Iterator[list[Any]]:
        """``--accum`` micro-batches per step, epoch after epoch; a resumed run skips the steps it has."""
        seen, pending = 0, []
        while True:
            for micro in loader:
                seen += 1
                if seen <= start * self.args.accum:
                    continue
                pending.append(micro)
                if len(pending) == self.args.accum:
                    yield pending
                    pending = []

    def loss(self, loss: torch.Tensor) -> torch.Tensor:
        """Called by loss_fn: record this rank's micro-batch loss (not a replay's)."""
        if not replaying():
            self._losses.append(float(loss.detach().float()))
        return loss

    @contextlib.contextmanager
    def step(self, step: int) -> Iterator[None]:
        """Around one optimizer step: the injector's step, then (if it completed) the weights."""
        if self.injector.faults and not self._hooked:
            raise SystemExit("train_plain.py plants no faults: --inject is for train.py")
        if not self.data["losses"]:
            self.data["start"] = step
        self.injector.begin_step(step)
        self._losses = []
        yield
        assert self.module is not None
        self.data["losses"][step] = self._losses
        self.data["weights"][step] = _digest(self.module)
        self.data["final_step"] = step

    @contextlib.contextmanager
    def run(self) -> Iterator[None]:
        """Record what training raises (an alarm stops every rank alike), then the final state."""
        try:
            yield
        except Exception as exc:  # noqa: BLE001 - recorded for the tests, the run then ends cleanly
            alarm = getattr(exc, "alarm", None)
            if alarm is not None:
                self.data["alarms"].append(alarm)
            error = {"type": type(exc).__name__, "message": str(exc)}
            if hasattr(exc, "ranks"):  # NonFiniteGradient
                error.update(ranks={str(r): m for r, m in exc.ranks.items()}, confirmed=exc.confirmed)
            elif alarm is None:
                error["traceback"] = traceback.format_exc()
            self.data["errors"].append(error)
            if self.rank == 0:
                print(f"rank {self.rank}: {type(exc).__name__}: {exc}")
        if self.module is not None:
            self.data["weights_digest"] = _digest(self.module)
        self.data["fired"] = self.injector.fired
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.path.write_text(json.dumps(self.data, indent=1, sort_keys=True, default=str))
        if dist.is_initialized():
            dist.barrier()
            if self.teardown:
                dist.destroy_process_group()


def _digest(model: torch.nn.Module) -> str:
    return digest(fingerprint(p.detach()) for p in model.parameters()).hex()
