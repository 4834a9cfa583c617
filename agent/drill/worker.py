"""One rank of a drill: real DDP training of the drill model, with faults injected; with ``shard``
in the config, the model sharded by FSDP2 instead (``fully_shard`` per layer, then the root) over
the ``(replicate, shard)`` mesh of consecutive ranks the drill's parent checked; with ``pp``, the
model split into pipeline stages replicated by DDP or sharded by FSDP2 (``drill/pipeline.py``).

Started by ``sdcguard drill`` as ``python -m sdcguard.drill.worker CONFIG.json`` with ``RANK`` and
``WORLD_SIZE`` set; everything else (the checks' settings, the spool, each rank's pod and node)
comes from the drill's CONFIG, never from the environment. Writes ``rank-<r>.json`` when done.
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

from ..child_process import exit_without_finalizing
from ..config import Config
from ..contract import names
from .model import PARAM, SITE, TP_PLAN, DrillModel, loss_fn, make_batch
from ..errors import SDCDetected
from ..faults.judge import suspect_window
from ..faults.spec import FaultSpec
from ..fingerprint import digest, fingerprint
from ..buckets import settle_buckets
from ..guard import Guard
from ..recovery import History
from ..faults.injector import FaultInjector
from ..faults.sharded import ShardedFaultInjector
from . import pipeline


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
        result = train(cfg, rank, _device_mesh(cfg))
    finally:
        dist.destroy_process_group()
    Path(cfg["workdir"], f"rank-{rank}.json").write_text(json.dumps(result))
    return 0


def _device_mesh(cfg: dict[str, Any]) -> Any:
    """The sharded drill's mesh (made once: every rebuilt job reuses it), or None for DDP. Rank r
    is shard r % S of replica r // S: a shard group is S consecutive ranks, as torchtitan lays
    ``(dp_replicate, dp_shard)`` out."""
    from torch.distributed.device_mesh import init_device_mesh
    kind = "cuda" if cfg["backend"] == "nccl" else "cpu"
    if cfg.get("pp") and cfg.get("shard"):  # rank r: stage r % M of pipeline r // M, FSDP2 over each stage
        return init_device_mesh(kind, (cfg["replicate"], cfg["shard"], cfg["pp"]),
                                mesh_dim_names=("dp_replicate", "dp_shard", "pp"))
    if cfg.get("pp"):  # rank r: stage r % M of replica r // M (drill/pipeline.py)
        return init_device_mesh(kind, (cfg["replicate"], cfg["pp"]), mesh_dim_names=("dp", "pp"))
    if not cfg.get("shard"):
        return None
    if cfg.get("tp", 1) > 1:  # rank r: TP rank r % T; torchtitan's (dp_replicate, dp_shard, tp) order
        return init_device_mesh(kind, (cfg["replicate"], cfg["shard"], cfg["tp"]),
                                mesh_dim_names=("replicate", "shard", "tp"))
    if cfg["replicate"] > 1:
        return init_device_mesh(kind, (cfg["replicate"], cfg["shard"]), mesh_dim_names=("replicate", "shard"))
    return init_device_mesh(kind, (cfg["shard"],), mesh_dim_names=("shard",))


@dataclass(slots=True)
class Trainer:
    """One incarnation of the training job: a resume after an alarm builds a new one."""

    model: DrillModel
    optimizer: torch.optim.Optimizer
    guard: Guard


@dataclass(frozen=True, slots=True)
class Snapshot:
    """The state after ``step``'s update (-1: the start), kept in memory once check 3 passed on it."""

    step: int
    audited_step: int | None
    """The last passing audit at or before ``step``."""
    reduction_verified_step: int | None
    """The last step whose all-reduce check 4 verified."""
    model: dict[str, Any]
    optimizer: dict[str, Any]


def build(cfg: dict[str, Any], rank: int, device: torch.device, injector: Any, mesh: Any = None) -> Trainer:
    if cfg.get("pp"):
        return pipeline.build(cfg, rank, device, injector, mesh)  # type: ignore[return-value]
    if mesh is not None:
        return build_sharded(cfg, rank, device, injector, mesh)
    torch.manual_seed(cfg["seed"])
    model = DrillModel().to(device)
    ddp = DistributedDataParallel(model, device_ids=[device.index] if device.type == "cuda" else None)
    # Every job of the drill (the first and each resumed one) settles DDP's buckets the same way,
    # so a recovered run reduces every step as the clean run does.
    settle_buckets(ddp, _on_device(loss_fn, device), make_batch(cfg["seed"], 0, 0, 0))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    injector.install(model, optimizer, site=SITE, param=PARAM)
    reduce_hook, reduce_state = injector.reduce_hook_around(inner_state=ddp.process_group)
    guard = Guard(ddp, optimizer, _on_device(loss_fn, device), config=drill_config(cfg, rank),
                  reduce_hook=reduce_hook, reduce_state=reduce_state)
    return Trainer(model, optimizer, guard)


