"""One rank of the tensor-parallel test, launched by tests/test_tensor_parallel.py under torchrun
(gloo, CPU, 4 ranks): torchtitan's 3-D mesh ``(dp_replicate, dp_shard, tp) = (2, 1, 2)``, a model
whose MLP pair is tensor parallel (``ColwiseParallel`` then ``RowwiseParallel``, after a replicated
input layer with dropout), then ``fully_shard`` over the data-parallel dimensions. Scenarios, each
writing OUT/<scenario>-rank<r>.json:

  exact     the plain loop (AdamW, 2 micro-batches, dropout seeded per TP group, gradient clipping)
            against the same loop under guard.step, unaudited and audited on every step, with
            check 3 every step: every loss and every local shard bit for bit, no alarm;
  resume    the audited run saves a DCP checkpoint after step 1 (per-shard digests of every
            (TP, FSDP) position), a new job loads it and trains on: it ends bit for bit where
            the uninterrupted run does, and a tampered shard is refused on every rank;
  faults    a flipped bit in one rank's local gradient (check 2 names that rank alone), a scaled
            activation in one rank's forward (check 2 names its TP group), a flipped bit in one
            replica's stored weight shard (check 3 names it with its (replica, shard, tp)).
"""
import json
import logging
import os
import sys

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

import sdcguard
from sdcguard.checkpoint import CheckpointError
from sdcguard.checks.rng import forward_seed, seeded
from sdcguard.child_process import exit_without_finalizing
from sdcguard.config import Config
from sdcguard.faults.sharded import ShardedFaultInjector
from sdcguard.fingerprint import digest, fingerprint

STEPS, MICRO, TP = 4, 2, 2


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(8, 16)
        self.drop = nn.Dropout(0.1)
        self.up = nn.Linear(16, 32)     # column-wise: each TP rank computes 16 of the 32 features
        self.down = nn.Linear(32, 3)    # row-wise: partial sums all-reduced across the TP group

    def forward(self, x):
        return self.down(F.relu(self.up(self.drop(F.relu(self.inp(x))))))


def loss_fn(module, batch):
    x, y = batch
    return F.cross_entropy(module(x), y)


def batch(step, data_rank, micro, n=6):
    g = torch.Generator().manual_seed(1000 * step + 10 * data_rank + micro)
    x = torch.randn(n, 8, generator=g)
    return x, (x[:, :3] * torch.tensor([1.0, -1.0, 0.5])).argmax(dim=1)


def build(mesh):
    torch.manual_seed(0)
    model = Net()
    parallelize_module(model, mesh["tp"], {"up": ColwiseParallel(), "down": RowwiseParallel()})
    dp = mesh["dp_replicate", "dp_shard"]
    for layer in (model.inp, model.up, model.down):
        fully_shard(layer, mesh=dp)
    fully_shard(model, mesh=dp)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2)


def clip(model, max_norm=1.0):
    """Gradient clipping over a model whose parameters live on two meshes (the data-parallel one,
    and the data-parallel x TP one): torch's clip_grad_norm_ cannot stack their norms, so the total
    is taken over every full gradient (a collective), as torchtitan's clip_grad_norm_ does per mesh."""
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    total = float(torch.stack([g.full_tensor().norm() for g in grads]).norm())
    coef = min(1.0, max_norm / (total + 1e-6))
    for g in grads:
        g.mul_(coef)


def shards_digest(model):
    return digest(fingerprint(p.to_local()) for p in model.parameters()).hex()


