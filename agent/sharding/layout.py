"""Where each rank of an FSDP2 model sits, and which checks its mesh allows.

FSDP2 shards every parameter along the mesh's shard dimension (``S`` ranks, one shard each) and,
for HSDP, replicates each shard along the replicate dimension (``R`` replicas). Rank ``(i, j)``
holds shard ``j`` of replica ``i``; the ranks of one column ``j`` hold identical shards (check 3
compares them), the ranks of one row ``i`` reduce-scatter together, and those of one column
all-reduce the reduce-scatter's output across replicas. torchtitan builds the same mesh
(``init_device_mesh(..., (dp_replicate, dp_shard), mesh_dim_names=("dp_replicate", "dp_shard"))``)
and calls ``fully_shard(block, mesh=...)`` per block, then on the root.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Iterator

import torch
import torch.distributed as dist

from ..contract.alarm import CHECK_NONFINITE_LOCAL, CHECK_REDUCE_CHECKSUM, CHECK_REPLAY, CHECK_WEIGHTS


@dataclass(frozen=True, slots=True)
class ShardLayout:
    """The mesh as every rank sees it: ``grid[i][j]`` is the global rank of replica i, shard j."""

    grid: tuple[tuple[int, ...], ...]
    rank: int

    @property
    def replicas(self) -> int:
        return len(self.grid)

    @property
    def shards(self) -> int:
        return len(self.grid[0])

    @property
    def world_size(self) -> int:
        return self.replicas * self.shards

    @property
    def hsdp(self) -> bool:
        return self.replicas > 1

    def coordinates(self, rank: int) -> dict[str, int]:
        """``{"replica": i, "shard": j}`` of a global rank."""
        for i, row in enumerate(self.grid):
            if rank in row:
                return {"replica": i, "shard": row.index(rank)}
        raise ValueError(f"rank {rank} is not in the mesh {self.grid}")

    def replicas_of_shard(self, shard: int) -> list[int]:
        """The global ranks holding ``shard``, by replica index."""
        return [row[shard] for row in self.grid]

    def shard_group(self, replica: int) -> list[int]:
        """The global ranks that reduce-scatter together (one replica), by shard index."""
        return list(self.grid[replica])

    def describe(self) -> str:
        if self.shards == 1:
            return f"HSDP {self.replicas} replicas x 1 shard (data parallel: every rank holds the whole model)"
        return (f"HSDP {self.replicas} replicas x {self.shards} shards" if self.hsdp
                else f"FSDP over {self.shards} ranks (one replica)")


def layout_of(mesh_ranks: list[list[int]] | list[int], rank: int) -> ShardLayout:
    """Pure: the layout from the mesh's rank grid (``DeviceMesh.mesh.tolist()``, rows = replicas;
    a 1-D mesh is one replica)."""
    rows = [mesh_ranks] if mesh_ranks and not isinstance(mesh_ranks[0], list) else mesh_ranks
    grid = tuple(tuple(int(r) for r in row) for row in rows)  # type: ignore[union-attr]
    if not grid or len({len(row) for row in grid}) != 1:
        raise ValueError(f"not a rectangular mesh: {mesh_ranks!r}")
    flat = [r for row in grid for r in row]
    if sorted(flat) != list(range(len(flat))):
        raise ValueError(f"the mesh {mesh_ranks!r} must hold every rank of the job exactly once")
    return ShardLayout(grid, rank)


@dataclass(frozen=True, slots=True)
class CheckPlan:
    """Which checks run for a mesh, and why the others do not (logged once at start-up)."""

    runs: dict[str, str]
    off: dict[str, str]

    def lines(self) -> list[str]:
        return ([f"runs {name}: {why}" for name, why in self.runs.items()]
                + [f"does not run {name}: {why}" for name, why in self.off.items()])


def plan_checks(layout: ShardLayout, *, reduce_scatter_checked: bool, all_reduce_checked: bool) -> CheckPlan:
    """Pure: what runs for this mesh (docs/design.md §3, "Sharded models"). With one rank per shard
    group FSDP2 copies the local gradient instead of reduce-scattering it: the all-reduce is the
    only reduction (check 4 covers the copy with it)."""
    first = "reduce-scatter" if layout.shards > 1 else "all-reduce"
    runs = {CHECK_NONFINITE_LOCAL: f"each rank's local gradient, before its {first}; a NaN/Inf is "
                                   "named by rank and confirmed by the mesh replaying its batch on another node",
            CHECK_REPLAY: "on audit steps every rank replays another node's batch with the whole mesh and compares "
                          f"its local gradient, per unit and micro-batch, with the owner's, before the {first}"}
    off: dict[str, str] = {}
    if layout.shards == 1:
        off[f"{CHECK_REDUCE_CHECKSUM} (reduce-scatter)"] = "one rank per shard group: FSDP2 copies the local " \
                                                           "gradient (no reduce-scatter); the all-reduce check covers the copy"
    elif reduce_scatter_checked:
        runs[f"{CHECK_REDUCE_CHECKSUM} (reduce-scatter)"] = f"the reduce-scatter of each shard group ({layout.shards} ranks)"
    else:
        off[f"{CHECK_REDUCE_CHECKSUM} (reduce-scatter)"] = "the reduction is not FSDP2's plain average or a plain sum (a " \
                                                           "divide factor other than 1, or fp16 pre/post-division)"
    if layout.hsdp:
        if all_reduce_checked:
            runs[f"{CHECK_REDUCE_CHECKSUM} (all-reduce)"] = f"HSDP's all-reduce across {layout.replicas} replicas"
        else:
            off[f"{CHECK_REDUCE_CHECKSUM} (all-reduce)"] = "the all-reduce is not FSDP2's plain average, or a user " \
                                                           "all-reduce hook is set"
        runs[CHECK_WEIGHTS] = (f"every shard's fingerprint across its {layout.replicas} replicas"
                               + ("" if layout.replicas >= 3 else "; with 2 replicas a difference is ambiguous "
                                  "(no strict majority): both replicas are named"))
    else:
        off[CHECK_WEIGHTS] = ("one replica: no shard has a copy to compare with; nothing covers a corrupted "
                              "weight shard (every rank all-gathers the same corrupted shard, so check 2's "
                              "replays agree with it)")
    return CheckPlan(runs, off)


# -- reading the FSDP2 module tree ------------------------------------------------------------

def param_groups(model: torch.nn.Module) -> Iterator[tuple[str, Any, Any]]:
    """``(module path, FSDP module, its FSDPParamGroup)`` of every ``fully_shard`` call that holds
    parameters, in module order (the same on every rank). A call on a list of modules (torchtitan's
    ``fully_shard([model.norm, model.lm_head])``) makes each of them an FSDP module sharing one
    state: its group counts once, under the first module's path."""
    from torch.distributed.fsdp import FSDPModule

    seen: set[int] = set()
    for path, module in model.named_modules():
        if isinstance(module, FSDPModule):
            for group in module._get_fsdp_state()._fsdp_param_groups:
                if id(group) not in seen:
                    seen.add(id(group))
                    yield path, module, group


