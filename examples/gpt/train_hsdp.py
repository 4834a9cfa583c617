"""Train the small GPT sharded with FSDP2 over a (replicate, shard) mesh — HSDP — under sdcguard.

    torchrun --standalone --nproc_per_node=4 examples/gpt/train_hsdp.py --replicate 2 --shard 2 \
        --steps 20 --audit-every 5 [--mixed-precision] [--no-sdcguard]

The mesh is built as torchtitan builds it (``init_device_mesh(..., (R, S), mesh_dim_names=
("replicate", "shard"))``, ``fully_shard`` on every block, then on the root; ``--replicate 1`` is
pure FSDP over a 1-D mesh). The loop is the user's own: gradient accumulation over ``--accum``
micro-batches (FSDP2 reduce-scatters each one, and on HSDP all-reduces it across the replicas, as
torchtitan does), ``clip_grad_norm_`` on the DTensor gradients, ``optimizer.step()``. sdcguard's
part is the Guard and ``guard.step`` / ``s.backward`` / ``s.check``; ``--no-sdcguard`` runs the
same loop without it (the same arithmetic: with dropout off, the same bits).

What runs for the mesh (the Guard logs it at start-up): checks 1 and 4 on every step (a NaN/Inf
in one rank's local gradient named before its reduce-scatter; the reduce-scatter's and HSDP's
all-reduce's checksums), check 2 on audit steps (the whole mesh replays the ring's batches and
compares each rank's local gradient per unit and micro-batch), check 3 on weight-check steps
(HSDP only: each shard across its replicas). With ``--mixed-precision``
(``MixedPrecisionPolicy(param_dtype=bfloat16, reduce_dtype=float32)``) every one of them runs as
in float32: the replay recomputes the bfloat16 forward and backward bit for bit on CPU, FSDP2
reduces in float32 with its plain average (check 4's float32 bound), and the shards the optimizer
updates and check 3 compares are float32. ``--reduce-bf16`` leaves ``reduce_dtype`` unset, so the
gradients are reduced in bfloat16: check 4 still runs, with bfloat16's bound (only errors larger
than the gradient itself show). ``--compile blocks`` compiles each block in place before
``fully_shard`` (torchtitan's way), ``--compile root`` the sharded root after it; audit steps run
eagerly (their own pass and the replays), the others compiled. See docs/sharded.md.
"""
import argparse
import math
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # PYTHONSAFEPATH=1 leaves this folder out

import sdcguard
import torch
from sdcguard.faults.sharded import ShardedFaultInjector
from torch.distributed import destroy_process_group, init_process_group
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

from data import build_corpus, get_batch
from harness import Results
from model import GPT, GPTConfig


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description="Train the small GPT with FSDP2 / HSDP under sdcguard (torchrun, gloo).")
    add = p.add_argument
    add("--replicate", type=int, default=2, help="replicas (the mesh's replicate dimension); 1: pure FSDP")
    add("--shard", type=int, default=2, help="ranks each replica is sharded over (replicate x shard = world size)")
    add("--steps", type=int, default=20)
    add("--accum", type=int, default=2, help="gradient accumulation steps (micro-batches per step)")
    add("--batch-size", type=int, default=4, help="sequences per micro-batch and rank")
    add("--block-size", type=int, default=32)
    add("--n-layer", type=int, default=2)
    add("--n-head", type=int, default=2)
    add("--n-embd", type=int, default=32)
    add("--dropout", type=float, default=0.0)
    add("--lr", type=float, default=1e-3)
    add("--min-lr", type=float, default=1e-4)
    add("--warmup", type=int, default=5)
    add("--weight-decay", type=float, default=0.1)
    add("--grad-clip", type=float, default=1.0, help="clip the gradient norm at this value; 0: off")
    add("--mixed-precision", action="store_true",
        help="MixedPrecisionPolicy(param_dtype=bfloat16, reduce_dtype=float32)")
    add("--reduce-bf16", action="store_true", help="with --mixed-precision: reduce the gradients in bfloat16 too")
    add("--compile", choices=("blocks", "root"), default=None,
        help="torch.compile each block before fully_shard (torchtitan's way), or the sharded root after it")
    add("--eval-interval", type=int, default=10, help="evaluate every N steps; 0: never")
    add("--eval-iters", type=int, default=2)
    add("--log-interval", type=int, default=10)
    add("--seed", type=int, default=1337, help="model initialisation seed (the same on every rank)")
    add("--out", default="out-gpt-hsdp", help="per-rank result files")
    add("--no-sdcguard", dest="sdcguard", action="store_false", help="the same loop without sdcguard")
    add("--audit-every", type=int, default=10, help="sdcguard: replay audit every N steps (SDCGUARD_* wins)")
    add("--weight-check-every", type=int, default=5, help="sdcguard: check 3 every N steps (HSDP)")
    add("--inject", action="append", default=[], metavar="SPEC",
        help="fault to inject (sdcguard.faults.sharded), KIND:rank=R:step=S[:element=N][:param=NAME|:site=PATH]")
    add("--keep-going", action="store_true", help="after a step raises, record it and go on (tests)")
    return p.parse_args()


