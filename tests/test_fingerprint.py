"""The fingerprint against the docs/design.md §3 definition: hand-computed vectors, every dtype, odd shapes."""
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from sdcguard.fingerprint import torch_path as fingerprint_torch
from sdcguard.fingerprint import (
    _COLUMNS, CPU_CHUNK_ELEMENTS, Fingerprint, digest, fingerprint, fingerprint_many, fingerprint_reference,
)

M = 1 << 64


def _bytes(t: torch.Tensor) -> bytes:
    return t.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()


def _reference(t: torch.Tensor) -> Fingerprint:
    return fingerprint_reference(_bytes(t), t.element_size())


# -- hand-computed vectors, one per width -------------------------------------------------------

def test_one_byte_is_unsigned():
    # int8 -1 is the byte 0xff = 255: s0 = 255 + 2 = 257, s1 = 255*1 + 2*2 = 259
    assert fingerprint(torch.tensor([-1, 2], dtype=torch.int8)) == (257, 259)
    assert fingerprint(torch.tensor([1, 2, 3], dtype=torch.uint8)) == (6, 14)
    assert fingerprint(torch.tensor([True, False, True])) == (2, 4)


def test_two_bytes_are_signed():
    # float16 1.0 = 0x3c00 = 15360, -2.0 = 0xc000 = -16384 as int16
    assert fingerprint(torch.tensor([1.0, -2.0], dtype=torch.float16)) == ((15360 - 16384) % M, (15360 - 2 * 16384) % M)
    assert fingerprint(torch.tensor([-1, 2], dtype=torch.int16)) == (1, 3)


def test_four_bytes():
    # float32 1.0 = 0x3f800000, -0.0 = 0x80000000 = -2**31 as int32
    one, neg_zero = 0x3F800000, -(2 ** 31)
    assert fingerprint(torch.tensor([1.0, -0.0])) == ((one + neg_zero) % M, (one + 2 * neg_zero) % M)


def test_eight_bytes_wrap_modulo_2_64():
    big = 2 ** 63 - 1
    assert fingerprint(torch.tensor([big, 1], dtype=torch.int64)) == (2 ** 63, (big + 2) % M)
    assert fingerprint(torch.tensor([-1], dtype=torch.int64)) == (M - 1, M - 1)


def test_swap_changes_s1_but_not_s0():
    t = torch.tensor([1.5, -2.25, 3.0, 7.0])
    swapped = t[[1, 0, 2, 3]]
    a, b = fingerprint(t), fingerprint(swapped)
    assert a.s0 == b.s0 and a.s1 != b.s1


def test_any_changed_bit_changes_s0():
    t = torch.randn(1000)
    flipped = t.clone()
    flipped.view(torch.int32)[517] ^= 1 << 3
    assert fingerprint(t).s0 != fingerprint(flipped).s0


# -- every dtype of 1, 2, 4 and 8 bytes ------------------------------------------------------------

def _all_dtypes() -> list[torch.dtype]:
    found = {getattr(torch, n) for n in dir(torch) if isinstance(getattr(torch, n), torch.dtype)}
    usable = []
    for dt in sorted(found, key=str):
        try:
            probe = torch.zeros(8, dtype=torch.uint8).view(dt)
        except (RuntimeError, TypeError):
            continue
        if probe.element_size() in (1, 2, 4, 8):
            usable.append(dt)
    return usable


ALL_DTYPES = _all_dtypes()


def test_dtype_list_covers_the_usual_suspects():
    for dt in (torch.float32, torch.bfloat16, torch.float16, torch.float64, torch.int8, torch.uint8,
               torch.int16, torch.int32, torch.int64, torch.bool, torch.complex64, torch.float8_e4m3fn):
        assert dt in ALL_DTYPES


@pytest.mark.parametrize("dtype", ALL_DTYPES, ids=str)
def test_every_dtype_matches_the_reference(dtype):
    gen = torch.Generator().manual_seed(7)
    raw = torch.randint(0, 256, (8 * 1237,), dtype=torch.uint8, generator=gen)
    if dtype == torch.bool:
        raw = raw % 2  # only 0/1 are valid bools
    t = raw.view(dtype)
    assert fingerprint(t) == _reference(t)


def test_unsupported_width_is_a_clear_error():
    with pytest.raises(TypeError, match="1, 2, 4 and 8-byte"):
        fingerprint(torch.zeros(3, dtype=torch.complex128))


