"""Checks 1a and 1b: a NaN or Inf gradient, found before the optimizer applies it.

One all-gather of two float64 scalars per rank and step — ``[local, reduced]`` squared gradient
norms — is all it costs, whatever the model size. Every rank then reaches the same verdict.
"""
from __future__ import annotations

import math

import torch
import torch.distributed as dist

from .alarm import CHECK_NONFINITE_LOCAL, CHECK_NONFINITE_REDUCED
from .exchange import gather_tensor
from .verdict import Verdict


def gather_norms(norms: torch.Tensor, group: dist.ProcessGroup | None = None) -> list[list[float]]:
    """All ranks' ``[local, reduced, ...]`` rows, indexed by rank (a caller may append values
    that every rank must learn at this point, such as the audit's payload sizes)."""
    return gather_tensor(norms, group, "norms").tolist()


def nonfinite_local_ranks(norms: list[list[float]]) -> list[int]:
    return [r for r, row in enumerate(norms) if not math.isfinite(row[0])]


def judge_nonfinite(norms: list[list[float]]) -> Verdict | None:
    """Check 1a first (it can name ranks), then 1b (a fault inside the all-reduce names none)."""
    local_bad = nonfinite_local_ranks(norms)
    if local_bad:
        return Verdict(
            CHECK_NONFINITE_LOCAL,
            suspects=local_bad,
            evidence={"local_grad_sq_norms": {r: norms[r][0] for r in local_bad}},
        )
    reduced_bad = [r for r, row in enumerate(norms) if not math.isfinite(row[1])]
    if reduced_bad:
        return Verdict(
            CHECK_NONFINITE_REDUCED,
            evidence={
                "reduced_grad_sq_norm": norms[reduced_bad[0]][1],
                "ranks_seeing_it": reduced_bad,
            },
        )
    return None
