"""False-alarm run for a sharded model: FSDP2 (HSDP by default) with check 2 on every step.

    .venv/bin/python bench/false_alarms_sharded.py [--steps 500] [--replicas 2] [--shards 2]
                                                   [--tp 1] [--ranks-per-node 2]

Launches itself under torchrun (gloo, CPU, one thread per rank): a tiny model (LayerNorm, GELU,
dropout, an output layer with uneven shards) sharded with ``fully_shard`` per block and on the
root, AdamW, 2 micro-batches, gradient clipping; every step audited (the whole mesh replays the
ring's batches and compares every local gradient) and weight-checked (check 3 per shard across
replicas), check 1 and 4 on every step. No fault is injected: any alarm, any NonFiniteGradient, any
ReplayError is a false one. ``--ranks-per-node`` places the replicas on separate "nodes" (HSDP's
usual layout: a shard group inside a node), so rank (i, j) replays the batch of (i + 1, j).
``--replicas 1`` runs pure FSDP over ``--shards`` ranks. ``--tp T`` makes each block's MLP tensor
parallel over T consecutive ranks (``fc`` column-wise, ``proj`` row-wise, before ``fully_shard``
over the data-parallel dimensions; a TP group trains on one batch, and its dropout after ``proj``
draws one mask); place a TP group inside a node. Prints the counts and the time check 2 took per
step against the step's own forward and backward.
"""
import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=500)
    parser.add_argument("--replicas", type=int, default=2)
    parser.add_argument("--shards", type=int, default=2)
    parser.add_argument("--tp", type=int, default=1)
    parser.add_argument("--ranks-per-node", type=int, default=2)
    parser.add_argument("--micro-batches", type=int, default=2)
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        return _worker(args)
    world = args.replicas * args.shards * args.tp
    with tempfile.TemporaryDirectory() as tmp:
        started = time.monotonic()
        proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={world}",
                               __file__, "--worker", tmp, *sys.argv[1:]],
                              env={**os.environ, "OMP_NUM_THREADS": "1"}, stdout=subprocess.DEVNULL)
        elapsed = time.monotonic() - started
        reports = [json.loads(p.read_text()) for p in sorted(Path(tmp).glob("rank*.json"))]
    if proc.returncode != 0 or len(reports) != world:
        print(f"the run failed (exit {proc.returncode}, {len(reports)} of {world} reports)")
        return 1
    r = reports[0]
    mesh = f"HSDP {args.replicas} x {args.shards}" if args.replicas > 1 else f"FSDP over {args.shards}"
    mesh += f" x TP {args.tp}" if args.tp > 1 else ""
    print(f"mesh: {mesh} ({world} ranks, {args.ranks_per_node} per node)")
    print(f"steps completed: {r['steps']} of {args.steps}; audited (check 2): {r['audited']}; "
          f"last audited step {r['last_audited']}, last weights verified {r['last_weights']}")
    print(f"replays compared: {r['audited'] * world} ({r['reduce_scatters']} local gradients per replay)")
    if any(x.get("update_reruns") for x in reports):  # pure FSDP: check 3 is the update re-run
        print(f"updates re-run by a ring neighbour (check 3, one replica): {sum(x['update_reruns'] for x in reports)}")
    print(f"false alarms: {sum(x['alarms'] for x in reports)}; non-finite: {sum(x['nonfinite'] for x in reports)}; "
          f"replay errors: {sum(x['replay_errors'] for x in reports)}")
    print(f"check 2 per step: {1e3 * r['replay_s'] / max(r['audited'], 1):.1f} ms against "
          f"{1e3 * r['backward_s'] / max(r['steps'], 1):.1f} ms of forward + backward (rank 0)")
    print(f"wall time: {elapsed:.0f} s")
    ok = all(x["alarms"] == 0 and x["nonfinite"] == 0 and x["replay_errors"] == 0 for x in reports)
    return 0 if ok and r["steps"] == args.steps and r["audited"] == args.steps else 1


