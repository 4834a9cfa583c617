"""Check 4's rounding bound, in-process: honest reductions of adversarial-but-honest gradients never
exceed it, corruptions above the documented threshold do (sdcguard.checks.reduce_checksum).

The all-reduce is simulated as DDP's mean does it — each rank's bucket scaled by fl(1/W) in the
element type, then the W terms added in the element type in a random order per trial — so every
rounding the bound must cover happens. tests/guard_worker.py repeats this over real gloo."""
import math

import pytest
import torch

from sdcguard.checks.reduce_checksum import DEPTH_FIRST_COLUMNS, ChecksumWeights, Shape, coefficient, judge_checksum
from sdcguard.checks.reduce_checksum import rounding_bound
from sdcguard.checks.reduce_checksum import vote as rank_vote


def honest_mean(grads, dtype, order):
    scale = 1.0 / len(grads)
    scaled = [(g.to(dtype) * scale).to(dtype) for g in grads]
    total = scaled[order[0]].clone()
    for r in order[1:]:
        total = (total + scaled[r]).to(dtype)
    return total


def vote(grads, reduced, weights):
    world = len(grads)
    n = reduced.numel()
    red = weights.checksum(0, reduced)
    votes = [rank_vote([weights.terms(0, g)], [red], [(n, reduced.dtype)], world) for g in grads]
    x = sum(v[0].item() for v in votes)  # what check 1's all-reduce sums
    y = sum(v[1].item() for v in votes)
    return x, y, Shape(world=world, buckets=1, elements=n, dtypes=(reduced.dtype,))


def adversarial(kind, world, n, dtype, gen):
    if kind == "dynamic-range":  # 1e-30 .. 1e30 in one bucket (float32); the type's range otherwise
        top = {torch.float32: 30, torch.bfloat16: 30, torch.float16: 4}[dtype]
        exps = torch.randint(-top, top, (world, n), generator=gen).to(torch.float64)
        return [(torch.randn(n, generator=gen, dtype=torch.float64) * 10.0 ** exps[r]).to(dtype) for r in range(world)]
    if kind == "cancellation":  # ranks' gradients cancel almost exactly
        base = torch.randn(n, generator=gen, dtype=torch.float64) * 1e3
        grads = [base * (1 if r % 2 == 0 else -1) for r in range(world)]
        grads[0] = grads[0] + torch.randn(n, generator=gen, dtype=torch.float64) * 1e-3
        return [g.to(dtype) for g in grads]
    if kind == "zeros":
        return [torch.zeros(n, dtype=dtype) for _ in range(world)]
    if kind == "overflow-edge":  # finite values whose mean sits near the type's largest
        big = torch.finfo(dtype).max / 2
        return [torch.full((n,), big, dtype=torch.float64).to(dtype) for _ in range(world)]
    if kind == "subnormal":
        tiny = torch.finfo(dtype).tiny
        return [(torch.rand(n, generator=gen, dtype=torch.float64) * tiny * 4).to(dtype) for _ in range(world)]
    raise ValueError(kind)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("world", [2, 3, 8, 64])
