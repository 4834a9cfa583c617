"""One rank of the update re-run test (tests/test_update_replay.py), under torchrun (gloo, CPU), on
pure FSDP over all ranks (4, or 2). Writes OUT/rank<r>.json with two scenarios:
  clean   plain FSDP2 (AdamW, 2 micro-batches, dropout, clip_grad_norm_) against the same loop under
          guard.step with the update re-run on every step and check 2 every other step: every loss
          and every local shard bit for bit, no alarm;
  faults  weight checks every 2 steps; one element of one rank's shard scaled after its update at
          step 2 (a weight-check step: named) and of another rank's at step 3 (not one: it escapes,
          and the next re-run starts from the corrupted shard, consistently).
"""
import json
import logging
import os
import sys

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # PYTHONSAFEPATH keeps this folder off the path
from fsdp_worker import MICRO, batch, build, loss_fn, shards_digest  # noqa: E402

import sdcguard  # noqa: E402
from sdcguard.child_process import exit_without_finalizing  # noqa: E402
from sdcguard.checks.rng import forward_seed, seeded  # noqa: E402
from sdcguard.config import Config  # noqa: E402
from sdcguard.faults.sharded import ShardedFaultInjector  # noqa: E402

STEPS = 4


def clean(mesh, rank):
    model, opt = build(mesh)
    plain = []
    for step in range(STEPS):
        for i in range(MICRO):
            with seeded(forward_seed(0, step, rank, i), torch.device("cpu")):
                loss = loss_fn(model, batch(step, rank, i))
            (loss / MICRO).backward()
            plain.append(loss.detach().view(torch.int32).item())
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
    plain_digest = shards_digest(model)

    model, opt = build(mesh)
    guard = sdcguard.Guard(model, opt, loss_fn, config=Config(audit_every=2, weight_check_every=1))
    guarded = []
    for step in range(STEPS):
        with guard.step(step, micro_batches=MICRO) as s:
            for i in range(MICRO):
                guarded.append(s.backward(batch(step, rank, i), divide_by=MICRO).view(torch.int32).item())
            s.check()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            opt.zero_grad(set_to_none=True)
    return {"plain": [plain, plain_digest], "guarded": [guarded, shards_digest(model)], "alarms": guard.alarms_raised,
            "reruns": guard.layout.update_check.reruns, "bytes_sent": guard.layout.update_check.bytes_sent, "weights_verified": guard.last_weights_verified_step,
            "plan": guard.plan_lines()}


def faults(mesh, rank, world):
    model, opt = build(mesh)
    guard = sdcguard.Guard(model, opt, loss_fn, config=Config(audit_every=0, weight_check_every=2))
    specs = [f"optimizer-scale:rank={world - 2 if world > 2 else 1}:step=2:element=1",
             "optimizer-scale:rank=1:step=3:element=0"]
    injector = ShardedFaultInjector(specs, rank)
    injector.install(guard, param="out.weight")
    seen = {}
    for step in range(STEPS + 1):
        injector.begin_step(step)
        try:
            guard.train_step(step, micro_batches=[batch(step, rank, i) for i in range(MICRO)], clip_grad_norm=1.0)
            seen[step] = {"ok": True}
        except sdcguard.SDCDetected as exc:
            seen[step] = {"alarm": exc.alarm}
            guard.reporter.alarms_raised = 0  # go on: the next re-runs start from the corrupted shard, consistently
    return {"steps": seen, "fired": injector.fired}


def main(out):
    logging.basicConfig(level=logging.WARNING)
    os.makedirs(out, exist_ok=True)
    dist.init_process_group("gloo")
    torch.set_num_threads(1)
    rank, world = dist.get_rank(), dist.get_world_size()
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("shard",))
    result = {"rank": rank, "clean": clean(mesh, rank), "faults": faults(mesh, rank, world)}
    with open(os.path.join(out, f"rank{rank}.json"), "w") as fh:
        json.dump(result, fh, default=str)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1])
    exit_without_finalizing(0)  # FSDP2's gloo ops at finalization (see its docstring)
