"""Checks 1 and 4 for a sharded model: one step's reductions as one ``[x, y]`` vote, and its
judgement (docs/design.md §3, "Sharded models"). A reduction that sums instead (torchtitan's
``gradient_divide_factor`` of 1.0) is compared as the mean it is ``S`` (``R``) times.

The vote is ``reduce_checksum.vote`` applied to each reduction FSDP2 ran:
  - a reduce-scatter within a shard group of ``S`` ranks: rank ``j``'s output should be the mean of
    every member's row ``j``, so this rank's local rows are the operands (checksums with row ``j``'s
    weights) and its own output the reduced value (the same weights as its row ``j``): summed over
    the group, X is ``sum_j (mean_r c_rj - C_j)``, within the same rounding bound as DDP's mean;
  - HSDP's all-reduce across ``R`` replicas: the reduce-scatter output is the operand, the
    all-reduced shard the result — exactly DDP's case, per shard.
Summed over every rank, X and Y add up the groups' differences and bounds, so one all-reduce of
two float64s serves the whole mesh, as for DDP; X and Y are finite exactly when every local and
reduced gradient is (check 1). A reduction that is not FSDP2's plain average (a divide factor,
fp16's pre/post-division, a deferred all-reduce) contributes ``0 * vote``: nothing, or NaN when
its gradient is not finite.

Only when the sum is not finite, or X exceeds the bound, are the per-rank rows gathered: to name
the ranks whose own gradient is not finite (before any reduction touched it), or the shard group /
replica group whose reduction is off (the reduction is shared: no single rank can be named).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from ..checks.reduce_checksum import Coefficients, Shape, rounding_bound, vote
from .layout import ShardLayout
from .reduce_record import Reduction

ROW = 7
"""Per-rank row gathered after a non-finite or off vote: ``[local squared norm, reduced checksums,
first non-finite loss's micro-batch or -1, x_rs, y_rs, x_ar, y_ar]``."""


@dataclass(frozen=True, slots=True)
class StepVote:
    """This rank's share of one step's checks 1 and 4."""

    vote: torch.Tensor
    """``[x, y]``: summed over all ranks, check 4's difference and bound (non-finite: check 1)."""
    row: torch.Tensor
    """What is gathered when the sum says something is wrong (``ROW``)."""
    shape: Shape | None
    """What the bound needs; None when no reduction of the step is checkable."""
    rs_elements: int
    ar_elements: int
    """Checked elements per rank of each kind (for the per-group bounds)."""


class VoteCoefficients:
    """Each unit's cached check 4 coefficients, one set per kind of reduction."""

    __slots__ = ("cache",)

    def __init__(self) -> None:
        self.cache: dict[tuple[int, str], Coefficients] = {}

    def get(self, unit: int, kind: str) -> Coefficients:
        return self.cache.setdefault((unit, kind), Coefficients())


def step_vote(records: list[Reduction], layout: ShardLayout, losses: list[torch.Tensor],
              coefficients: VoteCoefficients | None = None) -> StepVote:
    """This rank's vote and row from its reductions of one step (no collectives)."""
    coefficients = coefficients or VoteCoefficients()
    S, R = layout.shards, layout.replicas
    device = records[0].chunks.device if records else torch.device("cpu")
    rs = torch.zeros(2, dtype=torch.float64, device=device)
    ar = torch.zeros(2, dtype=torch.float64, device=device)
    local_sq = torch.zeros((), dtype=torch.float64, device=device)
    reduced = torch.zeros((), dtype=torch.float64, device=device)
    rs_elements = ar_elements = 0
    dtypes: set[torch.dtype] = set()
    buckets = 0
    for rec in records:
        if rec.shard is None:
            raise RuntimeError("sdcguard: a reduce-scatter of the step has not completed")
        local_sq = local_sq + rec.chunks[:, 1].sum()
        reduced = reduced + rec.shard[0]
        # ``vote`` divides the reduced checksums by the group size, as every DDP rank holds the
        # same one; here each rank holds its own shard's, so it counts S times
        # a sum is compared as the mean it is S (R) times: a float64 division, far below the bound
        part = vote(list(rec.chunks), [rec.shard[0] / S if rec.sums else rec.shard[0]] * S,
                    [(rec.elements, rec.dtype)] * S, S, coefficients.get(rec.unit, "rs"))
        if rec.rs_checked:
            rs = rs + part
            rs_elements += rec.elements
            dtypes.add(rec.dtype)
            buckets += S
        else:
            rs = rs + 0 * part  # finite: nothing; NaN/Inf: check 1 still sees it
        if rec.replicated is not None:
            reduced = reduced + rec.replicated
            part = vote([rec.shard], [rec.replicated / R if rec.sums else rec.replicated], [(rec.elements, rec.dtype)],
                        R, coefficients.get(rec.unit, "ar"))
            if rec.ar_checked:
                ar = ar + part
                ar_elements += rec.elements
                dtypes.add(rec.dtype)
                buckets += 1
            else:
                ar = ar + 0 * part
    row = torch.stack([local_sq, reduced, first_nonfinite(losses, device), rs[0], rs[1], ar[0], ar[1]])
    checked = rs_elements or ar_elements
    shape = None if not checked else Shape(
        world=max(S, R if ar_elements else 1), buckets=buckets,
        # each reduce-scatter group reduces S rows, each all-reduce group one: over the whole mesh
        # (with tensor parallelism, every TP rank's FSDP mesh reduces its own TP shard alike)
        elements=(R * S * rs_elements + S * ar_elements) * layout.tp, dtypes=tuple(sorted(dtypes, key=str)))
    return StepVote(rs + ar, row, shape, rs_elements, ar_elements)


def first_nonfinite(losses: list[torch.Tensor], device: torch.device) -> torch.Tensor:
    """The index of the first micro-batch whose loss is not finite, or -1, as a float64 tensor
    computed on the device: no host read on the ordinary step (it is read only when gathered)."""
    if not losses:
        return torch.tensor(-1.0, dtype=torch.float64, device=device)
    bad = torch.stack([~torch.isfinite(loss.detach()).all() for loss in losses]).to(device)
    index = torch.arange(len(losses), dtype=torch.float64, device=device)
    first = torch.where(bad, index, torch.full_like(index, float(len(losses)))).min()
    return torch.where(first < len(losses), first, torch.full_like(first, -1.0))


def localize_checksum(rows: list[list[float]], layout: ShardLayout, rs_elements: int, ar_elements: int,
                      dtypes: tuple[torch.dtype, ...]) -> dict[str, Any]:
    """Pure: which shard groups' reduce-scatters and which replica groups' all-reduces are off,
    from every rank's row (indexed by global rank). Evidence for a ``reduce-checksum`` alarm: the
    reduction is shared, so a group is named, never a rank."""
    found: dict[str, Any] = {"reduce_scatter": [], "all_reduce": []}
    for k in range(layout.tp):
        where = {"tp": k} if layout.tp > 1 else {}
        for i in range(layout.replicas):
            ranks = layout.shard_group(i, k)
            x, y = sum(rows[r][3] for r in ranks), sum(rows[r][4] for r in ranks)
            bound = rounding_bound(y, Shape(layout.shards, 1, layout.shards * rs_elements, dtypes))
            if rs_elements and abs(x) > bound:
                found["reduce_scatter"].append({"replica": i, **where, "ranks": ranks, "difference": x, "bound": bound})
        for j in range(layout.shards if layout.hsdp else 0):
            ranks = layout.replicas_of_shard(j, k)
            x, y = sum(rows[r][5] for r in ranks), sum(rows[r][6] for r in ranks)
            bound = rounding_bound(y, Shape(layout.replicas, 1, ar_elements, dtypes))
            if ar_elements and abs(x) > bound:
                found["all_reduce"].append({"shard": j, **where, "ranks": ranks, "difference": x, "bound": bound})
    return found