@pytest.mark.parametrize("kind", ["dynamic-range", "cancellation", "zeros", "overflow-edge", "subnormal"])
def test_honest_reductions_stay_within_the_bound(dtype, world, kind):
    gen = torch.Generator().manual_seed(world * 31 + len(kind))
    weights = ChecksumWeights(seed=7)
    worst = 0.0
    for trial in range(6):
        n = [1, 15, 16, 1000, 4099, 20000][trial]
        grads = adversarial(kind, world, n, dtype, gen)
        weights.begin_step(trial)
        reduced = honest_mean(grads, dtype, torch.randperm(world, generator=gen).tolist())
        if not torch.isfinite(reduced).all():
            continue  # check 1's case, not check 4's
        x, y, shape = vote(grads, reduced, weights)
        assert judge_checksum(x, y, shape) is None, (n, x, y, rounding_bound(y, shape))
        if y:
            worst = max(worst, abs(x) / rounding_bound(y, shape))
    assert worst <= 1.0


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_a_scaled_element_above_the_threshold_is_caught(dtype):
    gen = torch.Generator().manual_seed(1)
    world, n = 3, 50_000
    weights = ChecksumWeights(seed=3)
    weights.begin_step(5)
    grads = [torch.randn(n, generator=gen).to(dtype) * 1e-3 for _ in range(world)]
    reduced = honest_mean(grads, dtype, [0, 1, 2])
    x, y, shape = vote(grads, reduced, weights)
    bound = rounding_bound(y, shape)
    bad = reduced.clone()
    # an error a few bounds large in one element, anywhere, is caught (weights are >= 1)
    bad[12345] = bad[12345] + 4 * bound
    x_bad, y_bad, _ = vote(grads, bad, weights)
    assert y_bad == y  # the bound comes from the local operands alone: a corruption cannot widen it
    verdict = judge_checksum(x_bad, y_bad, shape)
    assert verdict is not None and verdict.check == "reduce-checksum" and verdict.suspects == []
    assert verdict.evidence["exceeds_bound_by"] > 1


def test_two_swapped_elements_change_the_checksum():
    world, n = 2, 4096
    weights = ChecksumWeights(seed=0)
    weights.begin_step(0)
    grads = [torch.arange(n, dtype=torch.float32) for _ in range(world)]
    reduced = honest_mean(grads, torch.float32, [0, 1])
    swapped = reduced.clone()
    swapped[[10, 3000]] = swapped[[3000, 10]]
    x, y, shape = vote(grads, swapped, weights)
    assert judge_checksum(x, y, shape) is not None


def test_weights_move_with_the_step_and_agree_across_ranks():
    a, b = ChecksumWeights(seed=1), ChecksumWeights(seed=1)
    g = torch.randn(1000)
    a.begin_step(3), b.begin_step(3)
    assert torch.equal(a.terms(0, g), b.terms(0, g))
    b.begin_step(4)
    assert not torch.equal(a.terms(0, g), b.terms(0, g))


def test_the_bound_grows_with_the_world_and_the_element_type():
    k = lambda w, d: coefficient(10_000, d, w, 1)
    assert k(64, torch.float32) > k(2, torch.float32)
    assert k(2, torch.bfloat16) > k(2, torch.float16) > k(2, torch.float32)
    assert k(8, torch.float32) < 1e-4


def test_the_checksum_is_one_weighted_sum_of_the_bucket():
    """The fold, the rotation by the step's offset and the tail equal the plain float64 sum
    ``sum_i w_i g_i`` with column j's weight ``w[(j + o) mod L]``, within the fold's rounding."""
    weights = ChecksumWeights(seed=2)
    for n, dtype in [(5, torch.float64), (16, torch.float64), (1000, torch.float64), (4099, torch.float64),
                     (4099, torch.float32), (4099, torch.bfloat16),
                     (16 * (DEPTH_FIRST_COLUMNS + 1) + 3, torch.float32),  # added depth first
                     (16 * (DEPTH_FIRST_COLUMNS + 1), torch.bfloat16)]:
        weights.begin_step(n)
        g = torch.randn(n, generator=torch.Generator().manual_seed(n), dtype=torch.float64).to(dtype)
        table = weights.table(0, n, g.device)
        cols = n // 16
        per_element = torch.empty(n, dtype=torch.float64)
        if cols:
            o = weights.offset_seed % cols
            per_element[:cols * 16] = torch.cat([table[o:cols], table[:o]]).repeat(16)
        per_element[cols * 16:] = table[cols:]
        exact = float(torch.dot(per_element, g.double()))
        # pairwise: each element rounded at most 4 times in float32 (exactly 0 in float64, up to 1e-12)
        rounding = 4.01 * 2.0 ** -24 * float(torch.dot(per_element, g.double().abs())) if dtype != torch.float64 else 1e-12
        assert float(weights.checksum(0, g)) == pytest.approx(exact, abs=rounding)


