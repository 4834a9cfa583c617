"""Train a tiny classifier in a Lightning Fabric loop under DDP, without sdcguard: the starting point.

    torchrun --standalone --nproc_per_node=2 examples/fabric/train_plain.py --steps 12 --save-every 4

train.py is this script ported to sdcguard; ``python bench/port_lines.py`` counts the lines the
port changed. Flags, the model, the data and the result files live in harness.py, shared by both.
"""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # PYTHONSAFEPATH=1 leaves this folder out

import torch
import torch.nn.functional as F
from lightning.fabric import Fabric

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
    harness.watch(model, optimizer)
    state = {"model": model, "optimizer": optimizer, "scheduler": scheduler}
    with harness.run():
        start = fabric.load(args.resume, state)["step"] + 1 if args.resume else 0
        for step, batches in zip(range(start, args.steps), harness.batches(loader, start)):
            with harness.step(step):
                for i, batch in enumerate(batches):
                    with fabric.no_backward_sync(model, enabled=i < len(batches) - 1):
                        fabric.backward(loss_fn(model, batch) / len(batches))
                fabric.clip_gradients(model, optimizer, max_norm=args.max_grad_norm)
                optimizer.step()
                scheduler.step()
                optimizer.zero_grad()
            if args.save_every and (step + 1) % args.save_every == 0:
                fabric.save(os.path.join(args.out, "ckpt.pt"), {**state, "step": step})


if __name__ == "__main__":
    main()
