"""The pipeline drill (``sdcguard drill --pp M --replicate R``): the drill model split into M
stages (``torch.distributed.pipelining``; 2M under ``--schedule interleaved``, two per rank), each
stage replicated R times by DDP, under sdcguard's :class:`~sdcguard.layouts.pipeline.Pipeline` layout.
With ``--shard S`` each stage is sharded by FSDP2 instead (``fully_shard`` per layer with
parameters, then the stage) over the R x S ranks holding it: pure FSDP (R = 1: check 3 has no
replica to compare) or HSDP (R >= 2).

Rank ``r`` holds stage ``r % M`` of replica ``r // M``: a replica's pipeline is M consecutive
ranks (a ``("dp", "pp")`` mesh; sharded, ``("dp_replicate", "dp_shard", "pp")``: pipeline ``r // M``
is shard ``(r // M) % S`` of data-parallel replica ``r // (M S)``), so with M dividing
``--ranks-per-node`` (or a multiple of it) each
replica's stages share nodes and the replay ring — the same stage of another replica — crosses
nodes (the layout picks the ring itself, ``checks/pipeline.ring_shift``). A fault names a target
its rank's stage holds; without ``site=`` / ``param=`` it strikes its stage's default (the
stage's first layer's output, the hidden layer's weight where the stage holds it, else the
stage's first layer's weight). A ``reduce-*`` fault without a rank strikes the stage that holds
its parameter, on every replica.

The split, the fault placement and their refusals need no process; :func:`build` and
:func:`train_step` run inside a drill worker.
"""
from __future__ import annotations

import dataclasses
import hashlib
from typing import Any, Iterable

import torch
import torch.nn.functional as F
from torch import nn

from ..faults.spec import FaultSpec, FaultTargetError
from .model import PARAM

STAGE_LAYERS: dict[int, tuple[tuple[str, ...], ...]] = {
    2: (("embed", "norm", "drop"), ("hidden", "head")),
    3: (("embed", "norm", "drop"), ("hidden",), ("head",)),
}
"""The drill model's layers per stage, for each pipeline size (the last stage holds the head; the
schedule computes the loss there). The model has three linear layers: at most three stages."""

INTERLEAVED_LAYERS: dict[int, tuple[tuple[str, ...], ...]] = {
    2: (("embed",), ("norm", "drop"), ("hidden",), ("head",)),
}
"""``--schedule interleaved``: two stages per rank (looped, as torchtitan lays them out: position
``p`` holds stages ``p`` and ``p + M``), so 2M stages; the drill model has four parts: M = 2 only."""

SCHEDULES = ("1f1b", "gpipe", "interleaved")
LAYERS = ("embed", "norm", "drop", "hidden", "head")


# -- pure: the split and where faults strike ---------------------------------------------------------

def position_of(rank: int, pp: int) -> int:
    """The pipeline position of ``rank`` (its stage; stages under interleaving): a replica is
    ``pp`` consecutive ranks."""
    return rank % pp


def replica_of(rank: int, pp: int) -> int:
    return rank // pp


def stage_table(pp: int, schedule: str = "1f1b") -> tuple[tuple[str, ...], ...]:
    """The layers of each stage (by stage index)."""
    return INTERLEAVED_LAYERS[pp] if schedule == "interleaved" else STAGE_LAYERS[pp]


def stages_at(position: int, pp: int, schedule: str = "1f1b") -> tuple[int, ...]:
    """The stage indices a pipeline position holds."""
    return tuple(range(position, len(stage_table(pp, schedule)), pp))


def layers_at(position: int, pp: int, schedule: str = "1f1b") -> tuple[str, ...]:
    table = stage_table(pp, schedule)
    return tuple(layer for k in stages_at(position, pp, schedule) for layer in table[k])


def stage_holding(name: str, pp: int, schedule: str = "1f1b") -> int | None:
    """The stage holding module or parameter ``name`` (``module.`` prefixes allowed), or None."""
    parts = [p for p in name.split(".") if p != "module"]
    layer = parts[0] if parts else ""
    return next((k for k, layers in enumerate(stage_table(pp, schedule)) if layer in layers), None)


