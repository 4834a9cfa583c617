"""Where an ordinary checked step's time goes on CPU: the comm hook, check 4's arithmetic, the Guard.

    .venv/bin/python bench/ordinary_account.py [--ranks 2] [--steps 300] [--stub]

Launches gloo ranks (one thread each; 2 ranks by default, one per core of this machine, so that
no rank waits for a core) training bench/gpt.py's TinyGPT with AdamW. Four DDP replicas train
side by side, interleaved 10 steps at a time with a barrier before each slice:

  plain+sync  zero_grad, forward + backward, one 16-byte all-reduce, AdamW (the bare sync's row of
              bench/overhead.py: what any check that lets ranks agree before the update costs);
  pyhook      the same with a Python comm hook that only averages (``commhook.allreduce_mean``):
              what running a hook in Python costs;
  recorder    the same with sdcguard's comm hook (``record_then_reduce``: check 4's fold of each
              bucket before and after its all-reduce, the squared norms) and its 16-byte vote in
              place of the bare sync;
  guard       ``guard.train_step`` with audits off: the recorder plus the Guard (step, gate, judge,
              statistics, cost meter).

A figure is ms per step of wall time and of this process's CPU time (user + system, every thread:
gloo's too), per rank. ``--stub`` replaces check 4's arithmetic (``ChecksumWeights.terms`` /
``checksum``) with zeros, keeping DDP's 1/W scaling, so that the recorder and guard rows show what
is left without it (the Python, the vote). Then, on the guard replica, each call of the local
terms is timed in thread CPU three ways per step: on the bucket as the backward left it (what the
step pays), on the same bucket again right after (warm), and on a copy (warm, fresh memory); and
the reduced checksum's calls as they run.

A benchmark may patch the library for a run (timing wrappers, the stub); the library is not changed.
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROWS = ("plain+sync", "pyhook", "recorder", "guard")


def _cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def worker(out: str, steps: int, stub: bool) -> None:
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    sys.path.insert(0, str(HERE))
    from gpt import TinyGPT, lm_batch, lm_loss

    import sdcguard
    from sdcguard.checks import commhook, reduce_checksum
    from sdcguard.checks.rng import forward_seed, seeded

    dist.init_process_group("gloo")
    torch.set_num_threads(1)
    rank = dist.get_rank()
    if stub:
        zeros = torch.zeros(2, dtype=torch.float64)

        def terms(self, index, flat, scale=None):  # noqa: ANN001, ARG001 - the patched method's signature
            if scale is not None:
                flat.mul_(scale)  # DDP's 1/W stays: plain DDP pays it too
            return zeros.clone()
        reduce_checksum.ChecksumWeights.terms = terms
        reduce_checksum.ChecksumWeights.checksum = lambda self, index, flat: zeros[0].clone()

    def replica(row: str) -> dict:
        torch.manual_seed(0)
        module = TinyGPT()
        ddp = DistributedDataParallel(module)
        opt = torch.optim.AdamW(module.parameters(), lr=1e-3)
        r = {"row": row, "ddp": ddp, "opt": opt}
        if row == "pyhook":
            ddp.register_comm_hook(None, commhook.allreduce_mean)
        elif row == "recorder":
            r["rec"] = commhook.GradientRecorder(list(module.parameters()), None)
            ddp.register_comm_hook(r["rec"], commhook.record_then_reduce)
        elif row == "guard":
            r["guard"] = sdcguard.Guard(ddp, opt, lm_loss,
                                        config=sdcguard.Config(audit_every=0, weight_check_every=10 ** 9))
        return r

    def step(r: dict, s: int) -> None:
        if "guard" in r:
            r["guard"].train_step(s, lm_batch(s, rank))
            return
        r["opt"].zero_grad(set_to_none=True)
        rec = r.get("rec")
        if rec is not None:
            rec.begin_step(False, s)
        with seeded(forward_seed(0, s, rank, 0), torch.device("cpu")):
            loss = lm_loss(r["ddp"], lm_batch(s, rank))
        loss.backward()
        if rec is not None:
            vote = rec.vote(torch.device("cpu"))
            dist.all_reduce(vote)
            vote.tolist()
        else:
            dist.all_reduce(torch.zeros(2, dtype=torch.float64))
        r["opt"].step()

    replicas = [replica(row) for row in ROWS]
    for s in range(5):
        for r in replicas:
            step(r, s)
    wall, cpu = Counter(), Counter()
    for first in range(10, 10 + steps, 10):
        for r in replicas:
            dist.barrier()
            c0, t0 = _cpu(), time.perf_counter()
            for s in range(first, first + 10):
                step(r, s)
            wall[r["row"]] += time.perf_counter() - t0
            cpu[r["row"]] += _cpu() - c0

    calls = _time_calls(replicas[-1]["guard"], lambda s: step(replicas[-1], s), steps=min(steps, 100), stub=stub)
    result = {"rank": rank, "wall_ms": {k: wall[k] / steps * 1e3 for k in ROWS},
              "cpu_ms": {k: cpu[k] / steps * 1e3 for k in ROWS}, "calls_us": calls}
    parts = [None] * dist.get_world_size()
    dist.all_gather_object(parts, result)
    if rank == 0:
        Path(out).write_text(json.dumps(parts))
    dist.destroy_process_group()


def _time_calls(guard, run_step, steps: int, stub: bool) -> dict[str, float]:  # noqa: ANN001
    """Thread CPU of check 4's calls on the guard replica, per step (us): the local terms cold (as
    the step pays them), again on the same bucket (warm), on a copy; the reduced checksums."""
    if stub:
        return {}
    from sdcguard.checks import reduce_checksum
    spent: Counter = Counter()
    terms, checksum = reduce_checksum.ChecksumWeights.terms, reduce_checksum.ChecksumWeights.checksum
    inside = {"terms": False}

    def timed_terms(self, index, flat, scale=None):  # noqa: ANN001
        c0 = time.thread_time()
        inside["terms"] = True
        out = terms(self, index, flat, scale)
        c1 = time.thread_time()
        terms(self, index, flat, None)  # the same bucket again, now warm (its scaling already done)
        c2 = time.thread_time()
        copy = flat.clone()
        c3 = time.thread_time()
        terms(self, index, copy, None)
        c4 = time.thread_time()
        inside["terms"] = False
        spent["local terms, the bucket as the backward left it"] += c1 - c0
        spent["local terms, the same bucket again (warm)"] += c2 - c1
        spent["local terms, a warm copy"] += c4 - c3
        return out

    def timed_checksum(self, index, flat):  # noqa: ANN001
        if inside["terms"]:
            return checksum(self, index, flat)
        c0 = time.thread_time()
        out = checksum(self, index, flat)
        spent["reduced checksum (gloo's thread, as the all-reduce completes)"] += time.thread_time() - c0
        return out

    reduce_checksum.ChecksumWeights.terms, reduce_checksum.ChecksumWeights.checksum = timed_terms, timed_checksum
    try:
        for s in range(10_000, 10_000 + steps):
            run_step(s)
    finally:
        reduce_checksum.ChecksumWeights.terms, reduce_checksum.ChecksumWeights.checksum = terms, checksum
    return {k: v / steps * 1e6 for k, v in spent.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--steps", type=int, default=300, help="steps of each row (a multiple of 10)")
    parser.add_argument("--stub", action="store_true", help="check 4's arithmetic replaced by zeros")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(args.worker, args.steps, args.stub)
        return
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "out.json")
        env = {**os.environ, "OMP_NUM_THREADS": "1"}
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={args.ranks}",
               __file__, "--worker", out, "--steps", str(args.steps)] + (["--stub"] if args.stub else [])
        subprocess.run(cmd, check=True, env=env, stdout=subprocess.DEVNULL)
        parts = json.loads(Path(out).read_text())
    print(f"{args.ranks} gloo ranks, 1 thread each, TinyGPT, AdamW; {args.steps} steps per row, interleaved 10 at a time"
          + ("; check 4's arithmetic stubbed out" if args.stub else ""))
    print("| row | " + " | ".join(f"rank {p['rank']} wall ms (x plain+sync) | CPU ms" for p in parts) + " |")
    print("|---|" + "---|---|" * len(parts))
    for row in ROWS:
        cells = []
        for p in parts:
            w, base = p["wall_ms"][row], p["wall_ms"]["plain+sync"]
            cells += [f"{w:.2f} ({w / base:.3f})", f"{p['cpu_ms'][row]:.2f}"]
        print(f"| {row} | " + " | ".join(cells) + " |")
    if parts[0]["calls_us"]:
        print()
        print("| check 4's calls on the guard replica, thread CPU per step | " + " | ".join(f"rank {p['rank']} us" for p in parts) + " |")
        print("|---|" + "---|" * len(parts))
        for key in parts[0]["calls_us"]:
            print(f"| {key} | " + " | ".join(f"{p['calls_us'].get(key, 0):.0f}" for p in parts) + " |")


if __name__ == "__main__":
    main()