def build_sharded(cfg: dict[str, Any], rank: int, device: torch.device, injector: ShardedFaultInjector,
                  mesh: Any) -> Trainer:
    """The drill model sharded by FSDP2: one unit per layer, then the root (the LayerNorm's
    parameters); every rank starts from the same seeded weights and keeps its shard of them."""
    from torch.distributed.fsdp import fully_shard
    torch.manual_seed(cfg["seed"])
    model = DrillModel().to(device)
    if cfg.get("tp", 1) > 1:  # tensor parallel first, then FSDP2 over the data-parallel dimensions
        from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module
        styles = {"colwise": ColwiseParallel, "rowwise": RowwiseParallel}
        parallelize_module(model, mesh["tp"], {layer: styles[style]() for layer, style in TP_PLAN.items()})
        mesh = mesh["replicate", "shard"] if cfg["replicate"] > 1 else mesh["shard"]
    for layer in (model.embed, model.hidden, model.head):
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    guard = Guard(model, optimizer, _on_device(loss_fn, device), config=drill_config(cfg, rank))
    injector.install(guard, site=SITE, param=PARAM)
    return Trainer(model, optimizer, guard)


def drill_config(cfg: dict[str, Any], rank: int) -> Config:
    """The checks' settings from the drill's own flags only — never from ``SDCGUARD_*``, ``POD_NAME``
    or ``NODE_NAME``: inside an enabled pod those are the job's, and its spool is the sidecar's."""
    node = rank // cfg["ranks_per_node"]
    placement = cfg.get("placement")
    pod = node_name = pod_uid = job = None
    if placement:
        where = placement["nodes"][node]
        pod, node_name, pod_uid = where["pod"], where["node"], where.get("pod_uid")
        job = {"kind": names.JOB_KIND, "name": placement["job"], "namespace": placement["namespace"],
               **({"uid": placement["job_uid"]} if placement.get("job_uid") else {})}
    return Config(audit_every=cfg["audit_every"], weight_check_every=cfg["weight_check_every"],
                  spool=cfg["spool"], seed=cfg["seed"], ranks_per_node=cfg["ranks_per_node"],
                  pod=pod, node=node_name or f"drill-node-{node}", pod_uid=pod_uid, job=job, drill=True)


def train(cfg: dict[str, Any], rank: int, mesh: Any = None) -> dict[str, Any]:
    """The drill's training loop; returns what this rank saw.

    An alarm raised anywhere in a step — a check inside ``train_step`` or check 3 inside
    ``save_checkpoint`` — stops the run (``on_alarm: stop``) or stands for the whole recovery loop
    (``resume``): the suspects' nodes are "replaced" (their faults disarmed), a new job is built,
    and it resumes from the alarm's ``last_good_checkpoint`` (with ``checkpoint_every``; from the
    start when it names none) or else from the newest in-memory copy of verified weights older
    than the alarm's suspect window."""
    device = torch.device("cuda", rank % torch.cuda.device_count()) if cfg["backend"] == "nccl" else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    specs = [FaultSpec(**f) for f in cfg["faults"]]
    if cfg.get("pp"):  # the faults striking this rank's stage, targets spelled out
        mine = pipeline.faults_of_rank(specs, rank, cfg["pp"], cfg["schedule"])
        injector: Any = ShardedFaultInjector(mine, rank) if cfg.get("shard") else FaultInjector(mine, rank)
    else:
        injector = ShardedFaultInjector(specs, rank) if mesh is not None else FaultInjector(specs, rank)
    job = build(cfg, rank, device, injector, mesh)
    snapshots: list[Snapshot] = [_snapshot(-1, job)]  # DDP broadcast rank 0's weights (FSDP2: same seed): replicas start equal
    alarms: list[str] = []
    recoveries: list[dict[str, Any]] = []
    stopped_at = None
    step = 0
    while step < cfg["steps"]:
        try:
            loss = _step(cfg, job, injector, rank, step)
        except SDCDetected as exc:
            alarms.append(exc.alarm["id"])
            reporter = rank == job.guard.topology.reporter(exc.suspect_ranks)
            if reporter:
                print(f"[drill] step {step:4d}  ALARM {exc}", flush=True)
            if cfg["on_alarm"] == "stop":
                stopped_at = step
                break
            injector.disarm(exc.suspect_ranks)
            job = build(cfg, rank, device, injector, mesh)
            resumed, checkpoint = _resume(cfg, job, exc.alarm, snapshots)
            snapshots = [s for s in snapshots if s.step <= resumed]  # later ones belong to the abandoned run
            recoveries.append({"alarm": exc.alarm["id"], "step": exc.step, "resume_step": resumed,
                               "resumed_from": checkpoint})
            if reporter:
                print(f"[drill] suspects replaced; resuming after step {resumed}"
                      + (f" from {checkpoint}" if checkpoint else " (the start)" if resumed < 0 else ""), flush=True)
            step = resumed + 1
            continue
        if not cfg["checkpoint_every"] and job.guard.last_weights_verified_step == step:
            snapshots.append(_snapshot(step, job))  # check 3 passed on the weights after this update
        if rank == 0 and (step % cfg["print_every"] == 0 or step == cfg["steps"] - 1):
            print(f"[drill] step {step:4d}  loss {float(loss):.4f}", flush=True)
        step += 1
    job.guard.flush_stats()
    return {
        "rank": rank,
        "fired": injector.fired,
        "alarms": alarms,
        "recoveries": recoveries,
        "steps_completed": stopped_at if stopped_at is not None else cfg["steps"],
        "stopped_at_step": stopped_at,
        "final_weights": pipeline.weights_digest(job) if cfg.get("pp") else _weights_digest(job.model),
    }


