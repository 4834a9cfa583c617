"""One rank of the pipeline test, launched by tests/test_pipeline.py under torchrun (gloo, CPU,
6 ranks): a ``(pp, dp) = (2, 3)`` mesh built the torchtitan way, each stage module wrapped in DDP
over its data-parallel group (``PP_DP=ddp``), or sharded over it with FSDP2 (``PP_DP=fsdp``: pure
FSDP over 3 ranks; ``PP_DP=hsdp``: HSDP 3 replicas x 1 shard, torchtitan's data-parallel-only
setting), ``torch.distributed.pipelining`` stages and schedules. Scenarios, each writing
OUT/<scenario>-rank<r>.json:

  exact     for GPipe, 1F1B and interleaved 1F1B (two stages per rank): the plain loop (AdamW,
            4 micro-batches, dropout, gradient clipping) against the same loop under guard.step,
            unaudited and audited on every step with check 3 every step: every loss and every
            stage's weights bit for bit, no alarm;
  faults    a scaled activation in one rank's stage-0 forward, in its own passes and its replays
            (check 2 names that rank and stage 0), a nudged gradient in one rank's stage-1 backward
            in its own pass only (check 2 names stage 1's pair: one mismatching pair, no third
            replay of a pipeline, ambiguous), a flipped sign in one rank's stored weights (check 3),
            a NaN once in one rank's stage-1 forward (check 1a: its replica's ranks, ambiguous).
            The schedule's first step is never audited (its shape inference primes DDP's reducer).
"""
import json
import os
import sys

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor
from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe, ScheduleInterleaved1F1B
from torch.nn.parallel import DistributedDataParallel as DDP

import sdcguard
import sdcguard.checkpoint
from sdcguard.checks.replay import replaying
from sdcguard.checks.rng import forward_seed, seeded
from sdcguard.config import Config
from sdcguard.fingerprint import digest, fingerprint

REPLICATION = os.environ.get("PP_DP", "ddp")
SHARDS = 2 if REPLICATION == "hsdp22" else 1
"""``hsdp22``: HSDP 2 replicas x 2 shards over each stage (8 ranks)."""
PP, DP, STEPS, MICRO = 2, 4 if SHARDS == 2 else 3, 3, 4


def local(t):
    return t.to_local() if isinstance(t, DTensor) else t


def replicate(modules, mesh):
    """Each stage module over the ranks holding the same stage: DDP, or FSDP2 per child then root."""
    if REPLICATION == "ddp":
        # find_unused_parameters: on torch 2.13 a plain DDP stage fails its second step (the reducer
        # counts the schedule's shape-inference backward), and with static_graph=True the last stage's
        # gradients are never reduced (its replicas drift apart: check 3 names them) — sdcguard or not
        return [DDP(m, process_group=mesh["dp"].get_group(), find_unused_parameters=True) for m in modules]
    dp_mesh = mesh["dp"] if REPLICATION == "fsdp" else MESH3["dp_replicate", "dp_shard"]  # rows: replicas
    for m in modules:
        for child in m.children():
            if any(True for _ in child.parameters()):
                fully_shard(child, mesh=dp_mesh)
        fully_shard(m, mesh=dp_mesh)
    return modules


def block(i: int) -> nn.Module:
    torch.manual_seed(100 + i)
    return nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Dropout(float(os.environ.get("PP_DROPOUT", "0.1"))), nn.Linear(8, 8))


class Head(nn.Module):
    def __init__(self, i: int) -> None:
        super().__init__()
        torch.manual_seed(100 + i)
        self.body = nn.Sequential(nn.Linear(8, 8), nn.ReLU())
        self.out = nn.Linear(8, 3)

    def forward(self, x):
        return self.out(self.body(x))


def loss_fn(output, target):
    return F.cross_entropy(output, target)


def batch(step, replica, n=8):
    g = torch.Generator().manual_seed(1000 * step + replica)
    x = torch.randn(n, 8, generator=g)
    return x, (x[:, :3] * torch.tensor([1.0, -1.0, 0.5])).argmax(dim=1)


def build(mesh, kind):
    pp_rank = mesh["pp"].get_local_rank()
    stages_per_rank = 2 if kind == "interleaved" else 1
    num_stages = PP * stages_per_rank
    indices = [pp_rank + PP * k for k in range(stages_per_rank)]  # looped, as torchtitan lays them out
    modules = [Head(i) if i == num_stages - 1 else block(i) for i in indices]
    ddps = replicate(modules, mesh)
    stages = [PipelineStage(d, i, num_stages, torch.device("cpu"), group=mesh["pp"].get_group())
              for d, i in zip(ddps, indices)]
    if kind == "gpipe":
        schedule = ScheduleGPipe(stages[0], MICRO, loss_fn=loss_fn)
    elif kind == "1f1b":
        schedule = Schedule1F1B(stages[0], MICRO, loss_fn=loss_fn)
    else:
        schedule = ScheduleInterleaved1F1B(stages, MICRO, loss_fn=loss_fn)
    params = [p for m in modules for p in m.parameters()]
    return schedule, modules, torch.optim.AdamW(params, lr=1e-2), stages


