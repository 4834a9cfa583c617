"""What the example's two scripts share besides the job itself: the flags, and the run with its
per-rank result file (losses, the final weights' digest, alarms) that the tests read."""
from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

import torch


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description="A tiny torchtitan llama3 job on CPU/gloo (torchrun).")
    add = p.add_argument
    add("--replicate", type=int, default=2, help="data_parallel_replicate_degree")
    add("--shard", type=int, default=2, help="data_parallel_shard_degree")
    add("--tp", type=int, default=1, help="tensor_parallel_degree (the fastest mesh dimension)")
    add("--pp", type=int, default=1, help="pipeline_parallel_degree (the slowest mesh dimension)")
    add("--pp-schedule", default="1F1B", help="pipeline_parallel_schedule (GPipe, 1F1B, Interleaved1F1B, ...)")
    add("--layers", type=int, default=2, help="the tiny llama3's layers (a pipeline needs one per stage at least)")
    add("--steps", type=int, default=6)
    add("--accum", type=int, default=2, help="gradient accumulation steps (global_batch_size / local / dp)")
    add("--batch-size", type=int, default=2, help="local_batch_size")
    add("--seq-len", type=int, default=16)
    add("--lr", type=float, default=8e-4)
    add("--max-norm", type=float, default=1.0)
    add("--seed", type=int, default=0)
    add("--mixed-precision-param", default="float32", choices=["float32", "bfloat16"],
        help="training.mixed_precision_param: FSDP2's parameter dtype in forward and backward (torchtitan's "
             "default is bfloat16; the gradients are reduced in float32)")
    add("--compile", action="store_true", help="compile.enable (torchtitan compiles each block and the loss)")
    add("--spmd-backend", default="partial_dtensor", help="parallelism.spmd_backend (torchtitan default: spmd_types)")
    add("--checkpoint-every", type=int, default=0, help="checkpoint.interval; 0: no checkpoints")
    add("--out", default="out-torchtitan", help="dump_folder: checkpoints and per-rank result files")
    add("--audit-every", type=int, default=3, help="sdcguard: replay audit every N steps (SDCGUARD_* wins)")
    add("--weight-check-every", type=int, default=1, help="sdcguard: weight check every N steps")
    add("--ranks-per-node", type=int, default=None,
        help="sdcguard: SDCGUARD_RANKS_PER_NODE (one machine posing as nodes of this many ranks: the replay ring "
             "then carries each tensor-parallel group onto the next)")
    add("--inject", action="append", default=[], metavar="SPEC", help="sdcguard: a fault to plant (train.py)")
    add("--keep-going", action="store_true", help="tests: after a step raises an alarm, record it and go on")
    return p.parse_args(argv)


def sdcguard_section(args: argparse.Namespace) -> Any:
    """The ``sdcguard`` section of the job config from the flags (faults only for tests)."""
    import os

    from sdcguard.integrations.torchtitan import SDCGuardConfig
    if args.ranks_per_node is not None:  # the variable the operator's webhook sets on a real node
        os.environ["SDCGUARD_RANKS_PER_NODE"] = str(args.ranks_per_node)
    return SDCGuardConfig(audit_every=args.audit_every, weight_check_every=args.weight_check_every,
                          inject=list(args.inject))


def run(config: Any, args: argparse.Namespace) -> None:
    """torchtitan's own ``train.py`` main, with the result file written at the end (also after an
    error, which is then re-raised)."""
    from torchtitan.tools.logging import init_logger
    init_logger()
    torch.set_num_threads(1)
    trainer = None
    error: BaseException | None = None
    try:
        trainer = config.build()
        _record_losses(trainer)
        if args.keep_going:
            _keep_going(trainer)
        trainer.train()
    except BaseException as exc:  # noqa: BLE001 - recorded, then re-raised
        error = exc
    finally:
        if trainer is not None:
            _write(trainer, args, error)
            trainer.close()
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()
    if error is not None and not getattr(error, "alarm", None):
        raise error


def _record_losses(trainer: Any) -> None:
    """Keep each step's global average loss as torchtitan's metrics processor logs it."""
    trainer.losses = {}
    log = trainer.metrics_processor.log

    def logged(step: int, global_avg_loss: float, *rest: Any, **kwargs: Any) -> Any:
        trainer.losses[step] = global_avg_loss
        return log(step, global_avg_loss, *rest, **kwargs)

    trainer.metrics_processor.log = logged


def _keep_going(trainer: Any) -> None:
    """Tests: a step that raises SDCDetected / NonFiniteGradient (on every rank alike) is recorded
    and the run goes on with the next one (several faults in one run); the step was not applied."""
    import sdcguard
    trainer.alarms, trainer.errors = [], []
    step = trainer.train_step

    def kept(data_iterator: Any) -> None:
        try:
            step(data_iterator)
        except (sdcguard.SDCDetected, sdcguard.NonFiniteGradient) as exc:
            if getattr(exc, "alarm", None) is not None:
                trainer.alarms.append(exc.alarm)
            trainer.errors.append({"step": trainer.step, "type": type(exc).__name__})

    trainer.train_step = kept


def _write(trainer: Any, args: argparse.Namespace, error: BaseException | None) -> None:
    from sdcguard.fingerprint import digest, fingerprint
    rank = torch.distributed.get_rank()
    data: dict[str, Any] = {
        "rank": rank, "step": trainer.step,
        "losses": getattr(trainer, "losses", {}),
        "weights_digest": digest(fingerprint(getattr(p, "to_local", p.detach)().detach())
                                 for model in trainer.model_parts for p in model.parameters()).hex(),
        "alarm": getattr(error, "alarm", None),
        "alarms": getattr(trainer, "alarms", []), "errors": getattr(trainer, "errors", []),
        "error": None if error is None else f"{type(error).__name__}: {error}",
    }
    guard = getattr(trainer, "guard", None)
    if guard is not None:
        data.update(last_audited=guard.history.last_audited_step, last_weights_verified=guard.last_weights_verified_step,
                    last_reduction_verified=guard.history.last_reduction_verified_step,
                    plan=guard.plan_lines())
    injector = getattr(trainer, "injector", None)
    data["fired"] = injector.fired if injector is not None else []
    path = Path(args.out) / f"result-rank{rank}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=1, sort_keys=True, default=str))
