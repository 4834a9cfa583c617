"""Train a small classifier with Lightning's ModelParallelStrategy (FSDP2) on CPU under sdcguard: train_plain.py ported.

    torchrun --standalone --nproc_per_node=4 examples/lightning_fsdp/train.py --epochs 3 [--replicate 2]

The LightningModule (fully_shard in configure_model) and the DataModule are unchanged; the strategy
checks every optimizer step before its update (NaN/Inf in each rank's local gradient before its
reduce-scatter, the reductions' checksums; on audit steps the mesh replays every rank's batch and
compares local gradients bit for bit), compares each shard across its replicas (HSDP) every
--weight-check-every steps and before each checkpoint, and writes each checkpoint as a verified
DCP directory with a manifest. ``--inject SPEC`` plants a fault to see which check catches it.
"""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # PYTHONSAFEPATH=1 leaves this folder out

import lightning as L
import sdcguard.integrations.lightning
import torch
from lightning.pytorch.callbacks import ModelCheckpoint

from data import RandomData
from harness import callbacks, parse_args
from model import ShardedClassifier

args = parse_args()
torch.set_num_threads(1)  # the same thread count on every rank: identical arithmetic everywhere
L.seed_everything(args.seed)  # the same initial weights on every rank: fully_shard keeps each rank's shard
model = ShardedClassifier(lr=args.lr, replicate=args.replicate)
data = RandomData(args.samples, args.batch_size)
checkpoints = ModelCheckpoint(dirpath=os.path.join(args.out, "checkpoints"), save_last=args.save_last)
config = sdcguard.Config.from_env(audit_every=args.audit_every, weight_check_every=args.weight_check_every)
trainer = L.Trainer(
    accelerator="cpu", devices=int(os.environ.get("LOCAL_WORLD_SIZE", "1")),
    strategy=sdcguard.integrations.lightning.GuardedModelParallelStrategy(config, expect_step=args.expect_step, expect_sha256=args.expect_sha256,
                                   tensor_parallel_size=args.tp),
    max_epochs=args.epochs, accumulate_grad_batches=args.accumulate, gradient_clip_val=args.clip or None,
    callbacks=[checkpoints, *callbacks(args)],
    logger=False, enable_progress_bar=False, enable_model_summary=False, default_root_dir=args.out,
)
trainer.fit(model, datamodule=data, ckpt_path=args.resume)