class Unguarded:
    """``--no-sdcguard``: the step's verbs without sdcguard, so that the loop reads the same."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.model = model

    def __enter__(self) -> "Unguarded":
        return self

    def __exit__(self, *exc: object) -> None:
        return None

    def backward(self, micro, divide_by: int) -> torch.Tensor:
        loss = loss_fn(self.model, micro)
        (loss / divide_by).backward()
        return loss.detach()

    def check(self) -> None:
        return None


args = parse_args()
init_process_group(backend="gloo")
rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
master_process = rank == 0
torch.set_num_threads(1)  # the same thread count on every rank: identical arithmetic everywhere
if args.replicate * args.shard != world_size:
    raise SystemExit(f"--replicate {args.replicate} x --shard {args.shard} must be the world size {world_size}")
mesh = (init_device_mesh("cpu", (args.replicate, args.shard), mesh_dim_names=("replicate", "shard"))
        if args.replicate > 1 else init_device_mesh("cpu", (args.shard,), mesh_dim_names=("shard",)))
corpus = build_corpus()
results = Results(args.out, rank, args.keep_going)


def loss_fn(model, batch):
    """Forward and loss of one micro-batch."""
    X, Y, W = batch
    _, loss = model(X, Y, W)
    return loss


torch.manual_seed(args.seed)  # the same full weights on every rank: fully_shard keeps each rank's shard of them
model = GPT(GPTConfig(n_layer=args.n_layer, n_head=args.n_head, n_embd=args.n_embd, block_size=args.block_size,
                      bias=True, vocab_size=corpus.vocab_size, dropout=args.dropout))
if master_process:
    print(f"{model.num_params()} parameters, mesh {tuple(mesh.mesh.shape)}")
mp_policy = MixedPrecisionPolicy()
if args.mixed_precision:
    mp_policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16,
                                     reduce_dtype=None if args.reduce_bf16 else torch.float32)
for block in model.transformer.h:
    if args.compile == "blocks":
        block.compile()  # in place, before fully_shard, as torchtitan does
    fully_shard(block, mesh=mesh, mp_policy=mp_policy)
fully_shard(model, mesh=mesh, mp_policy=mp_policy)  # the root: embeddings (tied to the head), ln_f
if args.compile == "root":
    model = torch.compile(model)
optimizer = model.configure_optimizers(args.weight_decay, args.lr, (0.9, 0.95))  # on the sharded parameters
guard, injector = None, None
if args.sdcguard:
    config = sdcguard.Config.from_env(audit_every=args.audit_every, weight_check_every=args.weight_check_every)
    guard = sdcguard.Guard(model, optimizer, loss_fn, config=config)
    injector = ShardedFaultInjector(args.inject, rank)  # after the Guard: it owns the reduce hooks
    injector.install(guard, param="transformer.h.0.mlp.c_fc.weight", site="transformer.h.0.mlp")


@torch.no_grad()
def estimate_loss():
    """Mean loss over fixed batches of each split: the same on every rank (every rank runs it)."""
    out = {}
    model.eval()
    for split in ("train", "val"):
        losses = torch.zeros(args.eval_iters)
        for k in range(args.eval_iters):
            losses[k] = loss_fn(model, get_batch(corpus, split, -1, 0, k, args.batch_size, args.block_size)).item()
        out[split] = losses.mean().item()
    model.train()
    return out


def get_lr(it):
    """Linear warm-up, then cosine decay to min_lr."""
    if it < args.warmup:
        return args.lr * (it + 1) / (args.warmup + 1)
    ratio = min(1.0, (it - args.warmup) / max(1, args.steps - args.warmup))
    return args.min_lr + 0.5 * (1.0 + math.cos(math.pi * ratio)) * (args.lr - args.min_lr)


t0 = time.time()
iter_num = 0
while iter_num < args.steps:
    for param_group in optimizer.param_groups:
        param_group["lr"] = get_lr(iter_num)
    if args.eval_interval and iter_num % args.eval_interval == 0:
        results.data["evals"][iter_num] = losses = estimate_loss()
        if master_process:
            print(f"step {iter_num}: train loss {losses['train']:.4f}, val loss {losses['val']:.4f}")
    if injector is not None:
        injector.begin_step(iter_num)
    step = guard.step(iter_num, micro_batches=args.accum) if guard is not None else Unguarded(model)
    with results.step(iter_num), step as s:
        optimizer.zero_grad(set_to_none=True)
        for micro_step in range(args.accum):
            # FSDP2 reduce-scatters each micro-batch's gradients (HSDP: and all-reduces them)
            loss = s.backward(get_batch(corpus, "train", iter_num, rank, micro_step, args.batch_size,
                                        args.block_size), divide_by=args.accum)
        s.check()  # sdcguard: checks 1 and 4 (2 and 3 on audit steps) before the update, on every rank alike
        if args.grad_clip != 0.0:
            torch.nn.utils.clip_grad_norm_(model.parameters(), args.grad_clip)  # DTensor gradients
        optimizer.step()
        results.data["losses"][iter_num] = loss.item()
        if master_process and iter_num % args.log_interval == 0:
            print(f"iter {iter_num}: loss {loss.item():.4f}, {time.time() - t0:.1f} s")
    # leaving the guarded step ran check 3 on weight-check steps
    iter_num += 1
extra = {"fired": injector.fired if injector is not None else [], "sdcguard": args.sdcguard,
         "compiled_graphs": torch._dynamo.utils.counters["stats"]["unique_graphs"]}  # 0 unless --compile
if guard is not None:
    extra.update(last_audited=guard.history.last_audited_step, last_weights_verified=guard.last_weights_verified_step,
                 last_reduction_verified=guard.history.last_reduction_verified_step,
                 plan=guard.plan_lines())
    guard.close()
results.finish(model, iter_num, **extra)
destroy_process_group()
