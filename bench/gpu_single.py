"""What one GPU can show of sdcguard's per-step path (NCCL needs a GPU per rank; this is one rank).

    python bench/gpu_single.py [--device cuda] [--steps 30]

Three parts, each printed as a table and checked where it can be:
  1. **Check 4 on the device**: the comm hook's work per bucket (the local bucket's checksum and
     squared norm, the reduced bucket's checksum) for 25 MB and 100 MB float32 buckets and a 25 MB
     bfloat16 one, timed against one ``copy_`` of the bucket (the device's read + write bandwidth);
     and the bound on the device: an honest mean of 8 simulated ranks (scale by fl(1/W), W adds in
     the element type) never exceeds it over 20 orders, a scaled element above the threshold does.
  2. **Check 2's premise on the device**: with ``torch.use_deterministic_algorithms(True)`` (and
     ``CUBLAS_WORKSPACE_CONFIG`` set) the replay of a micro-batch (``sdcguard.checks.replay``, the
     bare module, ``autograd.grad``) gives the fingerprints of the original ``loss.backward()`` bit
     for bit, TinyGPT with dropout, in float32 and under bfloat16 autocast.
  3. **The per-step account of one rank**: a TinyGPT step's time (forward + backward + AdamW) and
     what the comm hook's recording and check 3's weight fingerprint add to it, as fractions.
Exit status 1 if a check fails (a false alarm, a missed corruption, a replay that differs).
On CPU it runs too (``--device cpu``), which is how it is kept working without a GPU.
"""
import argparse
import os
import sys
from pathlib import Path

os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")  # before CUDA initialises

import torch  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from fingerprint import best_of  # noqa: E402  (bench/fingerprint.py)
from gpt import TinyGPT, lm_batch, lm_loss  # noqa: E402

from sdcguard.checks.reduce_checksum import ChecksumWeights, Shape, judge_checksum, rounding_bound, vote  # noqa: E402
from sdcguard.checks.replay import Payload, replay  # noqa: E402
from sdcguard.checks.rng import forward_seed, seeded  # noqa: E402
from sdcguard.fingerprint import fingerprint, fingerprint_many  # noqa: E402


def timed(fn, device, reps=10):
    fn()  # warm-up: kernels compiled, tables made
    return best_of(fn, device, reps)


def check4(device) -> bool:
    ok = True
    print("check 4 on the device: per bucket and step, against one copy_ of the bucket")
    print(f"{'bucket':18s} {'hook ms':>8s} {'copy_ ms':>9s} {'x copy_':>8s}")
    weights = ChecksumWeights(seed=0)
    weights.begin_step(1)
    for label, n, dtype in (("25 MB float32", 25 << 18, torch.float32), ("100 MB float32", 100 << 18, torch.float32),
                            ("25 MB bfloat16", 25 << 19, torch.bfloat16)):
        flat = torch.randn(n, device=device).to(dtype)
        dst = torch.empty_like(flat)
        hook = timed(lambda: (weights.terms(0, flat), weights.checksum(0, flat)), device)
        copy = timed(lambda: dst.copy_(flat), device)
        print(f"{label:18s} {hook * 1e3:8.3f} {copy * 1e3:9.3f} {hook / copy:8.2f}")
    world, n = 8, 1 << 20
    for dtype in (torch.float32, torch.bfloat16):
        gen = torch.Generator(device=device).manual_seed(3)
        grads = [(torch.randn(n, device=device, generator=gen) * 1e-3).to(dtype) for _ in range(world)]
        local = [weights.terms(0, g) for g in grads]
        shape = Shape(world=world, buckets=1, elements=n, dtypes=(dtype,))

        def summed(reduced):
            red = weights.checksum(0, reduced)
            votes = [vote([t], [red], [(n, dtype)], world) for t in local]
            return sum(float(v[0]) for v in votes), sum(float(v[1]) for v in votes)

        def judged(reduced):
            return judge_checksum(*summed(reduced), shape)

        honest = 0
        for trial in range(20):
            order = torch.randperm(world).tolist()
            total = (grads[order[0]] * (1.0 / world)).to(dtype)
            for r in order[1:]:
                total = (total + (grads[r] * (1.0 / world)).to(dtype)).to(dtype)
            honest += judged(total) is not None
        bound = rounding_bound(summed(total)[1], shape)
        bad = total.to(torch.float64)
        bad[12345] += 4 * bound  # the test's corruption: a few bounds in one element (weights >= 1)
        caught = judged(bad.to(dtype)) is not None
        print(f"  bound, {world} ranks, {str(dtype)[6:]}: false alarms {honest} of 20 honest orders; "
              f"one element off by 4 bounds ({4 * bound:.2e}): {'caught' if caught else 'MISSED'}")
        ok &= honest == 0 and caught
    return ok


