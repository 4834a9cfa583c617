"""Train a tiny classifier in a Lightning Fabric loop under DDP and sdcguard: train_plain.py ported.

    SDCGUARD_AUDIT_EVERY=4 SDCGUARD_WEIGHT_CHECK_EVERY=2 \
        torchrun --standalone --nproc_per_node=2 examples/fabric/train.py --steps 12 --save-every 4

Every optimizer step's gradients are checked before fabric.clip_gradients and the update (NaN/Inf
per rank, the all-reduce's checksum; on audit steps a replay of each rank's micro-batches on another
rank, bit for bit); the weights are compared across replicas every SDCGUARD_WEIGHT_CHECK_EVERY
steps and before each fabric.save, which gets a manifest; fabric.load checks the file first.
``--inject SPEC`` plants a fault. See README.md.
"""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # PYTHONSAFEPATH=1 leaves this folder out

import torch
import torch.nn.functional as F
from lightning.fabric import Fabric
from sdcguard.integrations.fabric import fabric_guard

from harness import Harness, build_loader, build_model, parse_args


def main(argv=None, teardown=True):
    args = parse_args(argv)
    torch.set_num_threads(1)  # the same thread count on every rank: identical arithmetic everywhere
    harness = Harness(args, teardown)

    def loss_fn(module, batch):  # the forward and the loss of one micro-batch
        x, y = batch
        return harness.loss(F.cross_entropy(module(x), y))

    devices = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    fabric = Fabric(accelerator="cpu", strategy="ddp", devices=devices, precision=args.precision)
    fabric.launch()
    model = build_model(args)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr)
    scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=args.steps)
    model, optimizer = fabric.setup(model, optimizer)
    loader = fabric.setup_dataloaders(build_loader(args))
    guard = fabric_guard(fabric, model, optimizer, loss_fn, expect_step=args.expect_step, expect_sha256=args.expect_sha256, settle_with=harness.settle_batch(loader), reduce_hook=harness.reduce_hook)
    harness.watch(model, optimizer)
    state = {"model": model, "optimizer": optimizer, "scheduler": scheduler}
    with harness.run():
        start = fabric.load(args.resume, state)["step"] + 1 if args.resume else 0
        for step, batches in zip(range(start, args.steps), harness.batches(loader, start)):
            with harness.step(step), guard.step(step, micro_batches=len(batches)) as s:
                for i, batch in enumerate(batches):
                    s.backward(batch, divide_by=len(batches))
                s.check()  # raises on every rank: SDCDetected, NonFiniteGradient
                fabric.clip_gradients(model, optimizer, max_norm=args.max_grad_norm)
                optimizer.step()
                scheduler.step()
                optimizer.zero_grad()
            if args.save_every and (step + 1) % args.save_every == 0:
                fabric.save(os.path.join(args.out, "ckpt.pt"), {**state, "step": step})


if __name__ == "__main__":
    main()
