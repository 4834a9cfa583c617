"""Step-time overhead of sdcguard against plain DDP, and against the replay floor.

    .venv/bin/python bench/overhead.py [--rounds 5] [--window 100]

Launches 3 gloo ranks (one thread each) training bench/gpt.py's TinyGPT. In one run, interleaved
round by round, four configurations each train a window of steps on their own DDP replica:
plain DDP, sdcguard with checks 1 and 3 only (weight check every 100), audits every 100, audits
every 10. A configuration's time is the median over rounds of its mean step time per window (a
window holds whole audit periods, so audit steps are counted, not hidden by a median).

The floor for audits every N is 1 + t_replay / (N * t_step): a replay is one more forward and
backward per N steps; t_replay is measured in the same run as the bare module's forward+backward.
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


def worker(out: str, rounds: int, window: int) -> None:
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    sys.path.insert(0, str(HERE))
    from gpt import TinyGPT, lm_batch, lm_loss

    import sdcguard
    from sdcguard.rng import forward_seed, seeded

    dist.init_process_group("gloo")
    torch.set_num_threads(1)
    rank = dist.get_rank()

    def replica():
        torch.manual_seed(0)
        module = TinyGPT()
        return module, DistributedDataParallel(module), None

    def plain_step(ddp, opt, step):
        opt.zero_grad(set_to_none=True)
        with seeded(forward_seed(0, step, rank, 0), torch.device("cpu")):
            loss = lm_loss(ddp, lm_batch(step, rank))
        loss.backward()
        opt.step()

    configs = {}
    module, ddp, _ = replica()
    opt = torch.optim.AdamW(module.parameters(), lr=1e-3)
    configs["plain DDP"] = lambda step, d=ddp, o=opt: plain_step(d, o, step)
    for name, audit, weights in (("checks 1+3 (no audit)", 0, 100), ("audit every 100", 100, 100),
                                 ("audit every 10", 10, 100)):
        module, ddp, _ = replica()
        opt = torch.optim.AdamW(module.parameters(), lr=1e-3)
        guard = sdcguard.Guard(ddp, opt, lm_loss, config=sdcguard.Config(audit_every=audit, weight_check_every=weights))
        configs[name] = lambda step, g=guard: g.train_step(step, lm_batch(step, rank))

    bare, _, _ = replica()

    def replay_like(step):  # what a replay costs: forward + backward on the bare module
        with seeded(forward_seed(0, step, rank, 0), torch.device("cpu")):
            loss = lm_loss(bare, lm_batch(step, rank))
        torch.autograd.grad(loss, list(bare.parameters()))

    for name, fn in configs.items():  # warm-up: lazy inits, DDP bucket rebuild
        for step in range(3):
            fn(step)
    means = {name: [] for name in configs}
    replay_times = []
    step0 = 10
    for _ in range(rounds):
        for name, fn in configs.items():
            dist.barrier()
            started = time.perf_counter()
            for step in range(step0, step0 + window):
                fn(step)
            means[name].append((time.perf_counter() - started) / window)
        started = time.perf_counter()
        for step in range(10):
            replay_like(step)
        replay_times.append((time.perf_counter() - started) / 10)
        step0 += window
    if rank == 0:
        Path(out).write_text(json.dumps({"means": means, "replay": replay_times}))
    dist.destroy_process_group()


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--window", type=int, default=100)
    parser.add_argument("--ranks", type=int, default=3)
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(args.worker, args.rounds, args.window)
        return 0
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp, "result.json")
        env = {**os.environ, "OMP_NUM_THREADS": "1"}
        subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={args.ranks}",
                        __file__, "--rounds", str(args.rounds), "--window", str(args.window), "--worker", str(out)],
                       check=True, env=env)
        result = json.loads(out.read_text())
    median = {name: statistics.median(v) for name, v in result["means"].items()}
    t_step = median["plain DDP"]
    t_replay = statistics.median(result["replay"])
    print(f"{args.ranks} gloo ranks, 1 thread each, TinyGPT; {args.rounds} rounds x {args.window} steps per configuration")
    print(f"plain DDP step {t_step * 1e3:.1f} ms; replay (forward+backward) {t_replay * 1e3:.1f} ms")
    print(f"{'configuration':24s} {'ms/step':>8s} {'x plain':>8s} {'floor':>7s} {'x floor':>8s}")
    for name, t in median.items():
        n = {"audit every 100": 100, "audit every 10": 10}.get(name)
        floor = 1 + t_replay / (n * t_step) if n else 1.0
        print(f"{name:24s} {t * 1e3:8.1f} {t / t_step:8.3f} {floor:7.3f} {t / t_step / floor:8.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