# -- the fused formula (the Triton kernel's: one read for the fold, the norm and DDP's scaling) --

def test_terms_with_a_scale_are_the_terms_then_the_bucket_scaled():
    """The comm hook's one call: on the torch path the same bits as the terms, then ``mul_``."""
    weights = ChecksumWeights(seed=4)
    weights.begin_step(2)
    for dtype in (torch.float32, torch.bfloat16, torch.float64):
        g = torch.randn(4099, generator=torch.Generator().manual_seed(2)).to(dtype)
        scaled = g.clone()
        assert torch.equal(weights.terms(0, scaled, scale=1 / 3), weights.terms(0, g))
        assert torch.equal(scaled, g.clone().mul_(1 / 3))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
def test_the_fused_formula_stays_within_the_roundings_check_4_assumes(dtype):
    """``fused_terms`` (what the kernel computes bit for bit): its checksum within the fold's
    rounding of the exact weighted sum, its squared norm within ``norm_roundoff`` below the exact
    one (the bound's rigour rests on that), and its scaling that of ``mul_``."""
    from sdcguard.checks.norms import norm_roundoff
    weights = ChecksumWeights(seed=6)
    for n in (5, 16, 17, 1000, 4099, 16 * 70_001 + 9):
        weights.begin_step(n)
        gen = torch.Generator().manual_seed(n)
        g = (torch.randn(n, generator=gen, dtype=torch.float64) * 10.0 ** torch.randint(-3, 4, (n,), generator=gen))
        g = g.to(dtype)
        exact_c = float(weights.checksum(0, g.double()))  # float64 throughout: exact to ~1e-16
        abs_c = float(weights.checksum(0, g.double().abs()))
        exact_sq = float(torch.dot(g.double(), g.double()))
        scaled = g.clone()
        c, sq = weights.fused_terms(0, scaled, scale=0.25).tolist()
        assert abs(c - exact_c) <= 4.01 * 2.0 ** -24 * abs_c
        assert (1 - norm_roundoff(n, dtype)) * exact_sq <= sq <= (1 + 6 * 2.0 ** -24) * exact_sq
        assert torch.equal(scaled, g.clone().mul_(0.25))


# -- the CPU path: the bucket read once, a cache-sized block at a time (blocked_fold) --

