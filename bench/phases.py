"""Where sdcguard's per-step time goes: a per-phase account, measured in one run.

    .venv/bin/python bench/phases.py [--steps 200] [--ranks 3]

Launches 3 gloo ranks (one thread each) training bench/gpt.py's TinyGPT in four configurations,
each on its own replica, interleaved 10 steps at a time: plain DDP; checks 1+3(+4) with no audit
(``train_step``); audits every 10 (``train_step``); audits every 10 through the step API. Rank 0
times each phase by wrapping the library's own functions for this run (a benchmark may; the
library is not changed): the comm hook's recording (the local bucket's norm and checksum; the reduced bucket's checksum, on
gloo's worker thread), the
vote, the vote all-reduce, check 4's judgement, the weight fingerprint and its agreement, the
batch transfer, the replay, the digests and comparison, the statistics, and what remains (the
step API's bookkeeping). Each figure is **thread CPU time** per step (`time.thread_time`), so the
account holds on a machine shared with other work; wall time per step is printed beside it for
the configuration as a whole. A phase's figure includes what it calls, and phases do not overlap.
"""
import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path

HERE = Path(__file__).resolve().parent
CONFIGS = ("plain DDP", "checks 1+3(+4), no audit", "audit every 10", "step API, audit every 10")


def worker(out: str, steps: int) -> None:
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    sys.path.insert(0, str(HERE))
    from gpt import TinyGPT, lm_batch, lm_loss

    import sdcguard
    from sdcguard import verification
    from sdcguard.checks import audit, commhook, exchange, reduce_checksum, replay
    from sdcguard.checks.rng import forward_seed, seeded
    from sdcguard.contract import stats

    dist.init_process_group("gloo")
    torch.set_num_threads(1)
    rank = dist.get_rank()
    spent: dict[str, float] = defaultdict(float)
    active = [None]  # the configuration being timed
    import threading
    depth = threading.local()  # per thread: gloo's worker thread runs the reduced bucket's part

    def timed(phase, fn):
        def wrapper(*args, **kwargs):
            if getattr(depth, "n", 0):  # inside another timed phase of this thread: counted there
                return fn(*args, **kwargs)
            depth.n = 1
            started = time.thread_time()
            try:
                return fn(*args, **kwargs)
            finally:
                depth.n = 0
                if active[0] is not None:
                    spent[(active[0], phase)] += time.thread_time() - started
        return wrapper

    # Each phase by the function that does it, patched where it is looked up.
    patches = [
        (reduce_checksum.ChecksumWeights, "terms", "comm hook: local norm + checksum"),
        (reduce_checksum.ChecksumWeights, "checksum", "comm hook: reduced checksum"),
        (commhook.GradientRecorder, "record_fingerprints", "comm hook: fingerprints (audit)"),
        (commhook.GradientRecorder, "vote", "vote (check 1/4 operands)"),
        (verification, "sum_votes", "vote all-reduce (16 B)"),
        (verification, "judge_checksum", "check 4 judgement"),
        (verification, "fingerprint_weights", "weight fingerprint"),
        (verification, "agree", "agreement all-reduce (16 B)"),
        (verification, "serialize", "batch transfer"),
        (audit.Replayer, "post_batch", "batch transfer"),
        (exchange.Incoming, "receive", "batch transfer"),
        (audit.Replayer, "run", "replay"),
        (replay.PassResult, "digest", "digests + comparison"),
        (commhook.GradientRecorder, "fingerprints", "digests + comparison"),
        (stats.CheckStats, "timed", "statistics"),
        (stats.CheckStats, "flush", "statistics"),
    ]
    for owner, name, phase in patches:
        setattr(owner, name, timed(phase, getattr(owner, name)))

    def replica(audit_every=None):
        torch.manual_seed(0)
        module = TinyGPT()
        ddp = DistributedDataParallel(module)
        opt = torch.optim.AdamW(module.parameters(), lr=1e-3)
        guard = None if audit_every is None else sdcguard.Guard(
            ddp, opt, lm_loss, config=sdcguard.Config(audit_every=audit_every, weight_check_every=100))
        return ddp, opt, guard

    ddp0, opt0, _ = replica()

    def plain(step):
        opt0.zero_grad(set_to_none=True)
        with seeded(forward_seed(0, step, rank, 0), torch.device("cpu")):
            loss = lm_loss(ddp0, lm_batch(step, rank))
        loss.backward()
        opt0.step()

    _, _, g1 = replica(0)
    _, _, g10 = replica(10)
    _, opt_api, g_api = replica(10)

    def step_api(step):
        with g_api.step(step) as s:
            s.backward(lm_batch(step, rank))
            s.check()
            opt_api.step()
            opt_api.zero_grad(set_to_none=True)

    fns = {CONFIGS[0]: plain, CONFIGS[1]: lambda s: g1.train_step(s, lm_batch(s, rank)),
           CONFIGS[2]: lambda s: g10.train_step(s, lm_batch(s, rank)), CONFIGS[3]: step_api}
    for fn in fns.values():  # warm-up: lazy inits, DDP bucket rebuild
        for step in range(3):
            fn(step)
    cpu: dict[str, float] = defaultdict(float)
    wall: dict[str, float] = defaultdict(float)
    for first in range(10, 10 + steps, 10):
        for name, fn in fns.items():
            dist.barrier()
            active[0] = name
            started, started_cpu = time.perf_counter(), time.thread_time()
            for step in range(first, first + 10):
                fn(step)
            cpu[name] += time.thread_time() - started_cpu
            wall[name] += time.perf_counter() - started
            active[0] = None
    if rank == 0:
        Path(out).write_text(json.dumps({
            "cpu": cpu, "wall": wall, "steps": steps,
            "phases": [[c, p, t] for (c, p), t in spent.items()]}))
    dist.destroy_process_group()


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=200, help="steps per configuration (multiples of 10)")
    parser.add_argument("--ranks", type=int, default=3)
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(args.worker, args.steps)
        return 0
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp, "result.json")
        env = {**os.environ, "OMP_NUM_THREADS": "1"}
        subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={args.ranks}",
                        __file__, "--steps", str(args.steps), "--worker", str(out)], check=True, env=env)
        result = json.loads(out.read_text())
    n = result["steps"]
    cpu, wall = result["cpu"], result["wall"]
    phases: dict[str, dict[str, float]] = defaultdict(dict)
    for config, phase, t in result["phases"]:
        phases[config][phase] = t
    base = cpu[CONFIGS[0]] / n
    print(f"{args.ranks} gloo ranks, TinyGPT, {n} steps per configuration; rank 0's thread CPU time per step "
          f"(plain DDP {base * 1e3:.2f} ms CPU, {wall[CONFIGS[0]] / n * 1e3:.2f} ms wall)")
    for config in CONFIGS[1:]:
        total = cpu[config] / n
        print(f"\n{config}: {total * 1e3:.2f} ms CPU per step = plain x {total / base:.3f} "
              f"(wall x {wall[config] / wall[CONFIGS[0]]:.3f})")
        accounted = 0.0
        for phase, t in sorted(phases[config].items(), key=lambda kv: -kv[1]):
            accounted += t / n
            print(f"  {phase:36s} {t / n * 1e3:7.3f} ms  {t / n / base:+.4f} of a step")
        rest = total - base - accounted
        print(f"  {'the rest (step API, bookkeeping)':36s} {rest * 1e3:7.3f} ms  {rest / base:+.4f} of a step")
    return 0


if __name__ == "__main__":
    sys.exit(main())
