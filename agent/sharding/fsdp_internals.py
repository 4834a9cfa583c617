"""The parts of FSDP2 the sharded checks rely on that are not its public API, checked once.

The recording reduce-scatter (``reduce_record``) and the isolated replay (``replay``) read and
set a few attributes of FSDP2's param groups and parameters (as of torch 2.13). A torch release
that renames one would otherwise fail in the middle of a step, or — worse — let a replay touch
the real step's gradients; so the Guard asks here first and refuses the model with one clear
line naming what is missing.

A mesh with one rank per shard group relies on more: on the order of ``foreach_reduce``'s steps,
where no reduce-scatter is called (``reduce_record``'s module docstring), and on FSDP2's choice of
the all-reduce's op. :func:`single_shard_gaps` reads both in this torch's source, so a release that
reorders them refuses such a mesh at start-up instead of recording the wrong buffer.
"""
from __future__ import annotations

import inspect
from typing import Iterator

import torch

_STATE = ("_state_ctx", "_fsdp_param_groups")
_CONTEXT = ("is_last_backward",)
_GROUP = ("fsdp_params", "reduce_grads", "all_reduce_grads", "_partial_reduce_output", "_all_reduce_hook",
          "_reduce_scatter_comm", "mesh_info", "gradient_divide_factor", "force_sum_reduction_for_comms",
          "mp_policy")
_PARAM = ("sharded_param", "unsharded_accumulated_grad")


def missing(model: torch.nn.Module) -> list[str]:
    """What the sharded checks need and this torch's FSDP2 lacks (empty: supported)."""
    try:
        from torch.distributed.fsdp import FSDPModule
        from torch.distributed.fsdp._fully_shard._fsdp_api import ReduceScatter  # noqa: F401
    except ImportError as exc:
        return [f"torch.distributed.fsdp ({exc})"]
    gaps: list[str] = []
    for module in _fsdp_modules(model, FSDPModule):
        state = module._get_fsdp_state()
        gaps += [f"FSDPState.{a}" for a in _STATE if not hasattr(state, a)]
        if gaps:
            break
        gaps += [f"FSDPStateContext.{a}" for a in _CONTEXT if not hasattr(state._state_ctx, a)]
        for group in state._fsdp_param_groups:
            gaps += [f"FSDPParamGroup.{a}" for a in _GROUP if not hasattr(group, a)]
            for param in getattr(group, "fsdp_params", []):
                gaps += [f"FSDPParam.{a}" for a in _PARAM if not hasattr(param, a)]
    return sorted(set(gaps))


SINGLE_SHARD_ORDER = ("reduce_scatter_comm.allocate(", "foreach_reduce_scatter_copy_in(", "reduce_scatter_comm.allocate(",
                      "if world_size > 1:", "reduce_scatter_comm(", "else:", "reduce_output.copy_(reduce_scatter_input",
                      "dist.all_reduce(", "all_reduce_hook(reduce_output)")
"""What ``foreach_reduce`` must do, in this order, for the one-rank recording to be right: the input
allocated, filled, the output allocated (sdcguard records the input here), the reduce-scatter
only for a group of more than one rank, else the copy, then the all-reduce, then the hook."""
_DIVIDE_ARGS = ("reduce_scatter_group", "all_reduce_group", "reduce_dtype", "device_type", "factor",
                "force_sum_reduction_for_comms")


def single_shard_gaps() -> list[str]:
    """What a one-rank shard group's recording needs of this torch's ``foreach_reduce`` and lacks."""
    try:
        from torch.distributed.fsdp._fully_shard import _fsdp_collectives as collectives
        source = inspect.getsource(collectives.foreach_reduce)
    except (ImportError, AttributeError, OSError, TypeError) as exc:
        return [f"foreach_reduce's source ({exc})"]
    gaps = []
    divide = getattr(collectives, "_get_gradient_divide_factors", None)
    if divide is None or not set(_DIVIDE_ARGS) <= set(inspect.signature(divide).parameters):
        gaps.append(f"_get_gradient_divide_factors({', '.join(_DIVIDE_ARGS)})")
    return gaps + order_gaps(source)


def order_gaps(source: str) -> list[str]:
    """Pure: how ``foreach_reduce``'s source departs from :data:`SINGLE_SHARD_ORDER`."""
    at = 0
    for part in SINGLE_SHARD_ORDER:
        found = source.find(part, at)
        if found < 0:
            return [f"foreach_reduce's order for a one-rank shard group (no {part!r} after {source[:at][-40:]!r})"]
        at = found + len(part)
    if source.count("reduce_scatter_comm.allocate(") != 2:
        return ["foreach_reduce's two reduce_scatter_comm.allocate calls (input, then output)"]
    return []


def require_supported(model: torch.nn.Module, *, single_shard: bool = False) -> None:
    """Refuse the model (TypeError) when this torch lacks what the sharded checks read; with
    ``single_shard`` (a mesh of one rank per shard group) also :func:`single_shard_gaps`."""
    gaps = missing(model) + (single_shard_gaps() if single_shard else [])
    if gaps:
        raise TypeError(f"sdcguard: the sharded checks need FSDP2 internals that torch {torch.__version__} "
                        f"does not have ({', '.join(gaps)}); they are built and tested on torch 2.13")


def _fsdp_modules(model: torch.nn.Module, kind: type) -> Iterator[torch.nn.Module]:
    return (m for m in model.modules() if isinstance(m, kind))
