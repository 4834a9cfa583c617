"""What the update re-run (pure FSDP's check 3) costs one rank per weight-check step, by part.

    .venv/bin/python bench/update_replay.py [--elements 4194304] [--tensors 8] [--repeats 5]

In one process, one thread: a local shard of ``--elements`` float32 elements in ``--tensors``
parameters, with an optimizer that has stepped once (its state exists). Per optimizer: the
optimizer's own ``step()`` (what the training step pays anyway), then each part a weight-check step
adds on a rank — the copy before the update (``take_snapshot``), the serialization that travels
(the copy framed as raw bytes, and unpacked on the receiver), the re-run of the neighbour's
update (``rerun``: one more optimizer step over a copy) and the digests of the result on both sides
(``result_digest``) — and the bytes sent. The transfer itself (one point-to-point send of those bytes) is the network's and not
timed here; bench/overhead.py --sharded 1xS times the whole step on gloo.
"""
import argparse
import statistics
import time

import torch

from sdcguard.checks.exchange import Incoming
from sdcguard.sharding.update_check import _frame, _unframe
from sdcguard.checks.update_replay import owner_result, rerun, result_digest, take_snapshot

OPTIMIZERS = {"AdamW": (torch.optim.AdamW, {"lr": 1e-3}), "SGD momentum": (torch.optim.SGD, {"lr": 1e-2, "momentum": 0.9})}


def _timed(fn, repeats):
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        out = fn()
        times.append(time.perf_counter() - started)
    return statistics.median(times) * 1e3, out


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--elements", type=int, default=1 << 22)
    parser.add_argument("--tensors", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    torch.set_num_threads(1)
    per = args.elements // args.tensors
    print(f"local shard: {args.tensors} tensors x {per} float32 elements ({args.elements * 4 / 2**20:.0f} MiB), "
          f"1 thread, median of {args.repeats}")
    print(f"{'optimizer':14s} {'own step':>9s} {'copy':>7s} {'send+load':>10s} {'re-run':>7s} {'digests':>13s} "
          f"{'added':>7s} {'x step':>7s} {'bytes sent':>11s} {'x shard':>8s}")
    for name, (cls, kwargs) in OPTIMIZERS.items():
        torch.manual_seed(0)
        params = [torch.nn.Parameter(torch.randn(per)) for _ in range(args.tensors)]
        opt = cls(params, **kwargs)
        for p in params:
            p.grad = torch.randn_like(p)
        opt.step()  # the state exists, as after the first step

        def own():
            return opt.step()
        step_ms, _ = _timed(own, args.repeats)
        copy_ms, snap = _timed(lambda: take_snapshot(opt, 1), args.repeats)
        cpu = torch.device("cpu")
        send_ms, _ = _timed(lambda: _unframe(Incoming(bytes(16), _frame(snap), [], cpu, None), cpu), args.repeats)
        blob_bytes = _frame(snap).numel()
        rerun_ms, result = _timed(lambda: rerun(cls, snap), args.repeats)
        fp_ms, _ = _timed(lambda: (result_digest(result), result_digest(owner_result(opt, snap.names))), args.repeats)
        added = copy_ms + send_ms + rerun_ms + fp_ms
        shard = args.elements * 4
        print(f"{name:14s} {step_ms:8.1f}ms {copy_ms:6.1f}ms {send_ms:9.1f}ms {rerun_ms:6.1f}ms {fp_ms:12.1f}ms "
              f"{added:6.1f}ms {added / step_ms:7.2f} {blob_bytes:11d} {blob_bytes / shard:8.2f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
