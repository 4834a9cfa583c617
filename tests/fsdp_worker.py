"""One rank of the sharded-model test, launched by tests/test_fsdp.py under torchrun (gloo, CPU).

Four ranks run HSDP 2 x 2 and pure FSDP over 4; six ranks run HSDP 3 x 2. For each mesh, in one
launch (each scenario writes OUT/<mesh>-<scenario>-rank<r>.json):
  exact    plain FSDP2 (AdamW, 2 micro-batches, dropout, clip_grad_norm_) against the same loop
           under guard.step with check 3 every step, without audits and with check 2 every step
           (the mesh replays other ranks' batches): every loss and every local shard bit for bit,
           and every sharded .grad the same object with the same bits after the replay;
  faults   one run with injected faults, each on its own step: an Inf in one rank's local
           gradient (check 1 names it before the reduction; the replay does not reproduce it), a
           scaled element of one rank's reduced shard (check 4 names the reduction group), and on
           HSDP a flipped bit in one
           replica's stored weight shard and a scaled element of one rank's shard after its update
           (check 3 names the replica, with its coordinates);
  deferred accumulation with the reduction deferred to the last micro-batch (HSDP: the all-reduce;
           pure FSDP: the reduce-scatter too), audited: bit for bit;
  replay_faults  audited every step: a flipped bit in one rank's backward, a scaled activation
           in another's forward, a flipped bit in a rank's replay (check 2 names each rank), a
           NaN in one rank's batch (reproduced by the replay: the data's, no alarm).
"""
import contextlib
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

import sdcguard
from sdcguard.child_process import exit_without_finalizing
from sdcguard.checks.rng import forward_seed, seeded
from sdcguard.config import Config
from sdcguard.faults.sharded import ShardedFaultInjector
from sdcguard.fingerprint import digest, fingerprint

STEPS, MICRO = 4, 2


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(8, 16)
        self.hid = nn.Linear(16, 16)
        self.drop = nn.Dropout(0.1)
        self.out = nn.Linear(16, 3)                    # 3 rows: uneven shards, padded
        self.gain = nn.Parameter(torch.ones(3))        # the root's own parameter group

    def forward(self, x):
        return self.out(self.drop(F.relu(self.hid(F.relu(self.inp(x)))))) * self.gain


def loss_fn(module, batch):
    x, y = batch
    return F.cross_entropy(module(x), y)


def batch(step, rank, micro, n=6):
    g = torch.Generator().manual_seed(1000 * step + 10 * rank + micro)
    x = torch.randn(n, 8, generator=g)
    return x, (x[:, :3] * torch.tensor([1.0, -1.0, 0.5])).argmax(dim=1)


def build(mesh):
    torch.manual_seed(0)
    model = Net()
    for layer in (model.inp, model.hid, model.out):
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2)


def shards_digest(model):
    return digest(fingerprint(p.to_local()) for p in model.parameters()).hex()


def plain(mesh, rank):
    model, opt = build(mesh)
    losses = []
    for step in range(STEPS):
        for i in range(MICRO):
            with seeded(forward_seed(0, step, rank, i), torch.device("cpu")):
                loss = loss_fn(model, batch(step, rank, i))
            (loss / MICRO).backward()
            losses.append(loss.detach().view(torch.int32).item())
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
    return losses, shards_digest(model)


def guarded(mesh, rank, audit_every=0):
    model, opt = build(mesh)
    guard = sdcguard.Guard(model, opt, loss_fn, config=Config(audit_every=audit_every, weight_check_every=1))
    losses, kept = [], []
    for step in range(STEPS):
        with guard.step(step, micro_batches=MICRO) as s:
            for i in range(MICRO):
                loss = s.backward(batch(step, rank, i), divide_by=MICRO)
                losses.append(loss.view(torch.int32).item())
            grads = _grads(model)
            s.check()  # the audit's replay runs in here
            kept.append(_grads(model) == grads)
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            opt.zero_grad(set_to_none=True)
    return losses, shards_digest(model), guard, kept


def _grads(model):
    """Each sharded gradient: which object it is, and its local shard's bits."""
    return [(id(p.grad), list(fingerprint(p.grad.to_local()))) for p in model.parameters()]


