"""Train a small classifier with Lightning's ModelParallelStrategy (FSDP2) on CPU, without sdcguard.

    torchrun --standalone --nproc_per_node=4 examples/lightning_fsdp/train_plain.py --epochs 3 [--replicate 2]

train.py is this script ported to sdcguard; ``python bench/port_lines.py`` counts the lines the
port changed. Flags, fault injection and result files live in harness.py, shared by both.
"""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # PYTHONSAFEPATH=1 leaves this folder out

import lightning as L
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.strategies import ModelParallelStrategy

from data import RandomData
from harness import callbacks, parse_args
from model import ShardedClassifier

args = parse_args()
torch.set_num_threads(1)  # the same thread count on every rank: identical arithmetic everywhere
L.seed_everything(args.seed)  # the same initial weights on every rank: fully_shard keeps each rank's shard
model = ShardedClassifier(lr=args.lr, replicate=args.replicate)
data = RandomData(args.samples, args.batch_size)
checkpoints = ModelCheckpoint(dirpath=os.path.join(args.out, "checkpoints"), save_last=args.save_last)
trainer = L.Trainer(
    accelerator="cpu", devices=int(os.environ.get("LOCAL_WORLD_SIZE", "1")),
    strategy=ModelParallelStrategy(data_parallel_size=int(os.environ.get("WORLD_SIZE", "1")) // args.tp,
                                   tensor_parallel_size=args.tp),
    max_epochs=args.epochs, accumulate_grad_batches=args.accumulate, gradient_clip_val=args.clip or None,
    callbacks=[checkpoints, *callbacks(args)],
    logger=False, enable_progress_bar=False, enable_model_summary=False, default_root_dir=args.out,
)
trainer.fit(model, datamodule=data, ckpt_path=args.resume)
