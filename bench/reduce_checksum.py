"""Check 4's detection threshold: the smallest corruption of one reduced-gradient element it catches.

    .venv/bin/python bench/reduce_checksum.py [--world 3] [--models tiny,10m]

Real gradients: each of W simulated ranks runs forward + backward of the model on its own batch
(TinyGPT from bench/gpt.py, and a ~10M-parameter variant), and the flattened gradient is one
bucket. The all-reduce is DDP's mean in the bucket's element type (scale by fl(1/W), W additions
in that type), then one element is scaled by a magnitude m, as the drill's ``reduce-scale`` does.
For elements of large, median and small magnitude, and for float32, bfloat16 and float16 buckets,
it prints the smallest m (searched on a log scale, x1.1 steps) that check 4 flags, the absolute
error that is, and that error relative to the reduced gradient's L2 norm. Also the bound's ratio
to the largest honest |X| seen over 20 random reduction orders (how much headroom the bound keeps).
"""
import argparse
import math
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from gpt import TinyGPT, lm_batch, lm_loss  # noqa: E402

from sdcguard.checks.reduce_checksum import ChecksumWeights, Shape, judge_checksum, rounding_bound  # noqa: E402
from sdcguard.checks.reduce_checksum import vote as rank_vote  # noqa: E402


def gradients(model, world):
    out = []
    for rank in range(world):
        model.zero_grad(set_to_none=True)
        lm_loss(model, lm_batch(0, rank)).backward()
        out.append(torch.cat([p.grad.reshape(-1) for p in model.parameters() if p.grad is not None]).clone())
    return out


def mean(grads, dtype, order):
    scaled = [(g.to(dtype) * (1.0 / len(grads))).to(dtype) for g in grads]
    total = scaled[order[0]].clone()
    for r in order[1:]:
        total = (total + scaled[r]).to(dtype)
    return total


def xy(local_terms, reduced, weights, world):
    red = weights.checksum(0, reduced)
    votes = [rank_vote([t], [red], [(reduced.numel(), reduced.dtype)], world) for t in local_terms]
    return sum(v[0].item() for v in votes), sum(v[1].item() for v in votes)


def cost(model, repeats=50):
    """The comm hook's work per step (the local bucket's checksum and squared norm, the reduced
    bucket's checksum) against what check 1 alone needs (the local squared norm), and against one
    forward + backward, on one thread."""
    import time

    from sdcguard.checks.norms import squared_norm

    torch.set_num_threads(1)
    flat = gradients(model, 1)[0]
    weights = ChecksumWeights(seed=0)

    def timed(fn):
        fn()
        started = time.perf_counter()
        for _ in range(repeats):
            fn()
        return (time.perf_counter() - started) / repeats

    terms = timed(lambda: (weights.terms(0, flat), weights.checksum(0, flat)))
    norms = timed(lambda: squared_norm(flat))
    step = timed(lambda: lm_loss(model, lm_batch(0, 0)).backward())
    return terms, norms, step


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--world", type=int, default=3)
    parser.add_argument("--models", default="tiny,10m")
    parser.add_argument("--cost-only", action="store_true")
    args = parser.parse_args()
    for name, make in (("tiny", lambda: TinyGPT()), ("10m", lambda: TinyGPT(dim=384, layers=5, heads=6))):
        if name in args.models.split(","):
            terms, norms, step = cost(make())
            print(f"cost {name}: comm hook {terms * 1e3:.3f} ms/step (check 1's squared norm alone {norms * 1e3:.3f}); "
                  f"forward+backward {step * 1e3:.1f} ms: check 4 +{(terms - norms) / step:.4f} of a step, "
                  f"{terms / step:.4f} in all")
    if args.cost_only:
        return 0
    torch.manual_seed(0)
    models = {"tiny": lambda: TinyGPT(), "10m": lambda: TinyGPT(dim=384, layers=5, heads=6)}
    print(f"{args.world} simulated ranks; DDP mean in the bucket type; one element scaled by m")
    print(f"{'model':6s} {'params':>9s} {'dtype':9s} {'element':8s} {'|G_i|':>10s} {'min m caught':>13s} "
          f"{'abs error':>10s} {'err/||G||':>10s} {'bound/max honest':>17s}")
    for name in args.models.split(","):
        model = models[name]()
        grads = gradients(model, args.world)
        n = grads[0].numel()
        for dtype in (torch.float32, torch.bfloat16, torch.float16):
            weights = ChecksumWeights(seed=0)
            weights.begin_step(1)
            local = [weights.terms(0, g.to(dtype)) for g in grads]
            shape = Shape(world=args.world, buckets=1, elements=n, dtypes=(dtype,))
            reduced = mean(grads, dtype, list(range(args.world)))
            honest = max(abs(xy(local, mean(grads, dtype, torch.randperm(args.world).tolist()), weights, args.world)[0])
                         for _ in range(20))
            _, y = xy(local, reduced, weights, args.world)
            headroom = rounding_bound(y, shape) / honest if honest else math.inf
            norm = float(reduced.double().norm())
            order = reduced.double().abs().argsort(descending=True)
            for label, index in (("largest", int(order[0])), ("median", int(order[n // 2])), ("small", int(order[int(n * 0.99)]))):
                base = float(reduced[index])
                caught = None
                m = 1.0001
                while m < 1e12:
                    bad = reduced.clone()
                    bad[index] = bad[index] * m
                    if torch.isfinite(bad).all() and judge_checksum(*xy(local, bad, weights, args.world), shape) is not None:
                        caught = m
                        break
                    m = 1 + (m - 1) * 1.5 if m < 2 else m * 1.1
                err = abs(base) * (caught - 1) if caught else float("nan")
                print(f"{name:6s} {n:9d} {str(dtype)[6:]:9s} {label:8s} {abs(base):10.2e} "
                      f"{(f'{caught:.4g}' if caught else 'none < 1e12'):>13s} {err:10.2e} {err / norm:10.2e} {headroom:17.0f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