def clip(modules, max_norm=1.0):
    """Clipping over the whole pipeline: the squared norms of every stage summed over the pipeline
    group, as torchtitan's clip_grad_norm_ does under PP."""
    grads = [p.grad for m in modules for p in m.parameters() if p.grad is not None]
    total = torch.stack([local(g).pow(2).sum() for g in grads]).sum()
    if REPLICATION == "ddp":
        dist.all_reduce(total, group=MESH["pp"].get_group())
    else:  # every shard of every stage; HSDP's replicas hold the same shards (counted DP times, divided)
        dist.all_reduce(total)
        total = total / (DP // SHARDS if REPLICATION.startswith("hsdp") else 1)
    coef = min(1.0, max_norm / (float(total.sqrt()) + 1e-6))
    for g in grads:
        g.mul_(coef)


def run_args(stages, step, replica):
    x, y = batch(step, replica)
    first = any(s.is_first for s in stages)
    last = any(s.is_last for s in stages)
    return ((x,) if first else ()), (y if last else None)


def weights_digest(modules):
    return digest(fingerprint(local(p)) for m in modules for p in m.parameters()).hex()


def plain(mesh, kind, rank):
    schedule, modules, opt, stages = build(mesh, kind)
    replica, losses = mesh["dp"].get_local_rank(), []
    for step in range(STEPS):
        args, target = run_args(stages, step, replica)
        mine = []
        with seeded(forward_seed(0, step, rank, 0), torch.device("cpu")):
            schedule.step(*args, target=target, losses=mine)
        losses += [loss.detach().view(torch.int32).item() for loss in mine]
        clip(modules)
        opt.step()
        opt.zero_grad(set_to_none=True)
    return losses, weights_digest(modules)


def guarded(mesh, kind, audit_every, hooks=None, steps=STEPS):
    schedule, modules, opt, stages = build(mesh, kind)
    guard = sdcguard.Guard(schedule, opt, config=Config(audit_every=audit_every, weight_check_every=1))
    replica, losses, seen = mesh["dp"].get_local_rank(), [], {}
    for step in range(steps):
        if hooks is not None:
            hooks(step, modules, opt)
        args, target = run_args(stages, step, replica)
        mine = []
        try:
            with guard.step(step) as s:
                s.run_schedule(*args, target=target, losses=mine)
                s.check()
                clip(modules)
                opt.step()
                opt.zero_grad(set_to_none=True)
            seen[step] = None
        except sdcguard.SDCDetected as exc:
            seen[step] = {k: exc.alarm[k] for k in ("check", "step", "suspect_ranks", "ambiguous", "evidence")}
            opt.zero_grad(set_to_none=True)
        except sdcguard.NonFiniteGradient as exc:  # pragma: no cover - a reproduced NaN: the data's
            seen[step] = {"nonfinite": str(exc)}
            opt.zero_grad(set_to_none=True)
        losses += [loss.view(torch.int32).item() for loss in mine]
    return losses, weights_digest(modules), guard, seen


def faults(mesh, rank):
    """rank 1 = (pp 0, replica 1): a persistent fault in stage 0's forward at step 1; rank 5 =
    (pp 1, replica 2): a transient one in stage 1's gradient at step 2; rank 4 = (pp 1, replica 1):
    a flipped weight sign after step 3's update (check 3); rank 3 = (pp 1, replica 0): a NaN in
    its stage-1 forward at step 4, in its own pass only (check 1: it does not reproduce)."""
    state = {"step": -1}

    def forward_fault(module, args, output):
        if state["step"] == 4 and rank == 3 and not replaying():  # a NaN in replica 0's stage 1, once
            return output * float("nan")
        return output * 3.0 if state["step"] == 1 and rank == 1 else output

    def grad_fault(grad):
        return grad * 1.5 if state["step"] == 2 and rank == 5 and not replaying() else grad

    def hooks(step, modules, opt):
        state["step"] = step
        if step == 0:
            modules[0].register_forward_hook(forward_fault)
            if REPLICATION == "ddp":
                next(modules[0].parameters()).register_hook(grad_fault)
            else:  # FSDP2's sharded parameters get their gradient from the reduce-scatter, not autograd
                def output_grad_fault(module, args, output):
                    if output.requires_grad:
                        output.register_hook(grad_fault)
                modules[0].register_forward_hook(output_grad_fault)
            if rank == 4:
                def flip(optimizer, args, kwargs):
                    if state["step"] == 3:
                        with torch.no_grad():
                            w = local(next(modules[0].parameters()))
                            w.view(-1)[0] = -w.view(-1)[0]
                opt.register_step_post_hook(flip)

    *_, guard, seen = guarded(mesh, "1f1b", 1, hooks, steps=5)
    return seen, guard.plan_lines()


def resume(mesh, rank, out):
    """An audited 1F1B run saves a checkpoint after steps 1 and 3 (a directory each, as Hugging Face
    rotates them); a persistent forward fault at step 5 raises an alarm naming the last good one; a
    new job loads exactly that checkpoint (the alarm's step and SHA-256) and trains on without the
    fault: it ends bit for bit where the clean uninterrupted run does. Then one stage file of that
    checkpoint is tampered with: every rank refuses it."""
    steps = 7
    clean = guarded(mesh, "1f1b", 1, steps=steps)[1]

    schedule, modules, opt, stages = build(mesh, "1f1b")
    guard = sdcguard.Guard(schedule, opt, config=Config(audit_every=1, weight_check_every=1))
    state = {"step": -1}
    modules[0].register_forward_hook(lambda m, a, o: o * 3.0 if state["step"] == 5 and rank == 1 else o)
    replica, alarm = mesh["dp"].get_local_rank(), None
    for step in range(steps):
        state["step"] = step
        args, target = run_args(stages, step, replica)
        try:
            with guard.step(step) as s:
                s.run_schedule(*args, target=target)
                s.check()
                clip(modules)
                opt.step()
                opt.zero_grad(set_to_none=True)
        except sdcguard.SDCDetected as exc:
            alarm = exc.alarm
            break
        if step in (1, 3):
            guard.save_checkpoint(os.path.join(out, f"ckpt-{step}"))
    named = alarm["last_good_checkpoint"], alarm["last_good_checkpoint_step"], alarm["last_good_checkpoint_sha256"]

    schedule, modules, opt, stages = build(mesh, "1f1b")
    guard = sdcguard.Guard(schedule, opt, config=Config(audit_every=1, weight_check_every=1))
    if named[0] is None:  # pure FSDP: no checkpoint is cross-checked, none is named; the user resumes from one
        start = guard.load_checkpoint(os.path.join(out, "ckpt-3"), expect_step=3)
    else:
        start = guard.load_checkpoint(named[0], expect_step=named[1], expect_sha256=named[2])
    for step in range(start + 1, steps):
        args, target = run_args(stages, step, replica)
        with guard.step(step) as s:
            s.run_schedule(*args, target=target)
            s.check()
            clip(modules)
            opt.step()
            opt.zero_grad(set_to_none=True)
    resumed = weights_digest(modules)
    dist.barrier()
    if rank == 0:
        victim = os.path.join(out, "ckpt-3", "stage-1.pt")
        with open(victim, "r+b") as fh:
            fh.seek(-1, os.SEEK_END)
            last = fh.read(1)
            fh.seek(-1, os.SEEK_END)
            fh.write(bytes([last[0] ^ 1]))
    dist.barrier()
    schedule, modules, opt, stages = build(mesh, "1f1b")
    guard = sdcguard.Guard(schedule, opt, config=Config(audit_every=1))
    try:
        guard.load_checkpoint(os.path.join(out, "ckpt-3"))
        refused = None
    except sdcguard.checkpoint.CheckpointError as exc:
        refused = str(exc)
    return {"alarm_step": alarm["step"], "named": list(named), "start": start, "resumed": resumed, "clean": clean,
            "refused": refused}


MESH = MESH3 = None


def main(out):
    global MESH, MESH3
    dist.init_process_group("gloo")
    torch.set_num_threads(1)
    rank = dist.get_rank()
    MESH = mesh = init_device_mesh("cpu", (PP, DP), mesh_dim_names=("pp", "dp"))
    if REPLICATION.startswith("hsdp"):  # hsdp: torchtitan's data-parallel-only mesh, a shard of one
        MESH3 = init_device_mesh("cpu", (PP, DP // SHARDS, SHARDS), mesh_dim_names=("pp", "dp_replicate", "dp_shard"))

    def write(name, data):
        with open(os.path.join(out, f"{name}-rank{rank}.json"), "w") as fh:
            json.dump(data, fh)

    # every all-reduce a replay runs (HSDP's must not: a replay sends nothing to another replica)
    replay_all_reduces = []
    real_all_reduce = dist.all_reduce

    def counted_all_reduce(tensor, *args, **kwargs):
        if replaying():
            replay_all_reduces.append(tensor.numel())
        return real_all_reduce(tensor, *args, **kwargs)
    dist.all_reduce = counted_all_reduce

    for kind in os.environ.get("PP_KINDS", "gpipe,1f1b,interleaved").split(","):
        plain_losses, plain_digest = plain(mesh, kind, rank)
        unaudited, audited = guarded(mesh, kind, 0), guarded(mesh, kind, 1)
        write(f"exact-{kind}", {"plain": [plain_losses, plain_digest],
                                "unaudited": [unaudited[0], unaudited[1], unaudited[2].alarms_raised],
                                "audited": [audited[0], audited[1], audited[2].alarms_raised],
                                "alarms": [unaudited[3], audited[3]],
                                "audited_step": audited[2].history.last_audited_step,
                                "weights_verified": audited[2].history.last_weights_verified_step,
                                "plan": audited[2].plan_lines(), "replay_all_reduces": list(replay_all_reduces)})
    scenarios = os.environ.get("PP_SCENARIOS", "faults,resume").split(",")
    if "faults" in scenarios:
        seen, plan = faults(mesh, rank)
        write("faults", {"steps": seen, "plan": plan})
    if "resume" in scenarios:
        write("resume", resume(mesh, rank, out))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1])