def replay_bits(device) -> bool:
    torch.use_deterministic_algorithms(True)
    ok = True
    for label, autocast in (("float32", None), ("bf16 autocast", torch.bfloat16)):
        torch.manual_seed(0)
        model = TinyGPT().to(device)
        params = [(i, p) for i, p in enumerate(model.parameters())]

        def loss_fn(module, batch):
            if autocast is None:
                return lm_loss(module, batch)
            with torch.autocast(device.type, dtype=autocast):
                return lm_loss(module, batch)

        same = 0
        for step in range(5):
            batch = tuple(t.to(device) for t in lm_batch(step, 0))
            model.zero_grad(set_to_none=True)
            with seeded(forward_seed(0, step, 0, 0), device):
                loss_fn(model, batch).backward()
            original = fingerprint_many([p.grad for _, p in params])
            payload = Payload(step=step, owner=0, micro_batches=[batch])
            again = replay(model, loss_fn, params, payload, seed=0, device=device)
            same += [again.grad_fps[i] for i, _ in params] == original
        print(f"check 2 replay, deterministic algorithms, {label}: {same} of 5 steps bit for bit")
        ok &= same == 5
    torch.use_deterministic_algorithms(False)
    return ok


def account(device, steps) -> None:
    torch.manual_seed(0)
    big = device.type == "cuda"  # on CPU (kept working without a GPU) a small one
    model = (TinyGPT(dim=512, layers=6, heads=8, context=256) if big else TinyGPT()).to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    batch = tuple(t.to(device) for t in (lm_batch(0, 0, batch=16, context=256) if big else lm_batch(0, 0)))

    def step():
        opt.zero_grad(set_to_none=True)
        lm_loss(model, batch).backward()
        opt.step()

    t_step = timed(step, device, steps)
    flat = torch.cat([p.grad.reshape(-1) for p in model.parameters()])
    buckets = list(flat.split(25 << 18))  # DDP's default 25 MB buckets
    weights = ChecksumWeights(seed=0)
    weights.begin_step(1)
    hook = timed(lambda: [(weights.terms(i, b), weights.checksum(i, b)) for i, b in enumerate(buckets)], device, steps)
    weights_fp = timed(lambda: fingerprint_many([p.detach() for p in model.parameters()]), device, steps)
    grads_fp = timed(lambda: [fingerprint(b) for b in buckets], device, steps)
    n = flat.numel()
    print(f"one rank, TinyGPT {n / 1e6:.1f}M parameters ({len(buckets)} buckets): step {t_step * 1e3:.2f} ms")
    for label, t in (("comm hook (checks 1 and 4), every step", hook),
                     ("check 3 weight fingerprint (when it runs)", weights_fp),
                     ("check 2 gradient fingerprints (audit steps)", grads_fp)):
        print(f"  {label:45s} {t * 1e3:8.3f} ms  {t / t_step:+.4f} of a step")


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--steps", type=int, default=30)
    args = parser.parse_args()
    device = torch.device(args.device)
    if device.type == "cuda":
        print(torch.cuda.get_device_name(device), "torch", torch.__version__)
    ok = check4(device)
    ok &= replay_bits(device)
    account(device, args.steps)
    print("all checks passed" if ok else "A CHECK FAILED")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
