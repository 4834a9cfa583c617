"""Pipeline parallelism: false alarms over audited steps, and the cost of the checks against the
plain pipeline loop, measured inside one run.

    .venv/bin/python bench/pipeline.py [--pp 2] [--dp 2] [--steps 300] [--schedule 1f1b]
                                       [--timed-steps 60] [--replication ddp|fsdp|hsdp] [--shard S]

Launches itself under torchrun (gloo, CPU, one thread per rank), ranks laid out ``(dp, pp)``: a
replica's stages on one "node" (``ranks_per_node = pp``), so a replica replays another node's
batch. A small model (blocks of LayerNorm, Linear, GELU, dropout, Linear with a residual; a head
on the last stage, ``bench/pp_model.py``) split into ``pp`` stages, DDP over each stage's replicas
(``--replication fsdp``: FSDP2 over them, one replica; ``hsdp``: ``dp / S`` replicas x ``S``
shards), AdamW, 4 micro-batches, gradient clipping over the pipeline. Three phases, each on a fresh copy of the same model:
the plain loop, the guarded loop without audits (checks 1 and 4 on every step), and the guarded
loop audited and weight-checked on every step for ``--steps`` steps. No fault is injected: any
alarm, NonFiniteGradient or ReplayError is a false one. Prints the counts and the median step
time of each phase against the plain loop's (ratios inside one run; absolute times are noise).
"""
import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--pp", type=int, default=2)
    parser.add_argument("--dp", type=int, default=2)
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--timed-steps", type=int, default=60)
    parser.add_argument("--schedule", choices=["gpipe", "1f1b", "interleaved"], default="1f1b")
    parser.add_argument("--replication", choices=["ddp", "fsdp", "hsdp"], default="ddp")
    parser.add_argument("--shard", type=int, default=1, help="with --replication hsdp: shards per replica")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        return _worker(args)
    world = args.pp * args.dp
    with tempfile.TemporaryDirectory() as tmp:
        proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone",
                               f"--nproc_per_node={world}", __file__, "--worker", tmp, *sys.argv[1:]],
                              env={**os.environ, "OMP_NUM_THREADS": "1"},
                              stdout=subprocess.DEVNULL)
        reports = [json.loads(p.read_text()) for p in sorted(Path(tmp).glob("rank*.json"))]
    if proc.returncode != 0 or len(reports) != world:
        print(f"the run failed (exit {proc.returncode}, {len(reports)} of {world} reports)")
        return 1
    r0 = reports[0]
    false = sum(r["false_alarms"] for r in reports)
    print(f"pipeline {args.schedule}: PP {args.pp} x DP {args.dp} ({world} ranks, {args.replication.upper()} over each "
          f"stage), {args.steps} audited steps (check 2 and check 3 on every step; with DDP the schedule's first "
          "step is not audited)")
    print(f"  false alarms: {false} (alarms, NonFiniteGradient, ReplayError on any rank)")
    checked = "none (one replica of each stage)" if r0["weights_verified"] is None else r0["weights_verified"] + 1
    print(f"  last audited step: {r0['audited_steps']}, weight-checked steps: {checked}")
    plain = r0["median"]["plain"]
    for phase, steps in (("unaudited", args.timed_steps), ("audited", args.steps)):
        print(f"  {phase:9s} step: {r0['median'][phase] / plain:.3f}x the plain pipeline step "
              f"(median of {steps}, rank 0)")
    print("  plan: " + " | ".join(r0["plan"]))
    return 0 if false == 0 else 2


