"""One rank of a drill: real DDP training of the drill model, with faults injected.

Started by ``sdcguard drill`` as ``python -m sdcguard.drill.worker CONFIG.json`` with ``RANK``,
``WORLD_SIZE``, ``LOCAL_WORLD_SIZE`` and ``NODE_NAME`` set; writes ``rank-<r>.json`` when done.
"""
from __future__ import annotations

import copy
import datetime
import json
import logging
import os
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from ..config import Config
from .model import DrillModel, loss_fn, make_batch
from ..errors import SDCDetected
from ..faults.spec import FaultSpec
from ..fingerprint import digest, fingerprint
from ..guard import Guard
from ..faults.injector import FaultInjector


def main(config_path: str) -> int:
    cfg = json.loads(Path(config_path).read_text())
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    logging.basicConfig(level=logging.WARNING, format=f"[drill] [rank {rank}] %(message)s")
    logging.getLogger("sdcguard").setLevel(logging.CRITICAL)  # the drill prints its own timeline
    torch.set_num_threads(1)  # equal thread counts make every rank's arithmetic bit-identical
    dist.init_process_group(
        cfg["backend"], init_method=f"file://{cfg['workdir']}/store", rank=rank, world_size=world,
        timeout=datetime.timedelta(seconds=cfg["timeout_s"]),
    )
    try:
        result = train(cfg, rank)
    finally:
        dist.destroy_process_group()
    Path(cfg["workdir"], f"rank-{rank}.json").write_text(json.dumps(result))
    return 0


@dataclass(slots=True)
class Trainer:
    """One incarnation of the training job: a resume after an alarm builds a new one."""

    model: DrillModel
    optimizer: torch.optim.Optimizer
    guard: Guard


def build(cfg: dict[str, Any], rank: int, device: torch.device, injector: FaultInjector) -> Trainer:
    torch.manual_seed(cfg["seed"])
    model = DrillModel().to(device)
    ddp = DistributedDataParallel(model, device_ids=[device.index] if device.type == "cuda" else None)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    injector.install(model.activation_site, model.fault_parameter, optimizer)
    guard = Guard(
        ddp, optimizer, _on_device(loss_fn, device),
        config=Config.from_env(audit_every=cfg["audit_every"], weight_check_every=cfg["weight_check_every"],
                               spool=cfg["spool"], seed=cfg["seed"]),
        reduce_hook=injector.reduce_hook, reduce_state=ddp.process_group,
    )
    return Trainer(model, optimizer, guard)


def train(cfg: dict[str, Any], rank: int) -> dict[str, Any]:
    """The drill's training loop; returns what this rank saw.

    With ``on_alarm: resume`` an alarm stands for the whole recovery loop: the suspects' nodes are
    "replaced" (their faults disarmed), a new job is built, and it resumes from the alarm's
    ``last_good_checkpoint`` (with ``checkpoint_every``) or else from an in-memory copy of the
    last verified weights."""
    device = torch.device("cuda", rank % torch.cuda.device_count()) if cfg["backend"] == "nccl" else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    injector = FaultInjector([FaultSpec(**f) for f in cfg["faults"]], rank)
    job = build(cfg, rank, device, injector)
    snapshot = _snapshot(-1, job)  # DDP broadcast rank 0's weights: all replicas start equal
    alarms: list[str] = []
    resumed_from: list[str | None] = []
    stopped_at = None
    step = 0
    while step < cfg["steps"]:
        injector.begin_step(step)
        batches = [make_batch(cfg["seed"], step, rank, m) for m in range(cfg["micro_batches"])]
        try:
            loss = job.guard.train_step(step, micro_batches=batches)
        except SDCDetected as exc:
            alarms.append(exc.alarm["id"])
            reporter = rank == job.guard.topology.reporter(exc.suspect_ranks)
            if reporter:
                print(f"[drill] step {step:4d}  ALARM {exc}", flush=True)
            if cfg["on_alarm"] == "stop":
                stopped_at = step
                break
            injector.disarm(exc.suspect_ranks)
            job = build(cfg, rank, device, injector)
            checkpoint = exc.alarm["last_good_checkpoint"] if cfg["checkpoint_every"] else None
            resumed_from.append(checkpoint)
            step = (job.guard.load_checkpoint(checkpoint) if checkpoint else _restore(snapshot, job)) + 1
            if reporter:
                print(f"[drill] suspects replaced; resuming after verified step {step - 1}"
                      + (f" from {Path(checkpoint).name}" if checkpoint else ""), flush=True)
            continue
        if cfg["checkpoint_every"] and step % cfg["checkpoint_every"] == 0:
            job.guard.save_checkpoint(str(Path(cfg["workdir"], "checkpoints", f"step-{step}.pt")), step)
        elif not cfg["checkpoint_every"] and job.guard.last_weights_verified_step == step:
            snapshot = _snapshot(step, job)
        if rank == 0 and (step % cfg["print_every"] == 0 or step == cfg["steps"] - 1):
            print(f"[drill] step {step:4d}  loss {float(loss):.4f}", flush=True)
        step += 1
    job.guard.flush_stats()
    return {
        "rank": rank,
        "fired": injector.fired,
        "alarms": alarms,
        "resumed_from": [Path(c).name if c else None for c in resumed_from],
        "steps_completed": stopped_at if stopped_at is not None else cfg["steps"],
        "stopped_at_step": stopped_at,
        "final_weights": digest(fingerprint(p) for p in job.model.parameters()).hex(),
    }


def _on_device(fn: Any, device: torch.device) -> Any:
    if device.type == "cpu":
        return fn
    return lambda module, batch: fn(module, tuple(t.to(device) for t in batch))


def _snapshot(step: int, job: Trainer) -> tuple[int, Any, Any]:
    return step, copy.deepcopy(job.model.state_dict()), copy.deepcopy(job.optimizer.state_dict())


def _restore(snapshot: tuple[int, Any, Any], job: Trainer) -> int:
    step, weights, state = snapshot
    job.model.load_state_dict(weights)
    job.optimizer.load_state_dict(copy.deepcopy(state))
    return step


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
