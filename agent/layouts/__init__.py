"""The parallel layouts sdcguard checks, each one implementation of :class:`base.Layout`.

:func:`build_layout` is the one place that looks at what kind of model it was given: DDP (or
``torch.compile`` of it) -> :class:`data_parallel.DataParallel`; a model sharded with FSDP2's
``fully_shard`` (pure FSDP or HSDP) -> :class:`fsdp.Sharded`, and with a tensor-parallel dimension
(``parallelize_module`` first) -> :class:`tensor_parallel.TensorParallel`; a pipeline schedule
(``torch.distributed.pipelining``) whose stages DDP or FSDP2 replicates -> :class:`pipeline.Pipeline`; a
plain module in one process -> :class:`single.SingleProcess`. Everything after it talks to the protocol only.
"""
from __future__ import annotations

import contextlib
import sys
import uuid
from typing import Any, Callable

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from ..checks.commhook import ReduceHook
from ..checks.topology import Topology, gather_topology, identity, local_gpu
from ..config import Config
from .base import Layout, Scale, StepRecord, Vote

__all__ = ["Layout", "Scale", "StepRecord", "Vote", "build_layout", "unwrap"]


def build_layout(model: torch.nn.Module, *, loss_fn: Callable[[torch.nn.Module, Any], torch.Tensor] | None,
                 optimizer: torch.optim.Optimizer, scaler: Any, config: Config,
                 zero_update: Callable[[], contextlib.AbstractContextManager[None]],
                 reduce_hook: ReduceHook | None = None, reduce_state: Any = None) -> Layout:
    """The layout of the user's ``model`` (collective: the ranks exchange their identities)."""
    from .pipeline import Pipeline, is_schedule
    if is_schedule(model):
        if not (dist.is_available() and dist.is_initialized()):
            raise TypeError("sdcguard: a pipeline schedule needs a process group")
        if loss_fn is not None:
            raise TypeError("sdcguard: a pipeline schedule computes its loss itself (its loss_fn): build the "
                            "Guard without loss_fn")
        device = _collective_device(None)
        return Pipeline(schedule=model, topology=gather_topology(config, None, device), device=device,
                        seed=config.seed, optimizer=optimizer, scaler=scaler, reduce_hook=reduce_hook,
                        reduce_state=reduce_state, zero_update=zero_update)
    if loss_fn is None:
        raise TypeError("sdcguard: Guard needs loss_fn(module, micro_batch) (only a pipeline schedule brings its own)")
    ddp, module, compiled = unwrap(model)
    compiled = compiled or _compiles_inside(module)
    wrappers = _wrappers(model, module)
    distributed = dist.is_available() and dist.is_initialized()
    if _is_fsdp(module):
        if reduce_hook is not None or not distributed:
            raise TypeError("sdcguard: an FSDP2 model needs a process group, and takes no DDP reduce_hook")
        from ..sharding.layout import tensor_parallel_columns
        from .fsdp import Sharded
        from .tensor_parallel import TensorParallel
        device = _collective_device(None)
        kind = TensorParallel if tensor_parallel_columns(module) is not None else Sharded
        return kind(model=module, compiled=compiled, loss_fn=loss_fn,
                       topology=gather_topology(config, None, device, param_device(module)), device=device,
                       seed=config.seed,
                       optimizer=optimizer, scaler=scaler, zero_update=zero_update,
                       weight_check_every=config.weight_check_every)
    if ddp is not None:
        if any(hasattr(p, "device_mesh") for p in module.parameters()):
            raise TypeError("sdcguard: DistributedDataParallel over DTensor (tensor-parallel) parameters is not "
                            "checked: shard the data-parallel dimensions with FSDP2's fully_shard (a replicate-only "
                            "mesh for plain data parallelism, as torchtitan does)")
        from .data_parallel import DataParallel
        device = _collective_device(ddp.process_group)
        return DataParallel(ddp=ddp, wrappers=wrappers, compiled=compiled, loss_fn=loss_fn,
                            topology=gather_topology(config, ddp.process_group, device, param_device(module)),
                            device=device,
                            seed=config.seed, reduce_hook=reduce_hook, reduce_state=reduce_state,
                            optimizer=optimizer, scaler=scaler)
    if distributed and dist.get_world_size() > 1:
        raise TypeError("with more than one process, Guard needs the model wrapped in "
                        "DistributedDataParallel (or torch.compile of it), or sharded with FSDP2's fully_shard")
    if reduce_hook is not None:
        raise TypeError("reduce_hook needs a DistributedDataParallel model")
    from .single import SingleProcess
    topology = Topology(0, 1, 1, {0: identity(0, config.pod, config.node, config.pod_uid,
                                              local_gpu(param_device(module), 0))},
                        run_id=uuid.uuid4().hex[:12], threads={0: torch.get_num_threads()})
    return SingleProcess(module=module, wrappers=wrappers, compiled=compiled, topology=topology,
                         device=param_device(module), optimizer=optimizer, scaler=scaler)


def unwrap(model: torch.nn.Module) -> tuple[DistributedDataParallel | None, torch.nn.Module, bool]:
    """(the DDP wrapper or None, the bare module, whether torch.compile is involved) of
    DDP, ``torch.compile(ddp)``, ``DDP(torch.compile(module))`` or a plain module."""
    ddp, compiled, m = None, False, model
    while True:
        if isinstance(m, DistributedDataParallel):
            ddp, m = m, m.module
        elif isinstance(getattr(m, "_orig_mod", None), torch.nn.Module):  # torch.compile's wrapper
            compiled, m = True, m._orig_mod
        else:
            return ddp, m, compiled


def _wrappers(model: torch.nn.Module, module: torch.nn.Module) -> tuple[torch.nn.Module, ...]:
    """The objects between the user's ``model`` and the bare ``module``, outermost first."""
    out, m = [], model
    while m is not module:
        out.append(m)
        m = m.module if isinstance(m, DistributedDataParallel) else m._orig_mod
    return tuple(out)


def _compiles_inside(module: torch.nn.Module) -> bool:
    """Whether a submodule runs compiled: ``torch.compile(block)`` put in the tree, or
    ``block.compile()`` in place (torchtitan compiles each block so, before ``fully_shard``)."""
    return any(getattr(m, "_compiled_call_impl", None) is not None or isinstance(getattr(m, "_orig_mod", None), torch.nn.Module)
               for m in module.modules())


def _is_fsdp(module: torch.nn.Module) -> bool:
    """Whether ``fully_shard`` was applied to the root (no FSDP import for a model that never used it)."""
    if "torch.distributed.fsdp" not in sys.modules:
        return False
    from torch.distributed.fsdp import FSDPModule
    return isinstance(module, FSDPModule)


def _collective_device(group: dist.ProcessGroup | None) -> torch.device:
    """Small check tensors travel on the device the backend wants (CUDA for NCCL)."""
    if dist.get_backend(group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def param_device(module: torch.nn.Module) -> torch.device:
    first = next(module.parameters(), None)
    return first.device if first is not None else torch.device("cpu")