def _worker(args: argparse.Namespace) -> int:
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe, ScheduleInterleaved1F1B
    from torch.distributed.tensor import DTensor
    from torch.nn.parallel import DistributedDataParallel as DDP

    import sdcguard
    from sdcguard.checks.rng import forward_seed, seeded
    from sdcguard.config import Config
    from sdcguard.errors import NonFiniteGradient, ReplayError

    sys.path.insert(0, str(Path(__file__).parent))
    from pp_model import MICRO_BATCHES, batch, stage_module

    dist.init_process_group("gloo")
    torch.set_num_threads(1)
    rank, micro = dist.get_rank(), MICRO_BATCHES
    mesh = init_device_mesh("cpu", (args.dp, args.pp), mesh_dim_names=("dp", "pp"))
    dp_mesh = mesh["dp"]
    if args.replication == "hsdp":  # rows: replicas, as torchtitan's ("dp_replicate", "dp_shard")
        dp_mesh = init_device_mesh("cpu", (args.dp // args.shard, args.shard, args.pp),
                                   mesh_dim_names=("dp_replicate", "dp_shard", "pp"))["dp_replicate", "dp_shard"]
    per_rank = 2 if args.schedule == "interleaved" else 1
    num_stages = args.pp * per_rank
    position, replica = mesh["pp"].get_local_rank(), mesh["dp"].get_local_rank()

    def replicate(module):
        if args.replication == "ddp":
            return DDP(module, process_group=mesh["dp"].get_group(), find_unused_parameters=True)
        for child in module.children():
            fully_shard(child, mesh=dp_mesh)
        return fully_shard(module, mesh=dp_mesh)

    def build():
        indices = [position + args.pp * k for k in range(per_rank)]
        modules = [stage_module(i, num_stages) for i in indices]
        stages = [PipelineStage(replicate(m), i, num_stages, torch.device("cpu"), group=mesh["pp"].get_group())
                  for m, i in zip(modules, indices)]
        kind = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B}.get(args.schedule)
        schedule = kind(stages[0], micro, loss_fn=F.cross_entropy) if kind else \
            ScheduleInterleaved1F1B(stages, micro, loss_fn=F.cross_entropy)
        opt = torch.optim.AdamW([p for m in modules for p in m.parameters()], lr=1e-3)
        return schedule, stages, modules, opt

    def data(step: int):
        return batch(step, replica)

    def clip(modules) -> None:
        """To norm 1 over the pipeline: every stage's (shards') squares; HSDP's replicas counted once."""
        grads = [p.grad for m in modules for p in m.parameters() if p.grad is not None]
        local = [g.to_local() if isinstance(g, DTensor) else g for g in grads]
        total = torch.stack([g.pow(2).sum() for g in local]).sum()
        if args.replication == "ddp":
            dist.all_reduce(total, group=mesh["pp"].get_group())
        else:
            dist.all_reduce(total)
            total = total / (args.dp // args.shard if args.replication == "hsdp" else 1)
        coef = min(1.0, 1.0 / (float(total.sqrt()) + 1e-6))
        for g in grads:
            g.mul_(coef)

    def run(phase: str, steps: int) -> dict:
        schedule, stages, modules, opt = build()
        guard = None if phase == "plain" else sdcguard.Guard(schedule, opt, config=Config(
            audit_every=1 if phase == "audited" else 0, weight_check_every=1 if phase == "audited" else 0,
            ranks_per_node=args.pp))
        first, last = any(s.is_first for s in stages), any(s.is_last for s in stages)
        times, false = [], 0
        for step in range(steps):
            x, y = data(step)
            args_, target = ((x,) if first else ()), (y if last else None)
            dist.barrier()
            started = time.perf_counter()
            try:
                if guard is None:
                    with seeded(forward_seed(0, step, rank, 0), torch.device("cpu")):
                        schedule.step(*args_, target=target)
                    clip(modules)
                    opt.step()
                else:
                    with guard.step(step) as s:
                        s.run_schedule(*args_, target=target)
                        s.check()
                        clip(modules)
                        opt.step()
            except (sdcguard.SDCDetected, NonFiniteGradient, ReplayError):
                false += 1
            opt.zero_grad(set_to_none=True)
            times.append(time.perf_counter() - started)
        out = {"median": statistics.median(times[1:]), "false": false}
        if guard is not None:
            out.update(audited=guard.history.last_audited_step, weights=guard.history.last_weights_verified_step,
                       plan=guard.plan_lines(), alarms=guard.alarms_raised)
        return out

    phases = {name: run(name, args.timed_steps) for name in ("plain", "unaudited")}
    phases["audited"] = run("audited", args.steps)
    audited = phases["audited"]
    report = {"median": {k: v["median"] for k, v in phases.items()},
              "false_alarms": sum(v["false"] for v in phases.values()),
              "audited_steps": audited["audited"], "weights_verified": audited["weights"], "plan": audited["plan"]}
    Path(args.worker, f"rank{rank:03d}.json").write_text(json.dumps(report))
    dist.barrier()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
