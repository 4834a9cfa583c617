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
