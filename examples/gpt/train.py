"""Train a small GPT with DDP, nanoGPT-style, under sdcguard: train_plain.py ported to it.

    torchrun --standalone --nproc_per_node=3 examples/gpt/train.py --steps 40 --audit-every 10

Every step's gradients are checked before the update (NaN/Inf per rank; on audit steps a replay of
each rank's batch on another rank, bit for bit); the weights are compared across replicas every
--weight-check-every steps and before each checkpoint. ``--inject SPEC`` plants a fault to see
which check catches it; ``--inf-sample-step`` a data-caused Inf, which is not SDC. See README.md.
"""
import math
import os
import sys
import time
from contextlib import nullcontext

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # PYTHONSAFEPATH=1 leaves this folder out

import sdcguard
import torch
from torch.distributed import destroy_process_group, init_process_group
from torch.nn.parallel import DistributedDataParallel as DDP

from data import build_corpus, get_batch, poison
from harness import Results, install_faults, parse_args
from model import GPT, GPTConfig

args = parse_args()
init_process_group(backend="gloo")
rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
master_process = rank == 0
torch.set_num_threads(1)  # the same thread count on every rank: identical arithmetic everywhere
torch.manual_seed(args.seed + rank)  # DDP broadcasts rank 0's initial weights
os.makedirs(args.out, exist_ok=True)
ckpt_path = os.path.join(args.out, "ckpt.pt")
ptdtype = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[args.dtype]
ctx = nullcontext() if args.dtype == "float32" else torch.autocast("cpu", dtype=ptdtype)
corpus = build_corpus()
results = Results(args.out, rank, args.keep_going)


def batch_for(split, step, micro):
    """This rank's micro-batch; with --inf-sample-step, one sample there carries an Inf loss weight."""
    batch = get_batch(corpus, split, step, rank, micro, args.batch_size, args.block_size)
    corrupt = split == "train" and step == args.inf_sample_step and rank == args.inf_sample_rank and micro == 0
    return poison(batch) if corrupt else batch


def loss_fn(model, batch):
    """Forward and loss of one micro-batch."""
    X, Y, W = batch
    with ctx:
        _, loss = model(X, Y, W)
    return loss


# model init, or resume
model_args = dict(n_layer=args.n_layer, n_head=args.n_head, n_embd=args.n_embd, block_size=args.block_size,
                  bias=True, vocab_size=corpus.vocab_size, dropout=args.dropout)
iter_num, best_val_loss = 0, 1e9
if args.resume:
    checkpoint = torch.load(args.resume, map_location="cpu")
    for k in ("n_layer", "n_head", "n_embd", "block_size", "bias", "vocab_size"):
        model_args[k] = checkpoint["model_args"][k]
model = GPT(GPTConfig(**model_args))
if args.resume:
    state_dict = checkpoint["model"]
    for k in list(state_dict):  # the prefix torch.compile puts on the keys
        if k.startswith("_orig_mod."):
            state_dict[k[len("_orig_mod."):]] = state_dict.pop(k)
    model.load_state_dict(state_dict)
    iter_num, best_val_loss = checkpoint["iter_num"], checkpoint["best_val_loss"]
if master_process:
    print(f"{model.num_params()} parameters, vocabulary of {corpus.vocab_size} characters")
# a disabled GradScaler is a no-op (nanoGPT builds one always)
scaler = torch.amp.GradScaler("cpu", enabled=(args.dtype == "float16" or args.grad_scaler))
optimizer = model.configure_optimizers(args.weight_decay, args.lr, (0.9, 0.95))
injector = install_faults(args.inject, model, optimizer, rank, world_size)
if args.compile:
    model = torch.compile(model)
model = DDP(model)
if args.resume:  # reduce the first step in the bucket layout the original run had by then
    sdcguard.settle_buckets(model, loss_fn, batch_for("train", iter_num, 0))
raw_model = model.module
config = sdcguard.Config.from_env(audit_every=args.audit_every, weight_check_every=args.weight_check_every)
guard = sdcguard.Guard(model, optimizer, loss_fn, config=config, scaler=scaler, reduce_hook=injector.reduce_hook)
if args.resume:
    optimizer.load_state_dict(checkpoint["optimizer"])
    guard.load_checkpoint(args.resume, expect_step=args.expect_step, expect_sha256=args.expect_sha256)  # verified
    checkpoint = None


@torch.no_grad()
def estimate_loss():
    """Mean loss over fixed batches of each split: the same on every rank."""
    out = {}
    model.eval()
    for split in ("train", "val"):
        losses = torch.zeros(args.eval_iters)
        for k in range(args.eval_iters):
            batch = get_batch(corpus, split, -1, 0, k, args.batch_size, args.block_size)
            losses[k] = loss_fn(model, batch).item()
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
while iter_num < args.steps:
    for param_group in optimizer.param_groups:
        param_group["lr"] = get_lr(iter_num)
    if args.eval_interval and iter_num % args.eval_interval == 0:
        losses = estimate_loss()
        results.data["evals"][iter_num] = losses
        if master_process:
            print(f"step {iter_num}: train loss {losses['train']:.4f}, val loss {losses['val']:.4f}")
        if losses["val"] < best_val_loss or args.always_save:
            best_val_loss = losses["val"]
            if iter_num > 0:
                checkpoint = {"model": raw_model.state_dict(), "optimizer": optimizer.state_dict(),
                              "model_args": model_args, "iter_num": iter_num, "best_val_loss": best_val_loss,
                              "config": vars(args)}
                guard.save_checkpoint(ckpt_path, state=checkpoint)  # check 3, then rank 0 writes (step iter_num - 1)
                results.data["checkpoints"].append(iter_num)
    injector.begin_step(iter_num)
    with results.step(iter_num), guard.step(iter_num, micro_batches=args.accum) as s:
        optimizer.zero_grad(set_to_none=True)
        for micro_step in range(args.accum):
            loss = s.backward(batch_for("train", iter_num, micro_step), divide_by=args.accum)
        s.check()  # raises on every rank: SDCDetected, NonFiniteGradient
        if args.grad_clip != 0.0:
            scaler.unscale_(optimizer)
            torch.nn.utils.clip_grad_norm_(model.parameters(), args.grad_clip)
        scaler.step(optimizer)
        scaler.update()
        results.data["losses"][iter_num] = loss.item()
        if master_process and iter_num % args.log_interval == 0:
            print(f"iter {iter_num}: loss {loss.item():.4f}, {time.time() - t0:.1f} s")
    iter_num += 1
results.finish(raw_model, iter_num, fired=injector.fired)
destroy_process_group()
