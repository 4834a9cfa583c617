"""One rank of the one-shard-per-group test (tests/test_fsdp_shard1.py), under torchrun (gloo, CPU).

The mesh is ``(R, 1)`` (R = the world size): HSDP whose shard groups have one rank, where FSDP2
copies each rank's gradient instead of reduce-scattering it and all-reduces the copy across the
replicas (torchtitan's data-parallel-only setting). The model and loops are tests/fsdp_worker.py's.
Each scenario writes OUT/<scenario>-rank<r>.json:

  exact    plain FSDP2 against the same loop under guard.step with check 3 every step, unaudited
           and audited every step: every loss and every local shard bit for bit (fsdp_worker.exact);
  deferred the all-reduce deferred to the last micro-batch, audited: bit for bit;
  faults   audited every step, one fault per step: a NaN in rank 1's forward (check 1 names it,
           the replay does not reproduce it), a flipped bit in rank 1's backward (check 2), a scaled
           element of rank 0's all-reduced gradient (check 4), a flipped bit in the last rank's
           weights (check 3), a NaN in rank 0's data (reproduced: no alarm), a NaN in rank 1's
           all-reduced gradient (check 1: no local gradient had it), a scaled element of rank 0's
           updated weights (check 3), then a clean step;
  long     (``long`` argument) STEPS_LONG audited steps with check 3 every step, against plain
           FSDP2: no alarm, bit for bit.
"""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # PYTHONSAFEPATH: fsdp_worker is a sibling

import json  # noqa: E402
import logging  # noqa: E402

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from torch.distributed.device_mesh import init_device_mesh  # noqa: E402

import sdcguard  # noqa: E402
from sdcguard.child_process import exit_without_finalizing  # noqa: E402
from sdcguard.checks.rng import forward_seed, seeded  # noqa: E402
from sdcguard.config import Config  # noqa: E402
from sdcguard.faults.sharded import ShardedFaultInjector  # noqa: E402

from fsdp_worker import MICRO, _resync, batch, build, deferred, exact, loss_fn, shards_digest  # noqa: E402

STEPS_LONG = 100


def specs(world):
    return ["forward-nan:rank=1:step=0:site=hid:element=3",                 # check 1: rank 1's local gradient
            "grad-bitflip:rank=1:step=1:element=5",                          # check 2: rank 1's backward
            "reduce-scale:rank=0:step=2:param=hid.weight:magnitude=1e3",     # check 4: rank 0's all-reduce output
            f"weight-bitflip:rank={world - 1}:step=3:element=2",             # check 3: the last rank's replica
            "reduce-nan:rank=1:step=5:param=hid.weight:element=4",           # check 1: NaN after the all-reduce
            "optimizer-scale:rank=0:step=6:element=1"]                       # check 3: rank 0's update


def faults(mesh, rank, out, world):
    model, opt = build(mesh)
    spool = os.path.join(out, "faults-spool")
    guard = sdcguard.Guard(model, opt, loss_fn, config=Config(audit_every=1, weight_check_every=1, spool=spool))
    injector = ShardedFaultInjector(specs(world), rank)
    injector.install(guard, param="out.weight")
    seen = {}
    for step in range(8):
        injector.begin_step(step)
        before = shards_digest(model)
        micro = [batch(step, rank, i) for i in range(MICRO)]
        if step == 4 and rank == 0:
            micro[1][0][0, 0] = float("nan")  # the data's NaN, in micro-batch 1
        try:
            guard.train_step(step, micro_batches=micro)
            seen[step] = {"ok": True}
        except sdcguard.NonFiniteGradient as exc:
            seen[step] = {"nonfinite": {str(r): m for r, m in exc.ranks.items()}, "confirmed": exc.confirmed}
        except sdcguard.SDCDetected as exc:
            seen[step] = {"alarm": exc.alarm}
            if exc.alarm["check"] == "weights":
                _resync(model, guard)  # back on replica 0's weights (a real job would stop here)
            guard.reporter.alarms_raised = 0
        seen[step]["applied"] = shards_digest(model) != before
    return {"steps": seen, "fired": injector.fired, "audited": guard.history.last_audited_step,
            "spooled": sorted(os.listdir(spool)) if os.path.isdir(spool) else []}


def long(mesh, rank, out, world):
    """STEPS_LONG audited steps (check 3 every step) against plain FSDP2, compared step by step."""
    digests = {}
    for guarded_run in (False, True):
        model, opt = build(mesh)
        guard = sdcguard.Guard(model, opt, loss_fn, config=Config(audit_every=1, weight_check_every=1)) \
            if guarded_run else None
        per_step = []
        for step in range(STEPS_LONG):
            micro = [batch(step, rank, i) for i in range(MICRO)]
            if guard:
                guard.train_step(step, micro_batches=micro)
            else:
                for i, m in enumerate(micro):
                    with seeded(forward_seed(0, step, rank, i), torch.device("cpu")):
                        (loss_fn(model, m) / MICRO).backward()
                opt.step()
                opt.zero_grad(set_to_none=True)
            per_step.append(shards_digest(model))
        digests["guarded" if guarded_run else "plain"] = per_step
    return {**digests, "alarms": guard.alarms_raised, "audited": guard.history.last_audited_step,
            "weights_verified": guard.last_weights_verified_step,
            "reduction_verified": guard.history.last_reduction_verified_step}


def main(out, which):
    logging.basicConfig(level=logging.WARNING)
    dist.init_process_group("gloo")
    torch.set_num_threads(1)
    rank, world = dist.get_rank(), dist.get_world_size()
    mesh = init_device_mesh("cpu", (world, 1), mesh_dim_names=("replicate", "shard"))
    scenarios = {"long": lambda: long(mesh, rank, out, world)} if which == "long" else {
        "exact": lambda: exact(mesh, rank, out, "shard1"), "deferred": lambda: deferred(mesh, rank, out, "shard1"),
        "faults": lambda: faults(mesh, rank, out, world)}
    for scenario, run in scenarios.items():
        result = run()
        with open(os.path.join(out, f"{scenario}-rank{rank}.json"), "w") as fh:
            json.dump(result, fh, default=str)
        dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2] if len(sys.argv) > 2 else "short")
    exit_without_finalizing(0)  # FSDP2's gloo ops at finalization (see its docstring)