def _worker(args: argparse.Namespace) -> int:
    import logging

    import torch
    import torch.distributed as dist
    import torch.nn.functional as F
    from torch import nn
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    import sdcguard
    from sdcguard.config import Config

    class Block(nn.Module):
        def __init__(self, width: int) -> None:
            super().__init__()
            self.norm = nn.LayerNorm(width)
            self.fc = nn.Linear(width, 2 * width)
            self.proj = nn.Linear(2 * width, width)
            self.drop = nn.Dropout(0.1)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x + self.drop(self.proj(F.gelu(self.fc(self.norm(x)))))

    class Net(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.inp = nn.Linear(12, 24)
            self.blocks = nn.ModuleList([Block(24) for _ in range(2)])
            self.out = nn.Linear(24, 5)  # 5 rows: uneven shards, padded

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            h = self.inp(x)
            for block in self.blocks:
                h = block(h)
            return self.out(h)

    def loss_fn(module: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        x, y = batch
        return F.cross_entropy(module(x), y)

    def clip(model: nn.Module, max_norm: float) -> None:
        """clip_grad_norm_; with TP the parameters live on two meshes, whose norms torch cannot
        stack: the total is taken over the full gradients (as torchtitan's clipping does per mesh)."""
        if args.tp == 1:
            torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)
            return
        grads = [p.grad for p in model.parameters() if p.grad is not None]
        total = float(torch.stack([g.full_tensor().norm() for g in grads]).norm())
        for g in grads:
            g.mul_(min(1.0, max_norm / (total + 1e-6)))

    logging.basicConfig(level=logging.ERROR)
    logging.getLogger("torch.distributed.tensor._redistribute").setLevel(logging.ERROR)
    dist.init_process_group("gloo")
    torch.set_num_threads(1)
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = Net()
    if args.tp > 1:
        from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module
        full = init_device_mesh("cpu", (args.replicas, args.shards, args.tp), mesh_dim_names=("replicate", "shard", "tp"))
        for block in model.blocks:
            parallelize_module(block, full["tp"], {"fc": ColwiseParallel(), "proj": RowwiseParallel()})
        mesh = full["replicate", "shard"]
    else:
        shape = (args.replicas, args.shards) if args.replicas > 1 else (args.shards,)
        mesh = init_device_mesh("cpu", shape, mesh_dim_names=("replicate", "shard") if len(shape) == 2 else ("shard",))
    for block in model.blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(model.out, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    guard = sdcguard.Guard(model, opt, loss_fn, config=Config(audit_every=1, weight_check_every=1,
                                                              ranks_per_node=args.ranks_per_node))
    counts = {"alarms": 0, "nonfinite": 0, "replay_errors": 0}
    backward_s = 0.0
    steps = 0
    for step in range(args.steps):
        g = torch.Generator().manual_seed(7919 * step + 31 * (rank // args.tp))  # a TP group: one batch
        micro = []
        for _ in range(args.micro_batches):
            x = torch.randn(8, 12, generator=g)
            micro.append((x, (x[:, :5] * torch.linspace(-1, 1, 5)).argmax(dim=1)))
        try:
            opt.zero_grad(set_to_none=True)
            with guard.step(step, micro_batches=len(micro)) as s:
                began = time.perf_counter()
                for m in micro:
                    s.backward(m, divide_by=len(micro))
                backward_s += time.perf_counter() - began
                s.check()
                clip(model, 1.0)
                opt.step()
        except sdcguard.SDCDetected:
            counts["alarms"] += 1
            guard.reporter.alarms_raised = 0
        except sdcguard.NonFiniteGradient:
            counts["nonfinite"] += 1
        except sdcguard.ReplayError:
            counts["replay_errors"] += 1
        steps += 1
    history = guard.history
    report = {**counts, "steps": steps, "audited": guard.stats.runs.get("replay", 0),
              "last_audited": history.last_audited_step, "last_weights": history.last_weights_verified_step,
              "reduce_scatters": len(guard.layout.recorder.records),
              "replay_s": guard.stats.seconds.get("replay", 0.0), "backward_s": backward_s,
              "update_reruns": getattr(getattr(guard.layout, "update_check", None), "reruns", 0)}
    Path(args.worker, f"rank{rank}.json").write_text(json.dumps(report))
    dist.barrier()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
