"""Peak memory of an audited step against a plain step, on the example GPT and a ~10M-parameter one.

    python bench/memory.py            # starts itself under torchrun with 2 gloo ranks (CPU)

For each model, on every rank: a plain DDP step (no sdcguard), then on a fresh copy under a Guard
an ordinary checked step and an audit step (``audit=True``: the neighbour's batch is replayed).
Each step is the example's: zero_grad, 2 micro-batches (no_sync on the first), clip, AdamW; the
optimizer state exists already (warm-up steps first), so what is measured is the step itself.

How it is measured: on CPU, tracemalloc does not see torch's allocations, and RSS mostly shows
glibc's arena caching (a freed activation stays mapped), so neither gives a per-step peak. The
profiler with ``profile_memory=True`` records every allocation and free made through c10's CPU
allocator, with its time: their running sum, in order, is the exact peak of tensor bytes above
what was live when the step began (parameters, optimizer state, DDP's buckets). Allocations
made outside c10 (gloo's own buffers, the pickled batch sent to the replaying rank) are not in it.
The target: an audit step's peak <= a plain step's peak + one copy of the gradients.
"""
from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
from pathlib import Path

EXAMPLE = Path(__file__).resolve().parent.parent / "examples" / "gpt"
MODELS = {  # name -> (GPTConfig fields, micro-batch size)
    "example": (dict(n_layer=2, n_head=2, n_embd=32, block_size=32), 4),
    "10M": (dict(n_layer=6, n_head=6, n_embd=384, block_size=64), 4),
}
MICRO = 2


def main() -> int:
    if "RANK" not in os.environ:  # start ourselves under torchrun
        env = {**os.environ, "OMP_NUM_THREADS": "1"}
        return subprocess.call([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
                                __file__], env=env)
    import torch
    import torch.distributed as dist

    sys.path.insert(0, str(EXAMPLE))
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    rows = [measure(name, *MODELS[name], rank) for name in MODELS]
    if rank == 0:
        print(f"{'model':8} {'params':>9} {'grads MiB':>9} {'plain MiB':>9} {'checked':>8} {'audit':>8} "
              f"{'audit/plain':>11} {'(audit-plain)/grads':>19}")
        for r in rows:
            mib = 1 << 20
            print(f"{r['model']:8} {r['params']:>9,} {r['grads'] / mib:>9.2f} {r['plain'] / mib:>9.2f} "
                  f"{r['checked'] / mib:>8.2f} {r['audit'] / mib:>8.2f} {r['audit'] / r['plain']:>11.2f} "
                  f"{(r['audit'] - r['plain']) / r['grads']:>19.2f}")
        print("MiB: peak tensor bytes allocated during the step above those live at its start (rank 0);")
        print("live at the start of each (not counted above): weights + AdamW state = "
              + ", ".join(f"{r['model']} {r['static'] / (1 << 20):.2f} MiB" for r in rows)
              + ", and DDP's buckets (one more copy of the gradients)")
        print(json.dumps(rows))
    dist.destroy_process_group()
    return 0


def measure(name: str, fields: dict, batch_size: int, rank: int) -> dict:
    import torch
    from torch.nn.parallel import DistributedDataParallel as DDP

    import sdcguard
    from data import build_corpus, get_batch
    from model import GPT, GPTConfig

    corpus = build_corpus()
    config = GPTConfig(vocab_size=corpus.vocab_size, dropout=0.0, **fields)

    def batches(step):
        return [get_batch(corpus, "train", step, rank, m, batch_size, config.block_size) for m in range(MICRO)]

    def loss_fn(module, batch):
        x, y, w = batch
        return module(x, y, w)[1]

    def fresh():
        torch.manual_seed(0)
        model = GPT(config)
        return model, DDP(model), model.configure_optimizers(0.1, 1e-3, (0.9, 0.95))

    # Plain DDP.
    model, ddp, opt = fresh()

    def plain_step(step):
        for i, micro in enumerate(batches(step)):
            with ddp.no_sync() if i < MICRO - 1 else contextlib.nullcontext():
                (loss_fn(ddp, micro) / MICRO).backward()
        torch.nn.utils.clip_grad_norm_(ddp.parameters(), 1.0)
        opt.step()

    for step in range(2):
        opt.zero_grad(set_to_none=True)
        plain_step(step)
    opt.zero_grad(set_to_none=True)
    plain = peak_bytes(lambda: plain_step(2))
    params = sum(p.numel() for p in model.parameters())
    grads = sum(p.numel() * p.element_size() for p in model.parameters())  # float32: as the weights
    state = [t for s in opt.state.values() for t in s.values() if torch.is_tensor(t)]
    static = grads + sum(t.numel() * t.element_size() for t in state)  # weights + AdamW state
    del model, ddp, opt

    # The same under sdcguard: an ordinary checked step and an audit step.
    model, ddp, opt = fresh()
    guard = sdcguard.Guard(ddp, opt, loss_fn, config=sdcguard.Config(audit_every=0, weight_check_every=0))

    def guarded_step(step, audit):
        with guard.step(step, micro_batches=MICRO, audit=audit) as s:
            for micro in batches(step):
                s.backward(micro, divide_by=MICRO)
            s.check()
            torch.nn.utils.clip_grad_norm_(ddp.parameters(), 1.0)
            opt.step()

    for step in range(2):
        opt.zero_grad(set_to_none=True)
        guarded_step(step, audit=step == 1)  # warm both paths up
    opt.zero_grad(set_to_none=True)
    checked = peak_bytes(lambda: guarded_step(2, audit=False))
    opt.zero_grad(set_to_none=True)
    audit = peak_bytes(lambda: guarded_step(3, audit=True))
    guard.close()
    return {"model": name, "params": params, "grads": grads, "static": static,
            "plain": plain, "checked": checked, "audit": audit}


def peak_bytes(fn) -> int:
    """Peak of (bytes allocated - bytes freed) through c10's CPU allocator while ``fn`` runs."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    events = sorted((e.start_ns(), e.nbytes()) for e in prof.profiler.kineto_results.events() if e.name() == "[memory]")
    live = peak = 0
    for _, nbytes in events:
        live += nbytes
        peak = max(peak, live)
    return peak


if __name__ == "__main__":
    sys.exit(main())