# -- chunking and layout --------------------------------------------------------------------------

@pytest.mark.parametrize("n", [0, 1, _COLUMNS - 1, _COLUMNS, _COLUMNS + 1, 2 * _COLUMNS, 3 * _COLUMNS + 5,
                               4 * _COLUMNS - 1, 4 * _COLUMNS, 4 * _COLUMNS + 1, 9 * _COLUMNS + 13,
                               32 * _COLUMNS, 33 * _COLUMNS + 5])  # 32 rows: one CPU GEMM block
def test_chunk_boundaries(n):
    t = torch.randn(n)
    expected = _reference(t)
    assert fingerprint(t) == expected
    assert fingerprint(t, chunk_elements=_COLUMNS) == expected
    assert fingerprint(t, chunk_elements=2 * _COLUMNS) == expected


@pytest.mark.parametrize("make", [
    lambda: torch.randn(300, 70).t(),                      # transposed
    lambda: torch.randn(50, 90)[::3, 1::2],                 # strided slices
    lambda: torch.randn(1, 70).expand(200, 70),            # stride 0
    lambda: torch.randn(4, 5, 600).permute(2, 0, 1),       # permuted 3-D
    lambda: torch.randn(3000, 3)[:, 1],                    # a column
    lambda: torch.tensor(2.5),                             # zero-dim
    lambda: torch.randn(40, 60, dtype=torch.bfloat16).t(),
], ids=["transposed", "strided", "expanded", "permuted", "column", "scalar", "bf16-transposed"])
def test_non_contiguous_input(make):
    t = make()
    expected = _reference(t)
    assert fingerprint(t) == expected
    assert fingerprint(t, chunk_elements=_COLUMNS) == expected  # slab-by-slab path