def stage_defaults(position: int, pp: int, schedule: str = "1f1b") -> tuple[str, str]:
    """(forward site, parameter) a fault on ``position`` strikes unless it names its own target."""
    layers = layers_at(position, pp, schedule)
    linear = next(layer for layer in layers if layer in ("embed", "hidden", "head"))
    return layers[0], PARAM if PARAM.split(".")[0] in layers else f"{linear}.weight"


def resolve_fault(fault: FaultSpec, pp: int, schedule: str = "1f1b") -> FaultSpec:
    """``fault`` with its target spelled out (``site=`` or ``param=``); raises
    :class:`FaultTargetError` when its rank's stage does not hold what it names."""
    forward = fault.info.corrupts == "forward"
    named = fault.site if forward else fault.param
    position = None if fault.rank is None else position_of(fault.rank, pp)
    if named is None:
        named = stage_defaults(position, pp, schedule)[0 if forward else 1] if position is not None else PARAM
    holder = stage_holding(named, pp, schedule)
    if holder is None:
        raise FaultTargetError(f"{fault}: the drill model has no {named!r} (its layers: {', '.join(LAYERS)})")
    if position is not None and holder % pp != position:
        held = stages_at(position, pp, schedule)
        what = f"stage{'s' if len(held) > 1 else ''} {', '.join(map(str, held))}"
        raise FaultTargetError(
            f"{fault}: rank {fault.rank} holds pipeline {what} ({', '.join(layers_at(position, pp, schedule))}) "
            f"of replica {replica_of(fault.rank, pp)}; {named} is in stage {holder}: name a target of {what}, "
            f"or a rank holding stage {holder} (rank % {pp} == {holder % pp})")
    return dataclasses.replace(fault, **({"site": named} if forward else {"param": named}))


def faults_of_rank(faults: Iterable[FaultSpec], rank: int, pp: int, schedule: str = "1f1b") -> list[FaultSpec]:
    """The faults striking ``rank``'s stages, targets spelled out (a rank-less ``reduce-*`` fault
    strikes only the ranks holding its parameter)."""
    out = []
    for fault in faults:
        if not fault.hits_rank(rank):
            continue
        resolved = resolve_fault(fault, pp, schedule)
        target = resolved.site if resolved.info.corrupts == "forward" else resolved.param
        if stage_holding(target, pp, schedule) % pp == position_of(rank, pp):  # type: ignore[operator]
            out.append(resolved)
    return out


def check_faults(faults: Iterable[FaultSpec], pp: int, schedule: str = "1f1b", shards: int | None = None) -> None:
    """Every fault against the stage it strikes, before any process starts: the stage must hold
    its target, and the target its element (with ``shards``, FSDP2 over each stage: a fault on a
    rank's local shard, against the shard of each rank it strikes)."""
    from ..faults.injector import FaultInjector
    from ..faults.sharded import check_sharded_fault
    from ..faults.spec import SHARD_SIDE
    from ..faults.targets import resolve_parameter
    from .model import DrillModel
    for fault in faults:
        resolved = resolve_fault(fault, pp, schedule)
        target = resolved.site if resolved.info.corrupts == "forward" else resolved.param
        position = stage_holding(target, pp, schedule) % pp  # type: ignore[operator]
        module = DrillStage(DrillModel(), layers_at(position, pp, schedule))
        optimizer = torch.optim.SGD(module.parameters(), lr=0.0)
        FaultInjector([resolved], resolved.rank or 0).install(module, optimizer)
        if shards is not None and resolved.info.corrupts in SHARD_SIDE:
            name, parameter = resolve_parameter(module, target)  # type: ignore[arg-type]
            check_sharded_fault(resolved, name, tuple(parameter.shape), shards,
                                lambda rank: shard_of(rank, pp, shards), resolved.element or 0)


def shard_of(rank: int, pp: int, shards: int) -> int:
    """The FSDP2 shard of its stage that ``rank`` holds (``--pp M --shard S``)."""
    return replica_of(rank, pp) % shards


# -- the stages and the step (inside a worker) ---------------------------------------------------------

