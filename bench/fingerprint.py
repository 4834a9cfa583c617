"""Fingerprint throughput as a fraction of the same device's copy bandwidth, per dtype and size.

    .venv/bin/python bench/fingerprint.py [--device cpu|cuda] [--threads 1] [--backend auto|torch|triton]

For each dtype (fp32, bf16, fp16, int8) and size, first checks that the fingerprint on the device
equals the CPU torch path bit for bit (a mismatch aborts the run), then times
`sdcguard.fingerprint`, `tensor.clone()`
and a copy into a preallocated tensor (`dst.copy_(x)`) in the same run (best of several
repetitions) and prints bytes/s and the ratios. A copy reads and writes every byte, the fingerprint
only reads: a ratio of 1.0 means the fingerprint costs what one copy costs. `clone` also pays for
fresh memory (page faults on large sizes); `copy_` is the stricter baseline. Temporary memory: on CUDA the peak extra allocation is printed; on CPU
the chunked algorithm's temporaries are O(rows + 2048) int64 per 1 MiB chunk.
"""
import argparse
import time

import torch

from sdcguard.fingerprint import fingerprint

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16, "int8": torch.int8}
SIZES_MIB = (1, 16, 64, 256)


def best_of(fn, device: torch.device, reps: int) -> float:
    best = float("inf")
    for _ in range(reps):
        if device.type == "cuda":
            torch.cuda.synchronize()
        started = time.perf_counter()
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize()
        best = min(best, time.perf_counter() - started)
    return best


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--backend", default="auto", choices=("auto", "torch", "triton"))
    parser.add_argument("--sizes", default=",".join(map(str, SIZES_MIB)), help="MiB, comma-separated")
    args = parser.parse_args()
    sizes = [int(x) for x in args.sizes.split(",")]
    torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    print(f"device {device}, torch threads {torch.get_num_threads()}, best of {args.reps}, "
          f"backend {args.backend}")
    print(f"{'dtype':5s} {'MiB':>5s} {'fingerprint GB/s':>17s} {'clone GB/s':>11s} {'copy_ GB/s':>11s} "
          f"{'vs clone':>9s} {'vs copy_':>9s} {'peak extra MiB':>15s}")
    for name, dtype in DTYPES.items():
        for mib in sizes:
            numel = mib * 2**20 // torch.empty((), dtype=dtype).element_size()
            x = (torch.randn(numel, device=device) * 50).to(dtype)
            got = fingerprint(x, backend=args.backend)  # also the warm-up (caches, compilation)
            want = fingerprint(x.cpu(), backend="torch")
            if got != want:
                raise SystemExit(f"MISMATCH {name} {mib} MiB on {device}: {got} != {want}")
            t_fp = best_of(lambda: fingerprint(x, backend=args.backend), device, args.reps)
            t_clone = best_of(lambda: x.clone(), device, args.reps)
            dst = torch.empty_like(x)
            t_copy = best_of(lambda: dst.copy_(x), device, args.reps)
            del dst
            extra = "-"
            if device.type == "cuda":
                torch.cuda.reset_peak_memory_stats()
                base = torch.cuda.memory_allocated()
                fingerprint(x, backend=args.backend)
                extra = f"{(torch.cuda.max_memory_allocated() - base) / 2**20:.1f}"
            nbytes = numel * x.element_size()
            print(f"{name:5s} {mib:5d} {nbytes / t_fp / 1e9:17.2f} {nbytes / t_clone / 1e9:11.2f} "
                  f"{nbytes / t_copy / 1e9:11.2f} {t_clone / t_fp:9.2f} {t_copy / t_fp:9.2f} {extra:>15s}")
            del x


if __name__ == "__main__":
    main()
