"""Latency of the small collectives the checks use, with nothing else running.

    .venv/bin/python bench/sync_latency.py [--ranks 3] [--iters 500]

Times a 16-byte all-gather, all-reduces of 1 to 6 float64 elements, a 24-byte send/receive round
between ring neighbours and a barrier on gloo, back to back (median and 90th percentile over
`--iters` calls, after 50 warm-up calls, measured on rank 0). Check 1 makes every rank agree before
the update with one such collective per step, and an audit step with one more: this is their
floor. (On gloo, all-reduces of 3 or more elements and all-gathers have a ~4 ms tail where 1 or 2
elements do not: sdcguard's per-step and per-audit agreements are 2 elements each.)
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
    rank = dist.get_rank()
    head_out, head_in = torch.zeros(3, dtype=torch.int64), torch.empty(3, dtype=torch.int64)

    def ring_round():  # what an audit's batch header costs: to the previous rank, from the next
        ops = [dist.P2POp(dist.irecv, head_in, (rank + 1) % world), dist.P2POp(dist.isend, head_out, (rank - 1) % world)]
        for work in dist.batch_isend_irecv(ops):
            work.wait()

    calls = {"all-gather 16 B": lambda: gather(rows, norms)}
    for n in (1, 2, 3, 6):
        calls[f"all-reduce {8 * n} B"] = lambda t=torch.zeros(n, dtype=torch.float64): dist.all_reduce(t)
    calls["ring send/recv 24 B"] = ring_round
    calls["barrier"] = dist.barrier
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
            print(f"{world} ranks  {name:20s} median {statistics.median(times) * 1e6:6.0f} us  p90 {p90 * 1e6:6.0f} us",
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