def read_layout(model: torch.nn.Module) -> ShardLayout:
    """The layout of an FSDP2 model; every ``fully_shard`` must use the same mesh (one mesh, 1-D or
    ``(replicate, shard)``), else TypeError naming the module that differs."""
    seen: tuple[list[Any], str] | None = None
    for path, _, group in param_groups(model):
        info = group.mesh_info
        mesh = info.mesh
        if info.shard_mesh_dim is None or mesh.ndim > 2 or (mesh.ndim == 2 and info.replicate_mesh_dim is None):
            raise TypeError(f"sdcguard: fully_shard({path or 'root'}) uses a mesh sdcguard does not support yet: "
                            "one shard dimension, optionally one replicate dimension (HSDP)")
        ranks = mesh.mesh.tolist()
        if mesh.ndim == 2 and info.replicate_mesh_dim != 0:
            ranks = [list(col) for col in zip(*ranks)]
        if seen is not None and seen[0] != ranks:
            raise TypeError(f"sdcguard: fully_shard({path or 'root'}) uses another mesh than {seen[1] or 'root'}; "
                            "sdcguard needs one data-parallel mesh for the whole model")
        seen = (ranks, path)
    if seen is None:
        raise TypeError("sdcguard: the FSDP2 model holds no sharded parameters")
    layout = layout_of(seen[0], dist.get_rank())
    if layout.world_size < 2:
        raise TypeError("sdcguard: an FSDP2 mesh of one rank has no other rank to check it against")
    return layout


def plain_average(groups: list[Any]) -> bool:
    """Every FSDP2 param group reduces with FSDP2's plain average, or a plain sum (a divide factor of
    1.0, torchtitan's, or forced sum comms: ``reduce_record.plain_sum``), in float32 or bfloat16
    (FSDP2 pre- and post-divides a float16 one around a sum, which check 4 does not model). Read
    from the groups' policies: it holds before the first forward, when FSDP2 has not yet set its
    parameters' dtypes."""
    return all(g.gradient_divide_factor in (None, 1.0)
               and all(_reduce_dtype(g.mp_policy, p) in (torch.float32, torch.bfloat16) for p in g.fsdp_params)
               for g in groups)


def _reduce_dtype(policy: Any, param: Any) -> torch.dtype:
    """The dtype a parameter's gradient is reduced in: the policy's, else the gradient's own."""
    return policy.reduce_dtype or policy.param_dtype or param.sharded_param.dtype