def _weights_digest(model: torch.nn.Module) -> str:
    """The digest of this rank's copy of the whole model; a sharded model's parameters are first
    gathered from its shard group (a collective: every rank calls it), so replicas that agree give
    one digest on every rank."""
    full = (p.full_tensor() if hasattr(p, "full_tensor") else p for p in model.parameters())
    return digest(fingerprint(p.detach()) for p in full).hex()


def _step(cfg: dict[str, Any], job: Trainer, injector: FaultInjector, rank: int, step: int) -> torch.Tensor:
    """One checked step, and the verified checkpoint after it when one is due."""
    injector.begin_step(step)
    if cfg.get("pp"):
        loss = pipeline.train_step(cfg, job, rank, step)  # type: ignore[arg-type]
    else:
        data_rank = rank // cfg.get("tp", 1)  # a tensor-parallel group trains on one batch
        batches = [make_batch(cfg["seed"], step, data_rank, m) for m in range(cfg["micro_batches"])]
        loss = job.guard.train_step(step, micro_batches=batches)
    if cfg["checkpoint_every"] and step % cfg["checkpoint_every"] == 0:
        # sharded: a DCP directory; pipeline: a directory of one file per stage
        name = f"step-{step}" if cfg.get("shard") or cfg.get("pp") else f"step-{step}.pt"
        job.guard.save_checkpoint(str(Path(cfg.get("checkpoint_dir") or Path(cfg["workdir"], "checkpoints"), name)),
                                  step)
    return loss


def _resume(cfg: dict[str, Any], job: Trainer, alarm: dict[str, Any], snapshots: list[Snapshot]) -> tuple[int, str | None]:
    """Load the state to resume from into ``job``: (its step, the checkpoint file or None)."""
    if cfg["checkpoint_every"]:
        path = alarm.get("last_good_checkpoint")
        if path:  # exactly the file the alarm named, or nothing
            step = job.guard.load_checkpoint(path, expect_step=alarm["last_good_checkpoint_step"],
                                             expect_sha256=alarm.get("last_good_checkpoint_sha256"))
            return step, Path(path).name
        return _restore(snapshots[0], job), None  # nothing verified on disk before the window
    return _restore(resume_point(snapshots, suspect_window(alarm)[0]), job), None


def resume_point(snapshots: list[Snapshot], first_suspect_step: int) -> Snapshot:
    """The newest snapshot taken before the suspect window (never one inside it)."""
    return max((s for s in snapshots if s.step < first_suspect_step), key=lambda s: s.step)


def _on_device(fn: Any, device: torch.device) -> Any:
    if device.type == "cpu":
        return fn
    return lambda module, batch: fn(module, tuple(t.to(device) for t in batch))


def _snapshot(step: int, job: Trainer) -> Snapshot:
    history = job.guard.history
    return Snapshot(step, history.last_audited_step, history.last_reduction_verified_step,
                    copy.deepcopy(job.model.state_dict()), copy.deepcopy(job.optimizer.state_dict()))


def _restore(snapshot: Snapshot, job: Trainer) -> int:
    """Load ``snapshot`` into the new job; its Guard then knows what was verified, as after
    ``load_checkpoint`` (the run starts after the snapshot's step)."""
    job.model.load_state_dict(snapshot.model)
    job.optimizer.load_state_dict(copy.deepcopy(snapshot.optimizer))
    if snapshot.step >= 0:
        job.guard.resumed(snapshot.step, History(last_audited_step=snapshot.audited_step,
                                                 last_weights_verified_step=snapshot.step,
                                                 last_reduction_verified_step=snapshot.reduction_verified_step), None)
    return snapshot.step


if __name__ == "__main__":
    exit_without_finalizing(main(sys.argv[1]))
