"""Step-time overhead of sdcguard against plain DDP, and against the replay floor.

    .venv/bin/python bench/overhead.py [--rounds 5] [--window 100] [--ranks 3] [--slice 10] [--sharded 2x2] [--tp 2]
                                       [--pp 2 [--dp 2]]

Launches 3 gloo ranks (one thread each) training bench/gpt.py's TinyGPT. Six configurations,
each on its own DDP replica: plain DDP; plain DDP plus one 16-byte all-reduce between backward and
update (no check: the price of the one synchronisation that lets ranks agree before the update,
which checks 1a/1b need); sdcguard with checks 1 and 3 only (weight check every 100); audits
every 100; audits every 10 (all three through ``train_step``); audits every 10 through the
user's-loop API ``guard.step`` (what the API itself costs, against the row above it). A round trains every configuration for the same window
of steps (whole audit periods, so audit steps are counted, not hidden by a median), interleaved
slice by slice (`--slice` steps of each in turn, 10 by default; with 1 every step starts with
caches full of another replica, as with a model too big for them), so that a burst of noise from a neighbour on this
shared machine lands on all of them alike. A configuration's figure is the median over rounds of
its time divided by plain DDP's time in the same round; the spread over rounds (min-max) is
printed beside it.

The floor for audits every N is 1 + t_replay / (N * t_step): a replay is one more forward and
backward per N steps; t_replay is measured in the same run as the bare module's forward+backward.

``--sharded RxS`` measures a model sharded with FSDP2 instead (``fully_shard`` per block and on the
root over an ``init_device_mesh("cpu", (R, S), ("replicate", "shard"))`` mesh; ``1xS``: pure FSDP
over a 1-D mesh), on R*S ranks, against plain FSDP2: plain FSDP2; plus one 16-byte all-reduce;
sdcguard's checks 1, 3 (HSDP) and 4 without audits (check 3 every 100 steps); audits every 10 (the
step API); check 3 on every step (pure FSDP: the update re-run, ``sharding/update_check.py``). A sharded replay is one more forward and backward of the whole mesh, all-gathers
included, with nothing reduced: t_replay is a plain FSDP2 replica's forward+backward with its
gradient reduction off (``set_requires_gradient_sync(False)``), measured in the same run.

``--pp P`` measures a pipeline instead (``torch.distributed.pipelining``, 1F1B, 4 micro-batches), on
P * ``--dp`` ranks laid out ``(dp, pp)``, a replica's stages on one "node" as in bench/pipeline.py
(its model family, ``bench/pp_model.py``): each stage module wrapped in DDP over the ranks holding
that stage, AdamW, gradient clipping over the pipeline, ``Guard(schedule, optimizer)`` and
``s.run_schedule``. Rows: the plain pipeline step; sdcguard's ordinary steps (checks 1 and 4 on
every step, check 3 every 100, no audit); audits every 100; audits every 10; and the replay floor,
a plain step followed by one replay-like pass, interleaved with the others in the same windows. A pipeline's
replay is one more pass of the schedule (every stage's forward and backward, with its
point-to-point transfers) on the bare stage modules, nothing reduced: that pass on a replica of bare
stages (``PipelineStage`` without DDP, ``scale_grads=False``, as the layout's replay builds it). The
floor of audits every N is 1 + (floor row / plain - 1) / N, per round; t_replay, timed after each
round as for DDP, is printed beside it.
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

HERE = Path(__file__).resolve().parent
AUDIT_EVERY = {"audit every 100": 100, "audit every 10": 10, "step API, audit every 10": 10,
               "audit every 10 (step API)": 10}
SYNC_ONLY = "plain + one 16 B sync"
WEIGHTS_EVERY_STEP = "checks 1+3+4, check 3 every step"
"""Sharded: check 3 on every step (HSDP: each shard across its replicas; pure FSDP: the update re-run),
against the row with check 3 every 100 steps: what one weight-check step adds."""
PLAIN_PIPELINE = "plain pipeline"
REPLAY_FLOOR = "plain + one replay pass"
"""A plain step followed by one replay-like pass, interleaved with the others: the floor of an audit on
every step, measured in the same windows (``--pp``); the floor of audits every N is 1 + (its ratio - 1) / N."""


def worker(out: str, rounds: int, window: int, slice_steps: int, sharded: str | None = None, tp: int = 1,
           pp: int = 0, dp: int = 2) -> None:
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    sys.path.insert(0, str(HERE))
    from gpt import TinyGPT, lm_batch, lm_loss

    import sdcguard
    from sdcguard.checks.rng import forward_seed, seeded

    dist.init_process_group("gloo")
    torch.set_num_threads(1)
    rank = dist.get_rank()
    if pp:
        configs, replay_like = _pipeline_configs(pp, dp, rank)
        _measure(out, configs, replay_like, rounds, window, slice_steps, baseline=PLAIN_PIPELINE)
        return
    if sharded:
        configs, replay_like = _sharded_configs(sharded, rank, tp)
        _measure(out, configs, replay_like, rounds, window, slice_steps, baseline="plain FSDP2")
        return

    def replica():
        torch.manual_seed(0)
        module = TinyGPT()
        return module, DistributedDataParallel(module), None

    def plain_step(ddp, opt, step, sync=False):
        opt.zero_grad(set_to_none=True)
        with seeded(forward_seed(0, step, rank, 0), torch.device("cpu")):
            loss = lm_loss(ddp, lm_batch(step, rank))
        loss.backward()
        if sync:  # what any check that makes ranks agree before the update costs at least
            dist.all_reduce(torch.zeros(2, dtype=torch.float64))
        opt.step()

    configs = {}
    for name, sync in (("plain DDP", False), (SYNC_ONLY, True)):
        module, ddp, _ = replica()
        opt = torch.optim.AdamW(module.parameters(), lr=1e-3)
        configs[name] = lambda step, d=ddp, o=opt, s=sync: plain_step(d, o, step, s)
    for name, audit, weights in (("checks 1+3 (no audit)", 0, 100), ("audit every 100", 100, 100),
                                 ("audit every 10", 10, 100)):
        module, ddp, _ = replica()
        opt = torch.optim.AdamW(module.parameters(), lr=1e-3)
        guard = sdcguard.Guard(ddp, opt, lm_loss, config=sdcguard.Config(audit_every=audit, weight_check_every=weights))
        configs[name] = lambda step, g=guard: g.train_step(step, lm_batch(step, rank))
    # The same as "audit every 10" through the user's-loop API (guard.step): what the API itself costs.
    module, ddp, _ = replica()
    opt = torch.optim.AdamW(module.parameters(), lr=1e-3)
    guard = sdcguard.Guard(ddp, opt, lm_loss, config=sdcguard.Config(audit_every=10, weight_check_every=100))

    def step_api(step, g=guard, o=opt):
        with g.step(step) as s:
            s.backward(lm_batch(step, rank))
            s.check()
            o.step()
            o.zero_grad(set_to_none=True)
    configs["step API, audit every 10"] = step_api

    bare, _, _ = replica()

    def replay_like(step):  # what a replay costs: forward + backward on the bare module
        with seeded(forward_seed(0, step, rank, 0), torch.device("cpu")):
            loss = lm_loss(bare, lm_batch(step, rank))
        torch.autograd.grad(loss, list(bare.parameters()))

    _measure(out, configs, replay_like, rounds, window, slice_steps, baseline="plain DDP")


def _measure(out, configs, replay_like, rounds, window, slice_steps, baseline):
    """Every configuration through the same windows, interleaved slice by slice; rank 0 writes
    the mean step time of each per round, and the replay's."""
    import torch.distributed as dist

    for name, fn in configs.items():  # warm-up: lazy inits, DDP bucket rebuild
        for step in range(3):
            fn(step)
    means = {name: [] for name in configs}
    replay_times = []
    step0 = 10
    for _ in range(rounds):
        spent = dict.fromkeys(configs, 0.0)
        for first in range(step0, step0 + window, slice_steps):
            for name, fn in configs.items():
                dist.barrier()
                started = time.perf_counter()
                for step in range(first, min(first + slice_steps, step0 + window)):
                    fn(step)
                spent[name] += time.perf_counter() - started
        for name in configs:
            means[name].append(spent[name] / window)
        started = time.perf_counter()
        for step in range(10):
            replay_like(step)
        replay_times.append((time.perf_counter() - started) / 10)
        step0 += window
    if dist.get_rank() == 0:
        Path(out).write_text(json.dumps({"means": means, "replay": replay_times, "baseline": baseline}))
    dist.barrier()
    dist.destroy_process_group()


