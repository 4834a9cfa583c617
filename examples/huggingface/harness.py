"""What the example's two scripts share besides the training itself: the flags, the tiny model and
its data (built in code: nothing is downloaded), the fault injector's wiring and the per-rank
result file the tests read. train_plain.py and train.py use it alike, so that the difference
between them is exactly the port to sdcguard.
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
from transformers import GPT2Config, GPT2LMHeadModel, TrainerCallback

from sdcguard.faults import FaultInjector, parse_fault
from sdcguard.fingerprint import digest, fingerprint

SITE = "transformer.h.0.mlp"              # forward faults strike the first block's MLP output
PARAM = "transformer.h.0.mlp.c_fc.weight"  # gradient / reduction / optimizer / weight faults its first matrix


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description="Fine-tune a tiny GPT-2 with transformers.Trainer (torchrun, gloo).")
    add = p.add_argument
    add("--steps", type=int, default=12, help="optimizer steps (max_steps)")
    add("--batch-size", type=int, default=4, help="sequences per micro-batch and rank")
    add("--accum", type=int, default=2, help="gradient_accumulation_steps")
    add("--seq-len", type=int, default=16)
    add("--samples", type=int, default=512, help="sequences in the synthetic data set")
    add("--lr", type=float, default=1e-3)
    add("--max-grad-norm", type=float, default=1.0)
    add("--save-steps", type=int, default=4, help="checkpoint-N every N steps")
    add("--save-total-limit", type=int, default=2)
    add("--bf16", action="store_true", help="bfloat16 autocast (CPU)")
    add("--dropout", type=float, default=0.0, help="GPT-2's three dropout rates (0: the plain and guarded runs "
        "draw the same numbers; above 0 sdcguard draws the masks from its seeded generator)")
    add("--seed", type=int, default=42)
    add("--out", default="out-hf", help="checkpoint folders and per-rank result files")
    add("--resume", metavar="FOLDER", help="resume from this checkpoint-N folder (train.py verifies it first)")
    add("--audit-every", type=int, default=4, help="sdcguard: replay audit every N steps (SDCGUARD_* wins)")
    add("--weight-check-every", type=int, default=2, help="sdcguard: weight check every N steps")
    add("--inject", action="append", default=[], metavar="SPEC",
        help="fault to inject, KIND:rank=R:step=S[:magnitude=X] (train.py only; repeatable)")
    return p.parse_args(argv)


def build_model(args: argparse.Namespace) -> GPT2LMHeadModel:
    """A 2-layer GPT-2 from a config (no weights downloaded); dropout off by default so that the
    plain and the guarded run draw no random numbers in their forwards and can be compared bit for bit."""
    torch.manual_seed(args.seed)
    config = GPT2Config(vocab_size=64, n_positions=args.seq_len, n_embd=32, n_layer=2, n_head=2,
                        resid_pdrop=args.dropout, embd_pdrop=args.dropout, attn_pdrop=args.dropout,
                        bos_token_id=0, eos_token_id=0)
    config._attn_implementation = "eager"
    return GPT2LMHeadModel(config)


class TokenData(torch.utils.data.Dataset):
    """Arithmetic sequences of tokens (start + k * stride mod 64) with a little noise: learnable."""

    def __init__(self, args: argparse.Namespace) -> None:
        g = torch.Generator().manual_seed(1234)
        start = torch.randint(0, 64, (args.samples, 1), generator=g)
        stride = torch.randint(1, 4, (args.samples, 1), generator=g)
        tokens = (start + stride * torch.arange(args.seq_len)) % 64
        noise = torch.rand(tokens.shape, generator=g) < 0.05
        self.tokens = torch.where(noise, torch.randint(0, 64, tokens.shape, generator=g), tokens)

    def __len__(self) -> int:
        return len(self.tokens)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.tokens[i], "labels": self.tokens[i]}


class Harness(TrainerCallback):
    """This rank's record of the run (``OUT/result-rank<R>.json``) and, for train.py, its faults."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.rank = int(os.environ.get("RANK", "0"))
        self.path = Path(args.out) / f"result-rank{self.rank}.json"
        world = int(os.environ.get("WORLD_SIZE", "1"))
        self.injector = FaultInjector([parse_fault(s, world) for s in args.inject], self.rank)
        self.data: dict[str, Any] = {"rank": self.rank, "losses": {}, "grad_norms": {}, "weights": {},
                                     "alarms": [], "errors": [], "checkpoints": []}

    def on_train_begin(self, args: Any, state: Any, control: Any, model: Any = None, optimizer: Any = None, **kw: Any) -> None:
        self.injector.install(model, getattr(optimizer, "optimizer", optimizer), site=SITE, param=PARAM)

    def on_step_begin(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
        self.injector.begin_step(state.global_step + 1)  # the step this update makes (sdcguard's step)

    def on_step_end(self, args: Any, state: Any, control: Any, model: Any = None, **kw: Any) -> None:
        self.data["weights"][state.global_step] = _digest(model)

    def on_log(self, args: Any, state: Any, control: Any, logs: Any = None, **kw: Any) -> None:
        if logs and "loss" in logs:
            self.data["losses"][state.global_step] = logs["loss"]
            self.data["grad_norms"][state.global_step] = logs.get("grad_norm")

    def on_save(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
        self.data["checkpoints"].append(state.global_step)

    @contextlib.contextmanager
    def run(self, trainer: Any, teardown: bool = True) -> Iterator[None]:
        """Record what training raises (an alarm stops every rank alike), then the final state;
        ``teardown``: end the process group (the tests' worker runs several trainings in one)."""
        if self.injector.faults:
            if not hasattr(trainer, "sdcguard_reduce_hook"):
                raise SystemExit("train_plain.py plants no faults: --inject is for train.py")
            trainer.sdcguard_reduce_hook = self.injector.reduce_hook  # DDP's average, reduce-* faults applied
        try:
            yield
        except Exception as exc:  # noqa: BLE001 - recorded for the tests, the run then ends cleanly
            alarm = getattr(exc, "alarm", None)
            if alarm is not None:
                self.data["alarms"].append(alarm)
            error = {"step": trainer.state.global_step + 1, "type": type(exc).__name__, "message": str(exc)}
            if hasattr(exc, "ranks"):  # NonFiniteGradient
                error.update(ranks={str(r): m for r, m in exc.ranks.items()}, confirmed=exc.confirmed)
            elif alarm is None:
                error["traceback"] = traceback.format_exc()
            self.data["errors"].append(error)
            if self.rank == 0:
                print(f"rank {self.rank}: {type(exc).__name__}: {exc}")
        self.data["final_step"] = trainer.state.global_step
        self.data["weights_digest"] = _digest(trainer.model)
        self.data["fired"] = self.injector.fired
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.path.write_text(json.dumps(self.data, indent=1, sort_keys=True, default=str))
        if teardown and dist.is_initialized():
            dist.barrier()
            dist.destroy_process_group()


def _digest(model: torch.nn.Module) -> str:
    return digest(fingerprint(p.detach()) for p in model.parameters()).hex()
