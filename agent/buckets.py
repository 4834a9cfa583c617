"""``settle_buckets``: a resumed job reduces its first step exactly as the run it resumes did.

DDP builds its gradient buckets in reverse parameter order, records the order gradients become
ready in the first synchronised backward, and rebuilds the buckets in that order at the next
forward. A run's steps after its first therefore reduce in the rebuilt layout; a job resumed from
a checkpoint at step k reduces step k in the initial one. The ring all-reduce splits a bucket
into chunks by position, so which rank's value a sum starts from differs, and the float sum
rounds differently: the resumed run is no longer bit for bit the run it resumes (a recovered run
then cannot be compared with a clean one). One throw-away forward and backward before the first
real step, with the random state, the buffers and the gradients put back, makes the layout the
rebuilt one from the start.
"""
from __future__ import annotations

from typing import Any, Callable

import torch


def settle_buckets(model: torch.nn.Module, loss_fn: Callable[[torch.nn.Module, Any], torch.Tensor],
                   batch: Any) -> None:
    """Run ``loss_fn(model, batch).backward()`` once and undo everything but DDP's bucket layout.

    Call it on every rank of a job that resumes from a checkpoint, after ``DistributedDataParallel``
    wraps the model and before ``sdcguard.Guard`` does (the pass must not reach the checks), with
    any batch of the usual shape. The random number generators, the module's buffers (e.g.
    BatchNorm statistics) and the gradients are as before; the optimizer is not touched. A model
    without DDP (one process) has nothing to settle.
    """
    from .layouts import unwrap

    ddp, module, _ = unwrap(model)
    if ddp is None:
        return
    if ddp._get_ddp_logging_data().get("comm_hook"):
        raise RuntimeError("settle_buckets must run before a comm hook is registered (before sdcguard.Guard "
                           "wraps the model): its backward would go through the hook")
    devices = sorted({p.device.index for p in module.parameters() if p.device.type == "cuda"})
    buffers = [(b, b.detach().clone()) for b in module.buffers()]
    grads = [(p, None if p.grad is None else p.grad.detach().clone()) for p in module.parameters()]
    with torch.random.fork_rng(devices=devices):
        loss_fn(model, batch).backward()
    with torch.no_grad():
        for buffer, saved in buffers:
            buffer.copy_(saved)
        for parameter, grad in grads:  # the backward accumulated into existing gradients in place
            if grad is None or parameter.grad is None:
                parameter.grad = grad
            else:
                parameter.grad.copy_(grad)
