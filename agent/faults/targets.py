"""Finding a fault's target in a user's model: a module path or a parameter name, and an element.

Names resolve through ``torch.compile`` (``_orig_mod``), activation checkpointing and DDP /
DataParallel (``module``) wrappers, given or left out; a name that does not exist is answered with
the closest existing names (:class:`FaultTargetError`).
"""
from __future__ import annotations

import difflib

import torch
from torch.nn.parallel import DataParallel, DistributedDataParallel

from .spec import FaultSpec, FaultTargetError

__all__ = ["resolve_module", "resolve_parameter", "module_names", "parameter_names", "checked_parameter", "check_element"]

_WRAPPED = ("_orig_mod", "_checkpoint_wrapped_module")
"""Children through which names resolve: torch.compile's and activation checkpointing's."""


def resolve_module(model: torch.nn.Module, path: str) -> tuple[str, torch.nn.Module]:
    """(canonical path, module) for ``path`` in ``model``, through compile/DDP wrappers."""
    module, used = _unwrap(model), []
    for part in path.split(".") if path else []:
        child = module._modules.get(part)
        if child is None and part in ("module", *_WRAPPED):
            continue  # a wrapper already looked through
        if child is None:
            raise FaultTargetError(f"no module {path!r} in {type(_unwrap(model)).__name__}"
                                   + _close(path, list(module_names(model))))
        used.append(part)
        module = _unwrap(child)
    return ".".join(used), module


def resolve_parameter(model: torch.nn.Module, name: str) -> tuple[str, torch.nn.Parameter]:
    """(canonical name, parameter) for ``name`` in ``model``, through compile/DDP wrappers."""
    path, _, leaf = name.rpartition(".")
    parameter = None
    try:
        owner_name, owner = resolve_module(model, path)
        parameter = owner._parameters.get(leaf)
    except FaultTargetError:
        pass
    if parameter is None:
        raise FaultTargetError(f"no parameter {name!r} in {type(_unwrap(model)).__name__}"
                               + _close(name, parameter_names(model)))
    return f"{owner_name}.{leaf}" if owner_name else leaf, parameter


def module_names(model: torch.nn.Module) -> dict[str, torch.nn.Module]:
    """Every module by its canonical path (wrappers looked through), root first."""
    names: dict[str, torch.nn.Module] = {}
    stack = [("", _unwrap(model))]
    while stack:
        prefix, module = stack.pop()
        names.setdefault(prefix, module)
        children = [(n, c) for n, c in module._modules.items() if c is not None]
        stack.extend((f"{prefix}.{n}" if prefix else n, _unwrap(c)) for n, c in reversed(children))
    return names


def parameter_names(model: torch.nn.Module) -> list[str]:
    return [f"{path}.{leaf}" if path else leaf
            for path, module in module_names(model).items()
            for leaf, p in module._parameters.items() if p is not None]


def _unwrap(module: torch.nn.Module) -> torch.nn.Module:
    while True:
        if isinstance(module, (DistributedDataParallel, DataParallel)):
            module = module.module
        elif any(name in module._modules for name in _WRAPPED):
            module = next(module._modules[name] for name in _WRAPPED if name in module._modules)
        else:
            return module


def _close(wanted: str, names: list[str]) -> str:
    close = difflib.get_close_matches(wanted, names, n=5, cutoff=0.5)
    if close:
        return "; closest: " + ", ".join(close)
    shown = [n for n in names if n][:8]
    return "; it has: " + ", ".join(shown) + (f", ... ({len(names)} in all)" if len(names) > len(shown) else "")


def checked_parameter(fault: FaultSpec, name: str, parameter: torch.nn.Parameter, element: int) -> torch.nn.Parameter:
    if not parameter.is_floating_point():
        raise FaultTargetError(f"{fault}: {name} is {parameter.dtype}, not a floating-point parameter")
    if not parameter.is_contiguous():
        raise FaultTargetError(f"{fault}: {name} is not contiguous: its flattened elements cannot be addressed")
    check_element(fault, f"{name} (shape {tuple(parameter.shape)})", parameter.numel(), element)
    if fault.kind == "weight-swap" and parameter.numel() < 2:
        raise FaultTargetError(f"{fault}: weight-swap needs two elements; {name} has one")
    return parameter


def check_element(fault: FaultSpec, what: str, numel: int, element: int) -> None:
    if not 0 <= element < numel:
        raise FaultTargetError(f"{fault}: element {element} is out of range for {what}, which has {numel} elements")
