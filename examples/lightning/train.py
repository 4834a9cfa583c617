"""Train a small classifier with Lightning's DDP on CPU under sdcguard: train_plain.py ported to it.

    torchrun --standalone --nproc_per_node=3 examples/lightning/train.py --epochs 3 --audit-every 4

The LightningModule and the DataModule are unchanged; the strategy checks every optimizer step
before its update (NaN/Inf per rank, the all-reduce's checksum; on audit steps a replay of each
rank's batch on another rank, bit for bit), compares the weights across replicas every
--weight-check-every steps and before each checkpoint, and gives every checkpoint a manifest.
``--inject SPEC`` plants a fault to see which check catches it. See README.md.
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
from model import TinyClassifier

args = parse_args()
torch.set_num_threads(1)  # the same thread count on every rank: identical arithmetic everywhere
L.seed_everything(args.seed)  # the same initial weights on every rank
model = TinyClassifier(lr=args.lr)
data = RandomData(args.samples, args.batch_size)
checkpoints = ModelCheckpoint(dirpath=os.path.join(args.out, "checkpoints"), save_last=args.save_last)
config = sdcguard.Config.from_env(audit_every=args.audit_every, weight_check_every=args.weight_check_every)
trainer = L.Trainer(
    accelerator="cpu", devices=int(os.environ.get("LOCAL_WORLD_SIZE", "1")),
    strategy=sdcguard.integrations.lightning.GuardedDDPStrategy(config, expect_step=args.expect_step, expect_sha256=args.expect_sha256),
    max_epochs=args.epochs, accumulate_grad_batches=args.accumulate, gradient_clip_val=args.clip or None,
    precision=args.precision, callbacks=[checkpoints, *callbacks(args)],
    logger=False, enable_progress_bar=False, enable_model_summary=False, default_root_dir=args.out,
)
trainer.fit(model, datamodule=data, ckpt_path=args.resume)