@pytest.mark.parametrize("dtype,value", [
    (torch.int32, -2 ** 31), (torch.int32, 2 ** 31 - 1), (torch.int16, -2 ** 15), (torch.int16, 2 ** 15 - 1),
    (torch.uint8, 255), (torch.int64, -2 ** 63),
], ids=str)
def test_extreme_values_stay_exact(dtype, value):
    # The CPU BLAS paths are exact only while every partial sum stays within the float mantissa
    # (2**53 for float64 blocks, 2**24 for the float32 blocks of narrow types): the largest
    # magnitudes over several chunks and blocks (and a ragged tail) must match the closed form,
    # and so must small tensors that go through the packed path.
    def closed_form(n):
        return (value * n % M, value * (n * (n + 1) // 2) % M)

    n = 2 * CPU_CHUNK_ELEMENTS + 3 * _COLUMNS + 7
    assert fingerprint(torch.full((n,), value, dtype=dtype)) == closed_form(n)
    sizes = [1, _COLUMNS - 1, 32 * _COLUMNS]
    assert fingerprint_many([torch.full((k,), value, dtype=dtype) for k in sizes]) == [closed_form(k) for k in sizes]


def test_chunk_size_is_validated():
    with pytest.raises(ValueError, match="multiple of 2048"):
        fingerprint(torch.zeros(4), chunk_elements=1000)


def test_equal_results_for_equal_logical_content():
    t = torch.randn(123, 77)
    assert fingerprint(t.t().contiguous().t()) == fingerprint(t)


def test_digest_depends_on_order_and_content():
    a, b = Fingerprint(1, 2), Fingerprint(3, 4)
    assert digest([a, b]) != digest([b, a])
    assert digest([a, b]) == digest([Fingerprint(1, 2), Fingerprint(3, 4)])
    assert len(digest([a])) == 16


# -- the individual torch paths, each against the definition ---------------------------------------
# (On CPU the dispatcher uses the GEMM and packed paths; the integer path serves GPUs without
# Triton and 8-byte elements. Each is checked here directly, on CPU.)

def _int_view(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().reshape(-1).view({1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()])


PATHS = [(fingerprint_torch.chunk_sums, dt) for dt in (torch.uint8, torch.float16, torch.float32, torch.int64)]
PATHS += [(fingerprint_torch.chunk_sums_by_matmul, dt) for dt in (torch.uint8, torch.bfloat16, torch.float32)]


@pytest.mark.parametrize("path,dtype", PATHS, ids=lambda x: getattr(x, "__name__", str(x)))
@pytest.mark.parametrize("n", [5, _COLUMNS, 40 * _COLUMNS + 3])
def test_each_torch_path_matches_the_reference(path, dtype, n):
    t = torch.randint(0, 256, (n * torch.empty((), dtype=dtype).element_size(),), dtype=torch.uint8).view(dtype)
    s0, s1 = path(_int_view(t))
    assert (int(s0) % M, int(s1) % M) == _reference(t)


@pytest.mark.parametrize("dtype", [torch.uint8, torch.int16, torch.int32], ids=str)
def test_gemm_path_agrees_with_the_integer_path_over_many_blocks(dtype):
    # Several float32 (512 x 512) and float64 (32 x 2048) blocks, random full-range bytes.
    raw = torch.randint(0, 256, ((3 * 512 * 512 + 7) * torch.empty((), dtype=dtype).element_size(),), dtype=torch.uint8)
    piece = raw.view(dtype)
    assert [int(x) for x in fingerprint_torch.chunk_sums_by_matmul(piece)] == \
        [int(x) for x in fingerprint_torch.chunk_sums(piece)]


def test_many_tensors_pack_and_match_one_by_one():
    gen = torch.Generator().manual_seed(3)
    tensors = [torch.randn(n, generator=gen) for n in (1, 128, _COLUMNS, _COLUMNS + 1, 7 * _COLUMNS - 3)] * 40  # > 1 pack
    tensors += [
        torch.randn(32 * _COLUMNS, generator=gen),                       # largest packed
        torch.randn(32 * _COLUMNS + 1, generator=gen),                   # one by one
        torch.randn(64, 33, generator=gen).t(),                          # non-contiguous, packed
        torch.randint(-9, 9, (300,), dtype=torch.int64, generator=gen),  # 8 bytes: one by one
        torch.zeros(0), torch.tensor(1.5), torch.randn(50, generator=gen).bfloat16(),
        torch.randint(0, 255, (999,), dtype=torch.uint8, generator=gen),
    ]
    many = fingerprint_many(tensors)
    assert many == [fingerprint(t, chunk_elements=_COLUMNS) for t in tensors]
    assert many == [_reference(t) for t in tensors]


def test_integer_path_switches_to_int64_where_int32_could_overflow():
    # Past 2**24 narrow elements a column sum could exceed int32: the path must widen.
    n = fingerprint_torch.INT32_SAFE_ELEMENTS + _COLUMNS + 5
    t = torch.full((n,), -2 ** 15, dtype=torch.int16)
    s0, s1 = fingerprint_torch.chunk_sums(t)
    assert (int(s0) % M, int(s1) % M) == (-2 ** 15 * n % M, -2 ** 15 * (n * (n + 1) // 2) % M)


def test_fingerprint_bench_checks_and_runs():
    # The bench verifies every size bit for bit against the CPU torch path before timing it.
    bench = Path(__file__).resolve().parents[1] / "bench" / "fingerprint.py"
    run = subprocess.run([sys.executable, str(bench), "--sizes", "1", "--reps", "1"], capture_output=True,
                         text=True, timeout=120, env=dict(os.environ, PYTHONSAFEPATH="1"))
    assert run.returncode == 0, run.stdout + run.stderr
    assert "MISMATCH" not in run.stdout and run.stdout.count("\n") >= 6


def test_gpu_check_script_parses():
    script = Path(__file__).resolve().parents[1] / "bench" / "gpu_check.sh"
    assert subprocess.run(["bash", "-n", str(script)]).returncode == 0


def test_several_sums_reach_the_host_in_one_read_split_as_given(monkeypatch):
    from sdcguard.fingerprint import fingerprint_sums, to_fingerprints_together
    tensors = [torch.arange(5.0), torch.ones(3), torch.tensor(-2.5)]
    parts = [fingerprint_sums(tensors[:2]), torch.zeros((0, 2), dtype=torch.int64), fingerprint_sums(tensors[2:])]
    reads = []
    tolist = torch.Tensor.tolist
    monkeypatch.setattr(torch.Tensor, "tolist", lambda self, *a: reads.append(self.shape) or tolist(self, *a))
    found = to_fingerprints_together(parts)
    monkeypatch.undo()
    assert found == [[fingerprint(tensors[0]), fingerprint(tensors[1])], [], [fingerprint(tensors[2])]]
    assert reads == [(3, 2)]
    assert to_fingerprints_together([torch.zeros((0, 2), dtype=torch.int64)]) == [[]]