def deferred(mesh, rank, out, name):
    """Accumulation with a deferred reduction — HSDP: the all-reduce deferred to the last
    micro-batch (``set_requires_all_reduce(False)``); pure FSDP: the reduce-scatter too
    (``set_requires_gradient_sync(False)``) — audited every step: bit for bit plain FSDP2, no false
    alarm (check 4 then covers the reduce-scatters only; check 2's replay repeats the pattern)."""
    results = []
    hsdp = mesh.ndim == 2
    for guarded_run in (False, True):
        model, opt = build(mesh)
        guard = sdcguard.Guard(model, opt, loss_fn, config=Config(audit_every=1, weight_check_every=1)) if guarded_run else None
        for step in range(2):
            with guard.step(step, micro_batches=MICRO) if guard else contextlib.nullcontext() as s:
                for i in range(MICRO):
                    if hsdp:
                        model.set_requires_all_reduce(i == MICRO - 1)
                    else:
                        model.set_requires_gradient_sync(i == MICRO - 1)
                    if guard:
                        s.backward(batch(step, rank, i), divide_by=MICRO)
                    else:
                        with seeded(forward_seed(0, step, rank, i), torch.device("cpu")):
                            (loss_fn(model, batch(step, rank, i)) / MICRO).backward()
                if guard:
                    s.check()
                opt.step()
                opt.zero_grad(set_to_none=True)
        results.append(shards_digest(model))
    return {"plain": results[0], "guarded": results[1], "alarms": guard.alarms_raised,
            "reduction_verified": guard.history.last_reduction_verified_step,
            "audited": guard.history.last_audited_step}


def exact(mesh, rank, out, name):
    ref_losses, ref = plain(mesh, rank)
    runs = {}
    for audit_every in (0, 1):  # unaudited, and check 2 (the mesh's replay) on every step
        losses, mine, guard, kept = guarded(mesh, rank, audit_every)
        runs[audit_every] = {"guarded": [losses, mine], "alarms": guard.alarms_raised, "grads_kept": kept,
                             "weights_verified": guard.last_weights_verified_step,
                             "reduction_verified": guard.history.last_reduction_verified_step,
                             "audited": guard.history.last_audited_step}
    return {"plain": [ref_losses, ref], "unaudited": runs[0], "audited": runs[1], "grads_kept": runs[1]["grads_kept"],
            "plan": guard.plan_lines()}


def replay_faults(mesh, rank, out, name):
    """Check 2 and check 1's confirmation by replay, audited every step, one fault per step: a
    flipped bit in rank 1's local gradient (its backward), an activation of rank 2's forward
    scaled, a flipped bit in rank 3's *replay* of another rank's batch, and a NaN in rank 2's
    batch (the data's: reproduced by the replay, no alarm); then a clean step."""
    model, opt = build(mesh)
    guard = sdcguard.Guard(model, opt, loss_fn, config=Config(audit_every=1, weight_check_every=0,
                                                              spool=os.path.join(out, f"{name}-spool")))
    injector = ShardedFaultInjector(["grad-bitflip:rank=1:step=0:element=5",
                                     "forward-scale:rank=2:step=1:site=hid:element=3",
                                     "grad-bitflip:rank=3:step=2:element=5:during=replay"], rank)
    injector.install(guard, param="out.weight")
    seen = {}
    for step in range(5):
        injector.begin_step(step)
        before = shards_digest(model)
        micro = [batch(step, rank, i) for i in range(MICRO)]
        if step == 3 and rank == 2:
            micro[1][0][0, 0] = float("nan")  # the data's NaN, in micro-batch 1
        try:
            guard.train_step(step, micro_batches=micro)
            seen[step] = {"ok": True}
        except sdcguard.NonFiniteGradient as exc:
            seen[step] = {"nonfinite": {str(r): m for r, m in exc.ranks.items()}, "confirmed": exc.confirmed}
        except sdcguard.SDCDetected as exc:
            seen[step] = {"alarm": exc.alarm}
            guard.reporter.alarms_raised = 0
        seen[step]["applied"] = shards_digest(model) != before
    return {"steps": seen, "fired": injector.fired, "audited": guard.history.last_audited_step,
            "alarms": guard.alarms_raised}


