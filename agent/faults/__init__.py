"""The fault injector: synthetic silent data corruption in *your* job, to see which check catches it.

``spec`` is the grammar of a fault (standard library only, so the drill checks it before any
process starts); ``injector`` puts each kind where failing hardware would put it.
"""
from .spec import KINDS, FaultKind, FaultSpec, FaultSpecError, parse_fault

__all__ = ["KINDS", "FaultKind", "FaultSpec", "FaultSpecError", "parse_fault", "FaultInjector"]


def __getattr__(name: str):  # the injector needs torch; the grammar does not
    if name == "FaultInjector":
        from .injector import FaultInjector
        return FaultInjector
    raise AttributeError(f"module 'sdcguard.faults' has no attribute {name!r}")
