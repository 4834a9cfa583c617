"""Bit-reproducible local computation, switched on only where a replay needs it.

Deterministic kernels cost speed, so they are enabled for an audited step's original pass and its
replays, and restored to the user's setting afterwards. What cannot be switched per step — equal
CPU thread counts, cuBLAS workspace configuration — is checked once at start-up.

torch's deterministic mode also fills every new uninitialized tensor (``torch.empty`` and every
kernel output allocated that way) with NaN by default (``torch.utils.deterministic.
fill_uninitialized_memory``): a debugging aid that makes a kernel reading memory it never wrote
give the same wrong answer twice. It selects no kernel and changes no written bit, so it is off
inside the block: on TinyGPT it was ~3% of every forward + backward of an audit step, the
original's and the replay's (bench/phases.py). A kernel that read uninitialized memory would make
the two passes differ — an alarm, never a missed fault — and would feed garbage to the user's own
steps as well, where the filling is off.
"""
from __future__ import annotations

import contextlib
import os
from typing import Iterator

import torch
import torch.utils.deterministic as _fill

from ..errors import ConfigurationError
from .topology import Topology

_CUBLAS_OK = (":4096:8", ":16:8")


def check_replayable(topology: Topology, device: torch.device) -> None:
    """Raise ConfigurationError, saying what to set, when replays could not be bit-exact."""
    counts = set(topology.threads.values())
    if len(counts) > 1:
        raise ConfigurationError(
            f"ranks run different torch thread counts {sorted(counts)}; replay (check 2) needs the "
            "same count on every rank: call torch.set_num_threads(n) (and set OMP_NUM_THREADS=n) "
            "identically everywhere, or set SDCGUARD_AUDIT_EVERY=0"
        )
    if device.type == "cuda" and os.environ.get("CUBLAS_WORKSPACE_CONFIG") not in _CUBLAS_OK:
        raise ConfigurationError(
            "replay (check 2) on CUDA needs deterministic cuBLAS: set CUBLAS_WORKSPACE_CONFIG=:4096:8 "
            "in the training container's environment before the process starts"
        )


@contextlib.contextmanager
def deterministic(enabled: bool) -> Iterator[None]:
    """Use deterministic algorithms inside the block when ``enabled``; restore the user's setting."""
    if not enabled:
        yield
        return
    was = torch.are_deterministic_algorithms_enabled()
    was_warn = torch.is_deterministic_algorithms_warn_only_enabled()
    cudnn = (torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark)
    fill = _fill.fill_uninitialized_memory
    torch.use_deterministic_algorithms(True)
    torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark = True, False
    _fill.fill_uninitialized_memory = False  # see the module docstring
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(was, warn_only=was_warn)
        torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark = cudnn
        _fill.fill_uninitialized_memory = fill