def faults(mesh, rank, out, name, specs):
    model, opt = build(mesh)
    guard = sdcguard.Guard(model, opt, loss_fn, config=Config(audit_every=0, weight_check_every=1,
                                                              spool=os.path.join(out, f"{name}-spool")))
    injector = ShardedFaultInjector(specs, rank)
    injector.install(guard, param="out.weight")
    seen = {}
    for step in range(len(specs) + 1):
        injector.begin_step(step)
        before = shards_digest(model)
        try:
            guard.train_step(step, micro_batches=[batch(step, rank, i) for i in range(MICRO)])
            seen[step] = {"ok": True}
        except sdcguard.NonFiniteGradient as exc:
            seen[step] = {"nonfinite": {str(r): m for r, m in exc.ranks.items()}, "confirmed": exc.confirmed,
                          "message": str(exc)}
        except sdcguard.SDCDetected as exc:
            seen[step] = {"alarm": exc.alarm}
            # check 3 raises after the update: put every replica back on the majority's weights so
            # that the next fault starts from agreeing replicas (a real job would stop here)
            if exc.alarm["check"] == "weights":
                _resync(model, guard)
            guard.reporter.alarms_raised = 0
        seen[step]["applied"] = shards_digest(model) != before
    try:
        guard.save_checkpoint(os.path.join(out, f"{name}.pt"))
        refused = None
    except sdcguard.CheckpointError as exc:
        refused = str(exc)
    spool = os.path.join(out, f"{name}-spool")
    return {"steps": seen, "fired": injector.fired, "refused": refused,
            "spooled": sorted(os.listdir(spool)) if os.path.isdir(spool) else []}


def _resync(model, guard):
    """Broadcast each shard from replica 0 to its other replicas (test-only repair)."""
    layout = guard.layout.mesh
    group = guard.layout.replicate_group
    src = layout.replicas_of_shard(layout.coordinates(layout.rank)["shard"])[0]
    with torch.no_grad():
        for p in model.parameters():
            dist.broadcast(p.to_local(), src=src, group=group)
        for state in opt_states(guard.optimizer):
            dist.broadcast(state, src=src, group=group)


def opt_states(opt):
    for st in opt.state.values():
        for v in st.values():
            if torch.is_tensor(v) and v.dim() > 0:
                yield v.to_local() if hasattr(v, "to_local") else v


def main(out):
    logging.basicConfig(level=logging.WARNING)
    dist.init_process_group("gloo")
    torch.set_num_threads(1)
    rank, world = dist.get_rank(), dist.get_world_size()
    meshes = {"hsdp2x2": (2, 2), "fsdp4": (4,)} if world == 4 else {"hsdp3x2": (3, 2)}
    for name, shape in meshes.items():
        names = ("replicate", "shard") if len(shape) == 2 else ("shard",)
        mesh = init_device_mesh("cpu", shape, mesh_dim_names=names)
        hsdp = len(shape) == 2
        # rank 1 holds (replica 0, shard 1) on HSDP; rank 3 is (1, 1) on both HSDP meshes
        specs = ["grad-inf:rank=1:step=0:element=5",                      # check 1: local Inf on rank 1
                 "reduce-scale:rank=3:step=1:param=hid.weight:magnitude=1e3"]  # check 4: rank 3's reduced shard
        if hsdp:
            specs += ["weight-bitflip:rank=3:step=2:element=2",          # check 3: replica of rank 3
                      "optimizer-scale:rank=2:step=3:element=1"]         # check 3: rank 2's updated shard
        scenarios = [("exact", exact), ("faults", lambda *a: faults(*a, specs)), ("deferred", deferred),
                     ("replay_faults", replay_faults)]
        for scenario, run in scenarios:
            result = run(mesh, rank, out, name)
            with open(os.path.join(out, f"{name}-{scenario}-rank{rank}.json"), "w") as fh:
                json.dump(result, fh, default=str)
            dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1])
    exit_without_finalizing(0)  # FSDP2's gloo ops at finalization (see its docstring)