def plain(mesh, rank):
    model, opt = build(mesh)
    losses, group_first = [], rank - rank % TP  # a TP group drops the same activations
    for step in range(STEPS):
        for i in range(MICRO):
            with seeded(forward_seed(0, step, group_first, i), torch.device("cpu")):
                loss = loss_fn(model, batch(step, rank // TP, i))
            (loss / MICRO).backward()
            losses.append(loss.detach().view(torch.int32).item())
        clip(model)
        opt.step()
        opt.zero_grad(set_to_none=True)
    return losses, shards_digest(model)


def guarded_step(guard, model, opt, step, rank, losses):
    with guard.step(step, micro_batches=MICRO) as s:
        for i in range(MICRO):
            loss = s.backward(batch(step, rank // TP, i), divide_by=MICRO)
            losses.append(loss.view(torch.int32).item())
        s.check()
        clip(model)
        opt.step()
        opt.zero_grad(set_to_none=True)


def guarded(mesh, rank, audit_every, out=None):
    model, opt = build(mesh)
    guard = sdcguard.Guard(model, opt, loss_fn, config=Config(audit_every=audit_every, weight_check_every=1,
                                                              ranks_per_node=TP))
    losses = []
    for step in range(STEPS):
        guarded_step(guard, model, opt, step, rank, losses)
        if out is not None and step == 1:
            guard.save_checkpoint(os.path.join(out, "ckpt"))
    return losses, shards_digest(model), guard


def resumed(mesh, rank, out):
    """A new job from the checkpoint of step 1, trained on to the end; then the same checkpoint
    with one shard's file tampered is refused."""
    model, opt = build(mesh)
    guard = sdcguard.Guard(model, opt, loss_fn, config=Config(audit_every=1, weight_check_every=1, ranks_per_node=TP))
    start = guard.load_checkpoint(os.path.join(out, "ckpt"))
    losses = []
    for step in range(start + 1, STEPS):
        guarded_step(guard, model, opt, step, rank, losses)
    return start, shards_digest(model), guard.alarms_raised


def faults(mesh, rank):
    model, opt = build(mesh)
    specs = ["grad-bitflip:rank=1:step=0:param=up.weight",     # rank 1's own gradient: that rank alone
             "forward-scale:rank=2:step=1:site=inp:magnitude=-1e4",  # rank 2's forward: its TP group (2, 3)
             "weight-bitflip:rank=3:step=2:param=up.weight"]   # rank 3's stored shard: check 3
    injector = ShardedFaultInjector(specs, rank)
    guard = sdcguard.Guard(model, opt, loss_fn, config=Config(audit_every=1, weight_check_every=1, ranks_per_node=TP))
    injector.install(guard)
    seen = {}
    for step in range(3):
        injector.begin_step(step)
        try:
            guarded_step(guard, model, opt, step, rank, [])
            seen[step] = None
        except sdcguard.SDCDetected as exc:
            seen[step] = {k: exc.alarm[k] for k in ("check", "step", "suspect_ranks", "ambiguous", "evidence")}
            opt.zero_grad(set_to_none=True)
    return seen, guard.plan_lines()


def main(out):
    dist.init_process_group("gloo")
    torch.set_num_threads(1)
    logging.getLogger("torch.distributed.tensor._redistribute").setLevel(logging.ERROR)
    rank = dist.get_rank()
    mesh = init_device_mesh("cpu", (2, 1, TP), mesh_dim_names=("dp_replicate", "dp_shard", "tp"))

    def write(name, data):
        with open(os.path.join(out, f"{name}-rank{rank}.json"), "w") as fh:
            json.dump(data, fh)

    plain_losses, plain_digest = plain(mesh, rank)
    unaudited, audited = guarded(mesh, rank, 0), guarded(mesh, rank, 1, out)
    write("exact", {"plain": [plain_losses, plain_digest],
                    "unaudited": [unaudited[0], unaudited[1], unaudited[2].alarms_raised],
                    "audited": [audited[0], audited[1], audited[2].alarms_raised],
                    "audited_step": audited[2].history.last_audited_step,
                    "weights_verified": audited[2].history.last_weights_verified_step,
                    "plan": audited[2].plan_lines()})
    start, final, alarms = resumed(mesh, rank, out)
    dist.barrier()
    if rank == 0:  # flip one byte of a shard file: every rank must refuse the checkpoint
        victim = sorted(f for f in os.listdir(os.path.join(out, "ckpt")) if f.endswith(".distcp"))[-1]
        with open(os.path.join(out, "ckpt", victim), "r+b") as fh:
            fh.seek(-1, os.SEEK_END)
            last = fh.read(1)
            fh.seek(-1, os.SEEK_END)
            fh.write(bytes([last[0] ^ 1]))
    dist.barrier()
    model, opt = build(mesh)
    guard = sdcguard.Guard(model, opt, loss_fn, config=Config(audit_every=1, ranks_per_node=TP))
    try:
        guard.load_checkpoint(os.path.join(out, "ckpt"))
        refused = None
    except CheckpointError as exc:
        refused = str(exc)
    write("resume", {"start": start, "final": final, "alarms": alarms, "uninterrupted": audited[1],
                     "tampered_refused": refused})
    seen, plan = faults(mesh, rank)
    write("faults", {"steps": seen, "plan": plan})
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1])
    exit_without_finalizing(0)