def _bucket_bytes_read(flat, fn):
    """Bytes that the tensor operations of ``fn()`` read from ``flat``'s memory (views read nothing;
    an ``out=`` argument is written, not read)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    ptr = flat.untyped_storage().data_ptr()
    read = [0]

    class Reads(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if not getattr(func, "is_view", False):
                seen = set()
                for i, a in enumerate(args):
                    for t in (a if isinstance(a, (list, tuple)) else [a]):
                        if not isinstance(t, torch.Tensor) or t.untyped_storage().data_ptr() != ptr:
                            continue
                        if func._opname == "copy_" and i == 0:
                            continue  # its destination
                        key = (t.data_ptr(), t.shape, t.stride())
                        if key not in seen:
                            seen.add(key)
                            read[0] += t.numel() * t.element_size()
            return func(*args, **(kwargs or {}))

    with Reads():
        out = fn()
    return read[0], out


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
def test_cpu_terms_read_the_bucket_once_with_the_fused_formulas_bits(dtype, monkeypatch):
    """``terms`` on CPU: the bucket's memory read once for the fold, the norm and the scaling
    (the tail of ``n mod 16`` elements twice), whatever the number of blocks; the checksum the
    fused formula's bit for bit (and the plain fold's where that adds halves too), the squared norm
    within ``norm_roundoff`` below the exact one, the scaled bucket ``mul_``'s bit for bit —
    NaN, Inf, signed zeros and subnormals included."""
    from sdcguard.checks import reduce_checksum
    from sdcguard.checks.norms import norm_roundoff
    weights = ChecksumWeights(seed=9)
    monkeypatch.setattr(reduce_checksum, "BLOCKED_FROM_BYTES", 0)  # every bucket blocked, however small
    for block_bytes in (reduce_checksum.BLOCK_BYTES, 64 * 37):  # real blocks, then many ragged ones
        monkeypatch.setattr(reduce_checksum, "BLOCK_BYTES", block_bytes)
        for n in (16, 23, 4099, 16 * 1000 + 5, 16 * 20_000 + 15):
            weights.begin_step(n)
            gen = torch.Generator().manual_seed(n)
            g = (torch.randn(n, generator=gen, dtype=torch.float64) * 10.0 ** torch.randint(-6, 4, (n,), generator=gen))
            g = g.to(dtype)
            g[n // 3] = -0.0
            g[n // 2] = torch.finfo(dtype).tiny / 4  # subnormal
            scaled = g.clone()
            read, (c, sq) = _bucket_bytes_read(scaled, lambda: weights.terms(0, scaled, scale=1 / 3).tolist())
            assert read <= (n + 2 * (n % 16)) * g.element_size(), (n, block_bytes, read)
            assert torch.equal(scaled.view(torch.int16), g.clone().mul_(1 / 3).view(torch.int16)) if dtype != torch.float32 \
                else torch.equal(scaled.view(torch.int32), g.clone().mul_(1 / 3).view(torch.int32))
            fused_c, fused_sq = weights.fused_terms(0, g.clone()).tolist()
            assert c == fused_c
            if n // 16 <= DEPTH_FIRST_COLUMNS:
                assert c == float(weights.checksum(0, g))
            exact_sq = float(torch.dot(g.double(), g.double()))
            assert (1 - norm_roundoff(n, dtype)) * exact_sq <= sq <= (1 + 2 * norm_roundoff(n, dtype)) * exact_sq
        for bad, finite in ((float("nan"), math.isnan), (float("inf"), math.isinf)):
            g = torch.randn(16 * 3000 + 3).to(dtype)
            g[7777] = bad
            c, sq = weights.terms(0, g.clone(), scale=0.5).tolist()
            assert finite(sq) and not math.isfinite(c)


def test_cpu_terms_block_only_buckets_larger_than_a_block():
    """A bucket in cache (at most one block) takes the three passes; a larger one is read once."""
    from sdcguard.checks import reduce_checksum
    weights = ChecksumWeights(seed=3)
    small = torch.randn(reduce_checksum.BLOCKED_FROM_BYTES // 4)
    large = torch.randn(reduce_checksum.BLOCKED_FROM_BYTES // 4 + 16 * 7)
    for g, passes in ((small, 3), (large, 1)):
        weights.begin_step(g.numel())
        read, _ = _bucket_bytes_read(g, lambda g=g: weights.terms(0, g, scale=0.5).tolist())
        assert read == passes * g.numel() * 4, (g.numel(), read)


def test_cpu_terms_keep_a_scratch_per_thread():
    """Buckets finish on gloo's thread as well as the main one: each has its own scratch, and
    concurrent calls give the bits a lone call gives."""
    import threading
    weights = ChecksumWeights(seed=3)
    weights.begin_step(1)
    grads = [torch.randn(16 * 40_000 + i, generator=torch.Generator().manual_seed(i)) for i in range(4)]
    alone = [weights.terms(i, g.clone(), scale=0.5) for i, g in enumerate(grads)]
    results = {}

    def run(i):
        for _ in range(5):
            results[i] = weights.terms(i, grads[i].clone(), scale=0.5)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert all(torch.equal(results[i], alone[i]) for i in range(4))


@pytest.mark.parametrize("kind", ["dynamic-range", "cancellation", "zeros", "subnormal"])
def test_honest_reductions_stay_within_the_bound_in_many_blocks(kind, monkeypatch):
    """The honest reductions above with the local terms folded in many small blocks."""
    from sdcguard.checks import reduce_checksum
    monkeypatch.setattr(reduce_checksum, "BLOCK_BYTES", 64 * 11)
    monkeypatch.setattr(reduce_checksum, "BLOCKED_FROM_BYTES", 0)
    for dtype in (torch.float32, torch.bfloat16):
        gen = torch.Generator().manual_seed(len(kind) + 1)
        weights = ChecksumWeights(seed=10)
        for trial, n in enumerate([1000, 20000 + 7]):
            grads = adversarial(kind, 3, n, dtype, gen)
            weights.begin_step(trial)
            x, y, shape = vote(grads, honest_mean(grads, dtype, torch.randperm(3, generator=gen).tolist()), weights)
            assert judge_checksum(x, y, shape) is None, (kind, n, x, y)


@pytest.mark.parametrize("kind", ["dynamic-range", "cancellation", "zeros", "subnormal"])
def test_honest_reductions_stay_within_the_bound_with_the_fused_terms(kind):
    """The same honest reductions as above, each rank's local terms from the fused formula."""
    for dtype in (torch.float32, torch.bfloat16):
        gen = torch.Generator().manual_seed(len(kind))
        weights = ChecksumWeights(seed=8)
        world = 3
        for trial, n in enumerate([16, 1000, 20000]):
            grads = adversarial(kind, world, n, dtype, gen)
            weights.begin_step(trial)
            reduced = honest_mean(grads, dtype, torch.randperm(world, generator=gen).tolist())
            red = weights.checksum(0, reduced)
            votes = [rank_vote([weights.fused_terms(0, g.clone())], [red], [(n, dtype)], world) for g in grads]
            x, y = sum(float(v[0]) for v in votes), sum(float(v[1]) for v in votes)
            shape = Shape(world=world, buckets=1, elements=n, dtypes=(dtype,))
            assert judge_checksum(x, y, shape) is None, (kind, dtype, n, x, y)
            bad = reduced.clone()
            bad[n // 2] += 4 * rounding_bound(y, shape) + abs(float(bad[n // 2])) * 0.01
            x_bad = x + (float(red) - float(weights.checksum(0, bad))) / 1  # the reduced checksum moves
            if math.isfinite(x_bad) and float(bad[n // 2]) != float(reduced[n // 2]):
                assert judge_checksum(x_bad, y, shape) is not None


@pytest.mark.slow
def test_the_fused_kernel_is_its_torch_formula_bit_for_bit_in_the_interpreter():
    """The Triton kernel (agent/fingerprint/triton_checksum_kernel.py) in Triton's CPU interpreter
    against ``fused_fold`` / ``fused_terms``: fold, squares' fold, the scaled bucket and the terms
    through ``ChecksumWeights.terms``, every dtype, ragged sizes, extremes; the self-test passes.
    A GPU runs the same cases compiled (bench/gpu_check.sh)."""
    import os
    import subprocess
    import sys
    from pathlib import Path
    pytest.importorskip("triton")
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONSAFEPATH="1")
    run = subprocess.run([sys.executable, str(Path(__file__).with_name("checksum_triton_worker.py"))], env=env,
                         capture_output=True, text=True, timeout=600)
    lines = run.stdout.splitlines()
    assert run.returncode == 0, run.stdout + run.stderr
    assert len(lines) > 30 and all(line.startswith("ok ") for line in lines), run.stdout


def test_the_fused_path_is_never_taken_where_the_kernel_cannot_run():
    from sdcguard.fingerprint import triton_checksum
    assert not triton_checksum.available(torch.zeros(64))  # CPU without the interpreter
    assert not triton_checksum.available(torch.zeros(64, dtype=torch.float64))
