"""The fused Triton fold of check 4's local terms against its torch formula, one printed line per case.

On CPU it runs under TRITON_INTERPRET=1 (set by tests/test_reduce_checksum.py before Python
starts); on a GPU machine ``SDCGUARD_TEST_DEVICE=cuda`` runs the same cases compiled
(bench/gpu_check.sh). Bit for bit: the fold P, the squares' fold Q, the bucket scaled in place,
and the ``[c, squared norm]`` that ``ChecksumWeights.terms`` returns through the kernel."""
import os
import sys

import torch

from sdcguard.checks.reduce_checksum import ChecksumWeights, fused_fold
from sdcguard.fingerprint import triton_checksum

DEVICE = torch.device(os.environ.get("SDCGUARD_TEST_DEVICE", "cpu"))
BLOCK = triton_checksum._BLOCK


def same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bit for bit, except that two NaNs match whatever their payloads (devices differ there)."""
    wide = torch.int16 if a.element_size() == 2 else torch.int32
    equal = a.contiguous().view(wide) == b.contiguous().view(wide)
    return bool((equal | (torch.isnan(a) & torch.isnan(b))).all())


def cases():
    yield from triton_checksum.self_test_cases(DEVICE)
    gen = torch.Generator().manual_seed(5)
    # Extremes: zeros, signed zeros, subnormals, values whose squares overflow float32, a NaN, an Inf.
    for dtype in triton_checksum.DTYPES:
        info = torch.finfo(dtype)
        special = torch.tensor([0.0, -0.0, info.tiny / 4, -info.tiny, info.max, -info.max, 1e-30, 3.0],
                               dtype=torch.float64).repeat(2 * BLOCK + 2)
        yield f"{dtype}-extremes", special.to(dtype).to(DEVICE), 1 / 3
        bad = torch.randn(16 * 40, generator=gen).to(dtype)
        bad[17], bad[300] = float("nan"), float("inf")
        yield f"{dtype}-nonfinite", bad.to(DEVICE), 0.5


def main() -> int:
    failures = 0
    for name, tensor, scale in cases():
        fast, slow = tensor.clone().view(16, -1), tensor.clone().view(16, -1)
        p1, q1 = triton_checksum.fold(fast, scale)
        p2, q2 = fused_fold(slow, scale)
        ok = all(same(a, b) for a, b in ((p1, p2), (q1, q2), (fast, slow)))
        failures += not ok
        print(f"{'ok' if ok else 'MISMATCH'} fold {name}", flush=True)
    # Through ChecksumWeights.terms (the comm hook's call), ragged tails included.
    weights = ChecksumWeights(seed=3)
    gen = torch.Generator().manual_seed(9)
    for n in (16, 16 * BLOCK + 5, 16 * 3 * BLOCK + 15, 70_001):
        for dtype in triton_checksum.DTYPES:
            weights.begin_step(n)
            g = torch.randn(n, generator=gen).to(dtype).to(DEVICE)
            a, b = g.clone(), g.clone()
            ok = torch.equal(weights.terms(0, a, scale=1 / 3), weights.fused_terms(0, b, scale=1 / 3))
            ok = ok and same(a, b) and same(a, g.clone().mul_(1 / 3))
            failures += not ok
            print(f"{'ok' if ok else 'MISMATCH'} terms {dtype}-{n}", flush=True)
    ok = triton_checksum.ready(DEVICE)  # the self-test passes where the kernel runs
    failures += not ok
    print(f"{'ok' if ok else 'MISMATCH'} self-test", flush=True)
    if DEVICE.type == "cuda":
        timing()
    return 1 if failures else 0


def timing() -> None:
    """The comm hook's local pass on a 25 MB bucket: the fused kernel (terms and 1/W scaling in
    one read) against the torch path (fold, norm, ``mul_``: three reads), and one ``copy_``."""
    from sdcguard.checks.norms import squared_norm
    weights = ChecksumWeights(seed=1)
    weights.begin_step(1)
    for dtype in (torch.float32, torch.bfloat16):
        flat = torch.randn((25 << 20) // torch.empty((), dtype=dtype).element_size(), device=DEVICE).to(dtype)
        other = torch.empty_like(flat)

        def torch_path():
            torch.stack([weights.checksum(0, flat), squared_norm(flat)])
            flat.mul_(1.0)
        paths = {"fused kernel": lambda: weights.terms(0, flat, scale=1.0), "torch path": torch_path,
                 "copy_ (read + write)": lambda: other.copy_(flat)}
        line = []
        for name, fn in paths.items():
            for _ in range(3):
                fn()
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(20):
                fn()
            end.record()
            end.synchronize()
            line.append(f"{name} {start.elapsed_time(end) / 20 * 1e3:.0f} us")
        print(f"time {dtype} 25 MB bucket: " + ", ".join(line), flush=True)


if __name__ == "__main__":
    sys.exit(main())