def _sharded_configs(mesh_shape: str, rank: int, tp: int = 1):
    """The sharded configurations, each on its own FSDP2 replica of TinyGPT, and the replay's
    stand-in (the whole mesh's forward+backward, all-gathers included, reducing nothing). With
    ``tp`` > 1 each block's MLP is tensor parallel over ``tp`` consecutive ranks (``mlp.0``
    column-wise, ``mlp.2`` row-wise, before ``fully_shard``); a TP group trains on one batch."""
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    sys.path.insert(0, str(HERE))
    from gpt import TinyGPT, lm_batch, lm_loss

    import sdcguard
    from sdcguard.checks.rng import forward_seed, seeded

    replicas, shards = (int(x) for x in mesh_shape.lower().split("x"))
    full = None
    if tp > 1:
        from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module
        full = init_device_mesh("cpu", (replicas, shards, tp), mesh_dim_names=("replicate", "shard", "tp"))
        mesh = full["replicate", "shard"]
    else:
        mesh = (init_device_mesh("cpu", (replicas, shards), mesh_dim_names=("replicate", "shard")) if replicas > 1
                else init_device_mesh("cpu", (shards,), mesh_dim_names=("shard",)))
    data_rank, seed_rank = rank // tp, rank - rank % tp  # a TP group: one batch, one dropout mask

    def replica():
        torch.manual_seed(0)
        module = TinyGPT()
        for block in module.blocks:
            if full is not None:
                parallelize_module(block, full["tp"], {"mlp.0": ColwiseParallel(), "mlp.2": RowwiseParallel()})
            fully_shard(block, mesh=mesh)
        fully_shard(module, mesh=mesh)
        return module, torch.optim.AdamW(module.parameters(), lr=1e-3)

    def plain_step(model, opt, step, sync=False):
        opt.zero_grad(set_to_none=True)
        with seeded(forward_seed(0, step, seed_rank, 0), torch.device("cpu")):
            loss = lm_loss(model, lm_batch(step, data_rank))
        loss.backward()
        if sync:
            dist.all_reduce(torch.zeros(2, dtype=torch.float64))
        opt.step()

    configs = {}
    for name, sync in (("plain FSDP2", False), (SYNC_ONLY, True)):
        model, opt = replica()
        configs[name] = lambda step, m=model, o=opt, s=sync: plain_step(m, o, step, s)
    for name, audit, weights in (("checks 1+3+4 (no audit)", 0, 100), ("audit every 10 (step API)", 10, 100),
                                 (WEIGHTS_EVERY_STEP, 0, 1)):
        model, opt = replica()
        guard = sdcguard.Guard(model, opt, lm_loss, config=sdcguard.Config(audit_every=audit, weight_check_every=weights,
                                                                            ranks_per_node=tp))

        def step_api(step, g=guard, o=opt):
            with g.step(step) as s:
                s.backward(lm_batch(step, data_rank))
                s.check()
                o.step()
                o.zero_grad(set_to_none=True)
            update = getattr(g.layout, "update_check", None)
            if update is not None and g.config.weight_check_every == 1 and step == 2 and rank == 0:  # once, in the warm-up
                print(f"update re-run: rank 0 sent {update.bytes_sent} bytes per weight-check step (tensor data "
                      f"{update.last_nbytes}); ms: " + ", ".join(f"{k} {v * 1e3:.1f}" for k, v in update.seconds.items()),
                      flush=True)
        configs[name] = step_api
    bare, _ = replica()
    bare.set_requires_gradient_sync(False)  # what a replay costs: forward + backward, nothing reduced

    def replay_like(step):
        with seeded(forward_seed(0, step, seed_rank, 0), torch.device("cpu")):
            loss = lm_loss(bare, lm_batch(step, data_rank))
        loss.backward()
    return configs, replay_like


