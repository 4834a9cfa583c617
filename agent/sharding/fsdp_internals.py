"""The parts of FSDP2 the sharded checks rely on that are not its public API, checked once.

The recording reduce-scatter (``reduce_record``) and the isolated replay (``replay``) read and
set a few attributes of FSDP2's param groups and parameters (as of torch 2.13). A torch release
that renames one would otherwise fail in the middle of a step, or — worse — let a replay touch
the real step's gradients; so the Guard asks here first and refuses the model with one clear
line naming what is missing.
"""
from __future__ import annotations

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


def require_supported(model: torch.nn.Module) -> None:
    gaps = missing(model)
    if gaps:
        raise TypeError(f"sdcguard: the sharded checks need FSDP2 internals that torch {torch.__version__} "
                        f"does not have ({', '.join(gaps)}); they are built and tested on torch 2.13")


def _fsdp_modules(model: torch.nn.Module, kind: type) -> Iterator[torch.nn.Module]:
    return (m for m in model.modules() if isinstance(m, kind))
