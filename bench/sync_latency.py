"""Latency of the small collectives the checks use, with nothing else running.

    .venv/bin/python bench/sync_latency.py [--ranks 3] [--iters 500]

Times a 16-byte all-gather, a 16-byte all-reduce and a barrier on gloo, back to back (median and
90th percentile over `--iters` calls, after 50 warm-up calls, measured on rank 0). Check 1 makes
every rank agree before the update with one such collective per step; this is its floor.
"""
import argparse
import os
import statistics
import subprocess
import sys
import time


def worker(iters: int) -> None:
    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo")
    torch.set_num_threads(1)
    world = dist.get_world_size()
    norms = torch.zeros(2, dtype=torch.float64)
    rows = torch.empty(2 * world, dtype=torch.float64)
    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    calls = {
        "all-gather 16 B": lambda: gather(rows, norms),
        "all-reduce 16 B": lambda: dist.all_reduce(norms),
        "barrier": dist.barrier,
    }
    for name, call in calls.items():
        for _ in range(50):
            call()
        times = []
        for _ in range(iters):
            started = time.perf_counter()
            call()
            times.append(time.perf_counter() - started)
        if dist.get_rank() == 0:
            p90 = statistics.quantiles(times, n=10)[-1]
            print(f"{world} ranks  {name:16s} median {statistics.median(times) * 1e6:6.0f} us  p90 {p90 * 1e6:6.0f} us",
                  flush=True)
    dist.destroy_process_group()


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--ranks", type=int, default=3)
    parser.add_argument("--iters", type=int, default=500)
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(args.iters)
        return 0
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone",
                           f"--nproc_per_node={args.ranks}", __file__, "--iters", str(args.iters), "--worker"],
                          env=env).returncode


if __name__ == "__main__":
    sys.exit(main())