class DrillStage(nn.Module):
    """The layers of one stage of the drill model, under their names in the whole model (so a
    fault's ``param=hidden.weight`` means the same layer with or without ``--pp``); its forward
    is the part of ``DrillModel.forward`` they compute."""

    def __init__(self, model: nn.Module, layers: tuple[str, ...]) -> None:
        super().__init__()
        for name in layers:
            self.add_module(name, getattr(model, name))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if "embed" in self._modules:
            x = self.embed(x)
        if "norm" in self._modules:
            x = self.drop(F.gelu(self.norm(x)))
        if "hidden" in self._modules:
            x = F.gelu(self.hidden(x))
        if "head" in self._modules:
            x = self.head(x)
        return x


def pipeline_loss(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(output, target)


@dataclasses.dataclass(slots=True)
class PipelineTrainer:
    """One incarnation of the pipeline drill's job (the worker's ``Trainer``, plus the schedule)."""

    model: nn.Module
    """This rank's layers, of all its stages (what the optimizer, the faults and ``final_weights`` see)."""
    optimizer: torch.optim.Optimizer
    guard: Any
    schedule: Any
    first: bool
    last: bool
    pp_group: Any
    sharded_replicas: int = 0
    """FSDP2 stages: R, the replicas of each shard (clipping sums every rank's shard); 0: DDP."""


def micro_batches(cfg: dict[str, Any]) -> int:
    """The schedule's micro-batches: ``--micro-batches``, at least one per rank of a pipeline
    (1F1B's minimum), a multiple of M under interleaving."""
    pp = cfg["pp"]
    n = max(cfg["micro_batches"], pp)
    return -(-n // pp) * pp if cfg.get("schedule") == "interleaved" else n


def build(cfg: dict[str, Any], rank: int, device: torch.device, injector: Any, mesh: Any) -> PipelineTrainer:
    """Every rank builds the whole seeded drill model and keeps its stages' layers; DDP over each
    stage's replicas (``find_unused_parameters``: see docs/pipeline.md) or, with ``shard``, FSDP2
    over the ranks holding the stage; the schedule, AdamW, the faults' hooks, and the Guard (DDP:
    with the injector's reduce hook inside sdcguard's; FSDP2: the injector on its recorders)."""
    import torch.distributed.pipelining as pipelining
    from torch.nn.parallel import DistributedDataParallel
    from ..guard import Guard
    from .model import DrillModel
    from .worker import drill_config
    pp, schedule_name = cfg["pp"], cfg.get("schedule", "1f1b")
    torch.manual_seed(cfg["seed"])
    model = DrillModel().to(device)
    position = position_of(rank, pp)
    table = stage_table(pp, schedule_name)
    indices = stages_at(position, pp, schedule_name)
    modules = [DrillStage(model, table[k]) for k in indices]
    mine = DrillStage(model, layers_at(position, pp, schedule_name))  # the same layers, all stages
    pp_group = mesh["pp"].get_group()
    if cfg.get("shard"):
        replicated = shard_stages(modules, mesh, cfg["replicate"])
    else:
        dp_group = mesh["dp"].get_group()
        replicated = [DistributedDataParallel(m, process_group=dp_group, find_unused_parameters=True,
                                              device_ids=[device.index] if device.type == "cuda" else None)
                      for m in modules]
    stages = [pipelining.PipelineStage(d, k, len(table), device, group=pp_group) for d, k in zip(replicated, indices)]
    if schedule_name == "interleaved":
        schedule = pipelining.ScheduleInterleaved1F1B(stages, micro_batches(cfg), loss_fn=pipeline_loss)
    else:
        kind = {"1f1b": pipelining.Schedule1F1B, "gpipe": pipelining.ScheduleGPipe}[schedule_name]
        schedule = kind(stages[0], micro_batches(cfg), loss_fn=pipeline_loss)
    optimizer = torch.optim.AdamW(mine.parameters(), lr=1e-2)
    if cfg.get("shard"):  # FSDP2 stages: the faults strike through each stage's recorder
        guard = Guard(schedule, optimizer, config=drill_config(cfg, rank))
        injector.install(guard, model=mine)  # the faults of this rank's stages, targets spelled out
    else:
        injector.install(mine, optimizer)  # the faults of this rank's stages, targets spelled out
        reduce_hook, reduce_state = injector.reduce_hook_around(inner_state=dp_group)
        guard = Guard(schedule, optimizer, config=drill_config(cfg, rank), reduce_hook=reduce_hook,
                      reduce_state=reduce_state)
    return PipelineTrainer(mine, optimizer, guard, schedule, any(st.is_first for st in stages),
                           any(st.is_last for st in stages), pp_group, cfg["replicate"] if cfg.get("shard") else 0)


def shard_stages(modules: list[nn.Module], mesh: Any, replicate: int) -> list[nn.Module]:
    """FSDP2 over each stage, as torchtitan shards one: ``fully_shard`` on each layer holding
    parameters, then on the stage, over the ranks holding the stage (HSDP's (replicate, shard) mesh;
    pure FSDP's shard mesh when R = 1)."""
    from torch.distributed.fsdp import fully_shard
    dp_mesh = mesh["dp_replicate", "dp_shard"] if replicate > 1 else mesh["dp_shard"]
    for module in modules:
        for child in module.children():
            if any(True for _ in child.parameters()):
                fully_shard(child, mesh=dp_mesh)
        fully_shard(module, mesh=dp_mesh)
    return modules


def train_step(cfg: dict[str, Any], job: PipelineTrainer, rank: int, step: int) -> torch.Tensor:
    """One checked pipeline step: the schedule under ``guard.step``, clipping over the pipeline
    (every stage's squared norms summed over the pipeline group), AdamW. Returns the replica's
    mean micro-batch loss (on every stage: for the timeline)."""
    import torch.distributed as dist
    from .model import make_batch
    x, y = make_batch(cfg["seed"], step, replica_of(rank, cfg["pp"]), 0, size=8 * micro_batches(cfg))
    device = next(job.model.parameters()).device
    x, y = x.to(device), y.to(device)
    losses: list[torch.Tensor] = []
    with job.guard.step(step) as s:
        s.run_schedule(*((x,) if job.first else ()), target=y if job.last else None, losses=losses)
        s.check()
        clip_over_pipeline(job.model, job.pp_group, 1.0, job.sharded_replicas)
        job.optimizer.step()
        job.optimizer.zero_grad(set_to_none=True)
    loss = torch.stack(losses).mean() if losses else torch.zeros((), device=device)
    dist.all_reduce(loss, group=job.pp_group)  # only the last stage has it
    return loss


def clip_over_pipeline(module: nn.Module, pp_group: Any, max_norm: float, sharded_replicas: int = 0) -> None:
    """Clip the whole replica's gradient (torchtitan's ``clip_grad_norm_`` under PP): each stage's
    squared norm summed over the pipeline group. FSDP2 stages (``sharded_replicas`` = R): each
    rank's local shards summed over the whole job, where every shard is held R times."""
    import torch.distributed as dist
    grads = [p.grad for p in module.parameters() if p.grad is not None]
    total = torch.stack([_local(g).pow(2).sum() for g in grads]).sum()
    if sharded_replicas:
        dist.all_reduce(total)
        total = total / sharded_replicas
    else:
        dist.all_reduce(total, group=pp_group)
    coef = min(1.0, max_norm / (float(total.sqrt()) + 1e-6))
    for g in grads:
        g.mul_(coef)


def weights_digest(job: PipelineTrainer) -> str:
    """The digest of the whole model, stage by stage (a collective over the pipeline group): the
    same on every rank when the replicas of every stage agree."""
    import torch.distributed as dist
    from ..fingerprint import digest, fingerprint
    full = (p.full_tensor() if hasattr(p, "full_tensor") else p for p in job.model.parameters())  # FSDP2: gathered
    mine = digest(fingerprint(p.detach()) for p in full).hex()
    every: list[Any] = [None] * dist.get_world_size(job.pp_group)
    dist.all_gather_object(every, mine, group=job.pp_group)
    return hashlib.sha256(":".join(every).encode()).hexdigest()


def _local(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.to_local() if hasattr(tensor, "to_local") else tensor
