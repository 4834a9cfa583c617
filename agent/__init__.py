"""sdcguard: silent-data-corruption detection inside PyTorch data-parallel training.

The checks need torch; the alarm schema and the spool do not, so ``import sdcguard`` stays light
and the torch-dependent names load on first use.
"""
from __future__ import annotations

from typing import Any

from .contract.alarm import SCHEMA, AlarmError
from .config import Config

__version__ = "0.1.0"
__all__ = [
    "Guard", "Step", "Config", "SDCDetected", "NonFiniteGradient", "UncheckedUpdate", "ReplayError",
    "ConfigurationError", "fingerprint", "fingerprint_many", "forward_seed", "replaying",
    "load_checkpoint", "verify_checkpoint", "CheckpointError", "FaultInjector", "judge_faults",
    "settle_buckets", "SCHEMA", "AlarmError", "__version__",
]

_LAZY = {
    "Guard": "guard", "Step": "step", "SDCDetected": "errors", "ReplayError": "errors",
    "ConfigurationError": "errors", "NonFiniteGradient": "errors", "UncheckedUpdate": "errors",
    "fingerprint": "fingerprint", "fingerprint_many": "fingerprint", "forward_seed": "checks.rng",
    "replaying": "checks.replay",
    "load_checkpoint": "checkpoint", "verify_checkpoint": "checkpoint", "CheckpointError": "checkpoint",
    "FaultInjector": "faults.injector", "judge_faults": "faults.judge", "settle_buckets": "buckets",
}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        import importlib
        return getattr(importlib.import_module(f".{_LAZY[name]}", __name__), name)
    raise AttributeError(f"module 'sdcguard' has no attribute {name!r}")
