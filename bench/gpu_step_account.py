"""Host synchronisations of an ordinary step on one GPU: plain DDP, sdcguard's synchronous gate,
and the device gate (``Config(device_gate=True)``), counted by CUDA itself.

    python bench/gpu_step_account.py [--device cuda] [--steps 8]

NCCL needs a GPU per rank, so this process is rank 0 of a world of 2 on torch's ``fake`` process
group (``torch.testing._internal.distributed.fake_pg``): every collective returns at once, without
moving data, so the ranks' checks run exactly as on a real job while nothing waits for a peer.
DDP's reduction is a pass-through hook that declares DDP's mean (``averages_like_ddp``): with
every "rank" holding the same gradient, the pass-through is the mean, and check 4 runs and passes.
Each mode trains TinyGPT (bench/gpt.py) with ``AdamW(fused=True)``; after 4 warm-up steps it counts
``--steps`` ordinary steps (zero_grad to the update), times as many without counting, with ``torch.cuda.set_sync_debug_mode("warn")``
(a warning for every call that synchronises with the device) and bench/step_account.py's counter of
tensor methods that read a value to the host; then the device gate runs the same steps once more
under ``set_sync_debug_mode("error")``, where any synchronisation raises.
Printed: per mode and step, CUDA syncs, host value reads, deferred verdict reads, step time.
Exit status 1 if the device gate's ordinary step synchronises at all, or its weights are not bit
for bit those of the synchronous gate's run (the plain run's differ: sdcguard seeds each forward's
dropout per step and rank). Step times are timed apart, without the counting. On CPU (``--device cpu``) it runs too, without the CUDA counts.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
import step_account  # noqa: E402  (bench/step_account.py: the counter)
from gpt import TinyGPT, lm_batch, lm_loss  # noqa: E402

WARMUP = 4


def passthrough_mean(group, bucket):
    """Every fake rank holds the same bucket, so the bucket is its own mean (no 1/W: the fake
    process group does not add the ranks' shares back up)."""
    fut = torch.futures.Future()
    fut.set_result(bucket.buffer())
    return fut


passthrough_mean.averages_like_ddp = True  # check 4 runs (and passes: the bucket is the mean)


def build(mode: str, device: torch.device):
    import sdcguard
    from torch.nn.parallel import DistributedDataParallel
    torch.manual_seed(0)
    module = TinyGPT().to(device)
    ddp = DistributedDataParallel(module, device_ids=[device.index or 0] if device.type == "cuda" else None)
    opt = torch.optim.AdamW(module.parameters(), lr=1e-3, fused=True)
    guard = None
    if mode == "plain":
        ddp.register_comm_hook(None, passthrough_mean)
    else:
        guard = sdcguard.Guard(ddp, opt, lm_loss, reduce_hook=passthrough_mean, reduce_state=None,
                               config=sdcguard.Config(audit_every=0, weight_check_every=0, ranks_per_node=1,
                                                      device_gate=mode == "device gate"))
    return module, ddp, opt, guard


def run(mode: str, device: torch.device, steps: int) -> dict:
    module, ddp, opt, guard = build(mode, device)

    def step(i: int) -> None:
        x = tuple(t.to(device, non_blocking=True) for t in lm_batch(i, 0))
        opt.zero_grad(set_to_none=True)
        if guard is None:
            lm_loss(ddp, x).backward()
            opt.step()
            return
        with guard.step(i) as s:
            s.backward(x)
            s.check()
            opt.step()

    for i in range(WARMUP):
        step(i)
    counts = step_account.Counts()
    for i in range(WARMUP, WARMUP + steps):
        with step_account.counting(counts):
            step(i)
    weights = [p.detach().cpu().clone() for p in module.parameters()]
    times = []  # timed apart: the counting's dispatch mode is slow
    for i in range(WARMUP + steps, WARMUP + 2 * steps):
        if device.type == "cuda":
            torch.cuda.synchronize()
        started = time.perf_counter()
        step(i)
        if device.type == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - started)
    errors = None
    if mode == "device gate" and device.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            for i in range(WARMUP + 2 * steps, WARMUP + 3 * steps):
                step(i)
            errors = "none"
        except RuntimeError as exc:  # a synchronising call raised
            errors = f"{type(exc).__name__}: {exc}"
        finally:
            torch.cuda.set_sync_debug_mode(0)
    if guard is not None:
        guard.close()
    tally = step_account.summarize(counts, steps)["total"]
    return {"cuda_syncs": sum(tally.get("cuda-sync", {}).values()), "host_reads": tally.get("sync", {}),
            "deferred": sum(tally.get("deferred-read", {}).values()), "ms": statistics.median(times) * 1e3,
            "errors": errors, "weights": weights}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--steps", type=int, default=8)
    args = parser.parse_args()
    device = torch.device(args.device)
    if device.type == "cuda":
        torch.cuda.set_device(device.index or 0)
    from torch.testing._internal.distributed.fake_pg import FakeStore
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=2)
    results = {mode: run(mode, device, args.steps) for mode in ("plain", "sync gate", "device gate")}
    print(f"ordinary step on {device} ({torch.cuda.get_device_name(device) if device.type == 'cuda' else 'cpu'}), "
          f"TinyGPT, fused AdamW, rank 0 of 2 on the fake process group; per step, median of {args.steps}")
    print(f"| {'mode':12} | {'CUDA syncs':>10} | {'host value reads':30} | {'deferred reads':>14} | {'step ms':>8} |")
    print(f"|{'-' * 14}|{'-' * 12}|{'-' * 32}|{'-' * 16}|{'-' * 10}|")
    for mode, r in results.items():
        reads = ", ".join(f"{k} x{v:g}" for k, v in sorted(r["host_reads"].items())) or "0"
        print(f"| {mode:12} | {r['cuda_syncs']:>10g} | {reads:30} | {r['deferred']:>14g} | {r['ms']:>8.2f} |")
    gated = results["device gate"]
    same = all(torch.equal(a, b) for a, b in zip(gated["weights"], results["sync gate"]["weights"]))
    print(f"device gate under set_sync_debug_mode('error'): {gated['errors'] or 'not run (no CUDA)'}")
    print(f"device gate bit for bit the synchronous gate's run: {same}")
    ok = same and gated["cuda_syncs"] == 0 and not gated["host_reads"] and gated["errors"] in (None, "none")
    dist.destroy_process_group()
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
