"""The fault injector: synthetic silent data corruption in *your* job, to see which check catches it.

``spec`` is the grammar of a fault (standard library only, so the drill checks it before any
process starts); ``injector`` puts each kind where failing hardware would put it, in a model and
optimizer you name the targets of; ``judge`` says, from the run's schedule and the alarms it
raised, which check caught each fault (standard library only).
"""
from .judge import (AMBIGUOUS, CAUGHT, ESCAPED, MISATTRIBUTED, MISSED, NOT_REACHED, PASSING, RESUME_UNSAFE,
                    Judgement, Schedule, expectation, judge_faults)
from .spec import KINDS, FaultKind, FaultSpec, FaultSpecError, FaultTargetError, parse_fault

__all__ = [
    "FaultInjector", "ReduceFaults", "corrupt_reduced",
    "FaultSpec", "FaultKind", "KINDS", "parse_fault", "FaultSpecError", "FaultTargetError",
    "Schedule", "Judgement", "judge_faults", "expectation",
    "CAUGHT", "AMBIGUOUS", "ESCAPED", "NOT_REACHED", "MISSED", "MISATTRIBUTED", "RESUME_UNSAFE", "PASSING",
]

_TORCH = {"FaultInjector", "ReduceFaults", "corrupt_reduced"}


def __getattr__(name: str):  # the injector needs torch; the grammar and the judging do not
    if name in _TORCH:
        from . import injector
        return getattr(injector, name)
    raise AttributeError(f"module 'sdcguard.faults' has no attribute {name!r}")