def _pipeline_configs(pp: int, dp: int, rank: int):
    """The pipeline configurations (``--pp``), each on its own replica of every stage (DDP over the
    stage's data-parallel group, its own ``PipelineStage`` and 1F1B schedule), and the replay's
    stand-in: the schedule on bare stage modules (no DDP, gradients not divided by the micro-batch
    count), as ``layouts/pipeline.py`` replays."""
    import torch
    import torch.nn.functional as F
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B
    from torch.nn.parallel import DistributedDataParallel

    sys.path.insert(0, str(HERE))
    from pp_model import MICRO_BATCHES, batch, clip, stage_module

    import sdcguard
    from sdcguard.checks.rng import forward_seed, seeded

    mesh = init_device_mesh("cpu", (dp, pp), mesh_dim_names=("dp", "pp"))
    position, replica = mesh["pp"].get_local_rank(), mesh["dp"].get_local_rank()
    pp_group, dp_group, cpu = mesh["pp"].get_group(), mesh["dp"].get_group(), torch.device("cpu")

    def inputs(step):
        x, y = batch(step, replica)
        return ((x,) if position == 0 else ()), (y if position == pp - 1 else None)

    def pipeline(ddp: bool = True, **schedule_options):
        module = stage_module(position, pp)
        held = DistributedDataParallel(module, process_group=dp_group, find_unused_parameters=True) if ddp else module
        stage = PipelineStage(held, position, pp, cpu, group=pp_group)
        schedule = Schedule1F1B(stage, MICRO_BATCHES, loss_fn=F.cross_entropy, **schedule_options)
        return module, schedule, torch.optim.AdamW(module.parameters(), lr=1e-3)

    def plain_step(step, module, schedule, opt):
        args, target = inputs(step)
        with seeded(forward_seed(0, step, rank, 0), cpu):
            schedule.step(*args, target=target)
        clip([module], pp_group)
        opt.step()
        opt.zero_grad(set_to_none=True)

    module, schedule, opt = pipeline()
    configs = {PLAIN_PIPELINE: lambda step, m=module, s=schedule, o=opt: plain_step(step, m, s, o)}
    for name, audit in (("checks 1+3+4 (no audit)", 0), ("audit every 100", 100), ("audit every 10", 10)):
        module, schedule, opt = pipeline()
        guard = sdcguard.Guard(schedule, opt, config=sdcguard.Config(audit_every=audit, weight_check_every=100,
                                                                     ranks_per_node=pp))

        def guarded(step, g=guard, m=module, o=opt):
            args, target = inputs(step)
            with g.step(step) as s:
                s.run_schedule(*args, target=target)
                s.check()
                clip([m], pp_group)
                o.step()
            o.zero_grad(set_to_none=True)
        configs[name] = guarded
    bare, replay_schedule, _ = pipeline(ddp=False, scale_grads=False)

    def replay_like(step):
        args, target = inputs(step)
        with seeded(forward_seed(0, step, rank, 0), cpu):
            replay_schedule.step(*args, target=target, losses=[])
        for p in bare.parameters():  # a replay sets the real gradients aside and drops its own
            p.grad = None
    replay_like(0)  # the schedule's first step infers shapes: not part of a replay's price
    module, schedule, opt = pipeline()

    def floor_step(step, m=module, s=schedule, o=opt):
        plain_step(step, m, s, o)
        replay_like(step)
    configs[REPLAY_FLOOR] = floor_step
    return configs, replay_like


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--window", type=int, default=100)
    parser.add_argument("--ranks", type=int, default=3)
    parser.add_argument("--slice", type=int, default=10, help="steps of one configuration before the next takes its turn")
    parser.add_argument("--sharded", metavar="RxS",
                        help="FSDP2 over an R x S (replicate, shard) mesh on R*S ranks instead of DDP (1xS: pure FSDP)")
    parser.add_argument("--tp", type=int, default=1,
                        help="with --sharded: each block's MLP tensor parallel over T consecutive ranks (R*S*T ranks)")
    parser.add_argument("--pp", type=int, default=0,
                        help="a pipeline of P stages (1F1B, DDP over each stage) instead of DDP, on P * --dp ranks")
    parser.add_argument("--dp", type=int, default=2, help="with --pp: the data-parallel replicas of each stage")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.tp > 1 and not args.sharded:
        parser.error("--tp needs --sharded RxS (tensor parallelism under FSDP2 over the data-parallel mesh)")
    if args.pp and (args.sharded or args.pp < 2 or args.dp < 2):
        parser.error("--pp P needs P >= 2 and --dp >= 2 (every stage replicated), without --sharded")
    if args.worker:
        worker(args.worker, args.rounds, args.window, args.slice, args.sharded, args.tp, args.pp, args.dp)
        return 0
    ranks = args.ranks
    extra = []
    if args.pp:
        ranks, extra = args.pp * args.dp, ["--pp", str(args.pp), "--dp", str(args.dp)]
    if args.sharded:
        replicas, shards = (int(x) for x in args.sharded.lower().split("x"))
        ranks, extra = replicas * shards * args.tp, ["--sharded", args.sharded, "--tp", str(args.tp)]
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp, "result.json")
        env = {**os.environ, "OMP_NUM_THREADS": "1"}
        subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={ranks}",
                        __file__, "--rounds", str(args.rounds), "--window", str(args.window), "--slice", str(args.slice),
                        *extra, "--worker", str(out)],
                       check=True, env=env)
        result = json.loads(out.read_text())
    means, replays, baseline = result["means"], result["replay"], result["baseline"]
    plain = means[baseline]
    model = f"TinyGPT, FSDP2 mesh {args.sharded} (fully_shard per block and root)" if args.sharded else "TinyGPT"
    model += f", each block's MLP tensor parallel over {args.tp} ranks" if args.tp > 1 else ""
    if args.pp:
        model = (f"bench/pp_model.py, PP {args.pp} x DP {args.dp} (1F1B, 4 micro-batches, DDP over each stage, "
                 "ranks (dp, pp))")
    replay = "the schedule on the bare stages" if args.pp else "forward+backward"
    print(f"{ranks} gloo ranks, 1 thread each, {model}; {args.rounds} rounds x {args.window} steps per "
          f"configuration, interleaved {args.slice} steps at a time")
    print(f"{baseline} step {statistics.median(plain) * 1e3:.1f} ms; replay ({replay}) "
          f"{statistics.median(replays) * 1e3:.1f} ms")
    print(f"{'configuration':26s} {'ms/step':>8s} {'x plain':>8s} {'(min-max)':>13s} {'floor':>7s} {'x plain - floor':>16s}")
    measured_floor = means.get(REPLAY_FLOOR)  # --pp: the floor measured in the same windows
    for name, times in means.items():
        n = 1 if name == REPLAY_FLOOR else AUDIT_EVERY.get(name)
        # Paired within each round: this configuration against the baseline in the same round.
        ratios = [t / p for t, p in zip(times, plain)]
        if measured_floor is not None:
            floors = [1 + (f / p - 1) / n if n else 1.0 for f, p in zip(measured_floor, plain)]
        else:
            floors = [1 + r / (n * p) if n else 1.0 for r, p in zip(replays, plain)]
        excess = statistics.median(x - f for x, f in zip(ratios, floors))
        print(f"{name:26s} {statistics.median(times) * 1e3:8.1f} {statistics.median(ratios):8.3f} "
              f"{f'({min(ratios):.3f}-{max(ratios):.3f})':>13s} {statistics.median(floors):7.3f} {excess:+16.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
