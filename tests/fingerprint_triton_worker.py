"""The fused kernel against the docs/design.md §3 reference, one printed line per case.

On CPU it runs under TRITON_INTERPRET=1 (set by tests/test_fingerprint_triton.py before Python
starts); on a GPU machine `SDCGUARD_TEST_DEVICE=cuda` runs the same cases compiled
(bench/gpu_check.sh)."""
import os
import sys

import torch

from sdcguard.fingerprint import triton_kernel as fingerprint_triton
from sdcguard.fingerprint import (
    fingerprint, fingerprint_many, fingerprint_reference, fingerprint_sums, to_fingerprints,
)

TILE = fingerprint_triton._TILE_BYTES
SPAN = fingerprint_triton._TILES * TILE  # bytes one program reads
DEVICE = torch.device(os.environ.get("SDCGUARD_TEST_DEVICE", "cpu"))


def reference(t: torch.Tensor):
    data = t.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()
    return fingerprint_reference(data, t.element_size())


def cases():
    gen = torch.Generator().manual_seed(11)
    # Byte lengths around tile and program boundaries, for every width.
    for nbytes in (8, TILE - 8, TILE, TILE + 8, SPAN - 8, SPAN, SPAN + 8, 2 * SPAN + 3 * TILE + 24):
        raw = torch.randint(0, 256, (nbytes,), dtype=torch.uint8, generator=gen)
        for dtype in (torch.int8, torch.float16, torch.float32, torch.float64):  # one per width
            if nbytes % torch.empty((), dtype=dtype).element_size() == 0:
                yield f"{dtype}-{nbytes}B", raw.view(dtype), {}
    raw = torch.randint(0, 256, (SPAN + 3 * TILE + 24,), dtype=torch.uint8, generator=gen)
    for dtype in (torch.uint8, torch.bool, torch.bfloat16, torch.int16, torch.int32, torch.int64,
                  torch.complex64, torch.float8_e4m3fn):
        yield f"{dtype}", (raw % 2 if dtype == torch.bool else raw).view(dtype), {}
    # Extreme values: int32 accumulators of narrow types at their bound, int64 wrap-around.
    yield "int16-min", torch.full((SPAN // 2 + 5,), -2 ** 15, dtype=torch.int16), {}
    yield "int16-max", torch.full((SPAN // 2 + 5,), 2 ** 15 - 1, dtype=torch.int16), {}
    yield "uint8-255", torch.full((SPAN + 5,), 255, dtype=torch.uint8), {}
    yield "int64-extremes", torch.tensor([2 ** 63 - 1, -2 ** 63, -1, 1] * 999, dtype=torch.int64), {}
    # Several chunks: offsets past the first chunk reach the kernel's `start` argument.
    yield "chunked", torch.randn(5 * 2048 + 17, generator=gen), {"chunk_elements": 2048}
    yield "chunked-bf16", torch.randn(3 * 4096 + 1, generator=gen).bfloat16(), {"chunk_elements": 4096}
    # Non-contiguous input, whole and slab by slab.
    yield "transposed", torch.randn(300, 70, generator=gen).t(), {}
    yield "strided-slabs", torch.randn(400, 90, generator=gen)[::3, 1::2], {"chunk_elements": 2048}
    yield "empty", torch.zeros(0), {}
    yield "scalar", torch.tensor(2.5), {}


def main() -> int:
    failures = 0
    for name, tensor, kwargs in cases():
        got = fingerprint(tensor.to(DEVICE), backend="triton", **kwargs)
        ok = got == reference(tensor) == fingerprint(tensor, backend="torch", **kwargs)
        failures += not ok
        print(f"{'ok' if ok else 'MISMATCH'} {name}", flush=True)
    tensors = [torch.randn(n) for n in (3, 5000, 70000)]
    ok = fingerprint_many([t.to(DEVICE) for t in tensors], backend="triton") == [reference(t) for t in tensors]
    failures += not ok
    print(f"{'ok' if ok else 'MISMATCH'} many", flush=True)
    # One batch, mixed widths, an empty tensor, several chunks each: one shared partials buffer.
    mixed = [torch.randn(3), torch.zeros(0), torch.randn(9000).bfloat16(),
             torch.randint(0, 255, (7777,), dtype=torch.uint8), torch.randn(5000, dtype=torch.float64)]
    sums = fingerprint_sums([t.to(DEVICE) for t in mixed], chunk_elements=2048, backend="triton")
    ok = to_fingerprints(sums) == [reference(t) for t in mixed]
    failures += not ok
    print(f"{'ok' if ok else 'MISMATCH'} batch", flush=True)
    ok = fingerprint_triton.ready(DEVICE)  # the self-test passes where the kernel runs
    failures += not ok
    print(f"{'ok' if ok else 'MISMATCH'} self-test", flush=True)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
