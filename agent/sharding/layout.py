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
    """The mesh as every rank sees it: ``grid[i][j]`` is the global rank of replica i, shard j of
    this rank's FSDP mesh. With tensor parallelism each tensor-parallel rank ``k`` has an FSDP mesh
    of its own (``columns[k]``, this rank's is ``grid``): rank ``(i, j, k)`` holds TP shard ``k`` of
    FSDP shard ``j`` of replica ``i``, and the ranks ``(i, j, *)`` form one tensor-parallel group."""

    grid: tuple[tuple[int, ...], ...]
    rank: int
    columns: tuple[tuple[tuple[int, ...], ...], ...] = ()
    """Every tensor-parallel rank's FSDP grid, by TP index; empty without tensor parallelism."""

    @property
    def replicas(self) -> int:
        return len(self.grid)

    @property
    def shards(self) -> int:
        return len(self.grid[0])

    @property
    def tp(self) -> int:
        """Ranks per tensor-parallel group (1: none)."""
        return len(self.columns) or 1

    @property
    def world_size(self) -> int:
        return self.replicas * self.shards * self.tp

    @property
    def hsdp(self) -> bool:
        return self.replicas > 1

    def grids(self) -> tuple[tuple[tuple[int, ...], ...], ...]:
        """Every FSDP grid of the world, by TP index (one without tensor parallelism)."""
        return self.columns or (self.grid,)

    def coordinates(self, rank: int) -> dict[str, int]:
        """``{"replica": i, "shard": j}`` of a global rank (and ``"tp": k`` with tensor parallelism)."""
        for k, grid in enumerate(self.grids()):
            for i, row in enumerate(grid):
                if rank in row:
                    where = {"replica": i, "shard": row.index(rank)}
                    if self.columns:
                        where["tp"] = k
                    return where
        raise ValueError(f"rank {rank} is not in the mesh {self.grids()}")

    def replicas_of_shard(self, shard: int, tp: int | None = None) -> list[int]:
        """The global ranks holding ``shard`` (of TP rank ``tp``; default: this rank's), by replica."""
        grid = self.grid if tp is None else self.grids()[tp]
        return [row[shard] for row in grid]

    def shard_group(self, replica: int, tp: int | None = None) -> list[int]:
        """The global ranks that reduce-scatter together (one replica of TP rank ``tp``), by shard."""
        grid = self.grid if tp is None else self.grids()[tp]
        return list(grid[replica])

    def tp_group(self, rank: int) -> list[int]:
        """The tensor-parallel group of ``rank``, by TP index (``[rank]`` without tensor parallelism)."""
        where = self.coordinates(rank)
        return [grid[where["replica"]][where["shard"]] for grid in self.grids()]

    def positions(self) -> list[tuple[int, int]]:
        """``(tp, shard)`` of every distinct weight shard; each is held by ``replicas`` ranks."""
        return [(k, j) for k in range(self.tp) for j in range(self.shards)]

    def describe(self) -> str:
        if self.shards == 1:
            text = f"HSDP {self.replicas} replicas x 1 shard (data parallel: every rank holds the whole model)"
        else:
            text = (f"HSDP {self.replicas} replicas x {self.shards} shards" if self.hsdp
                    else f"FSDP over {self.shards} ranks (one replica)")
        return text if not self.columns else f"{text}, each x tensor parallel over {self.tp} ranks"


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


def mesh_ranks(model: torch.nn.Module) -> tuple[list[Any], str]:
    """``(ranks, path)``: the global ranks of the one mesh every ``fully_shard`` of ``model`` uses
    (``DeviceMesh.mesh.tolist()``, rows = replicas for HSDP; a flat list for a 1-D mesh) and the
    first unit's path; TypeError naming the module whose mesh is not supported or differs."""
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
    return seen


def read_layout(model: torch.nn.Module) -> ShardLayout:
    """The layout of an FSDP2 model; every ``fully_shard`` must use the same mesh (one mesh, 1-D or
    ``(replicate, shard)``), else TypeError naming the module that differs."""
    seen = mesh_ranks(model)
    rank = dist.get_rank()
    columns = tensor_parallel_columns(model)
    if columns is None:
        held = sum(len(row) for row in seen[0]) if seen[0] and isinstance(seen[0][0], list) else len(seen[0])
        if held != dist.get_world_size():
            raise TypeError(f"sdcguard: FSDP2's mesh holds {held} of the job's {dist.get_world_size()} ranks and the "
                            "parameters carry no tensor-parallel dimension: for a pipeline stage, build the Guard on "
                            "the pipeline schedule (Guard(schedule, optimizer)); context or expert parallelism is not "
                            "checked (sdcguard checks FSDP2/HSDP, with tensor parallelism in the parameters' mesh)")
        layout = layout_of(seen[0], rank)
    else:
        layout = columns_layout(columns, rank)
        rows = seen[0] if seen[0] and isinstance(seen[0][0], list) else [seen[0]]  # a 1-D FSDP mesh: one replica
        if [list(row) for row in layout.grid] != rows:
            raise TypeError(f"sdcguard: the tensor-parallel mesh {columns!r} does not hold FSDP2's mesh {seen[0]!r} "
                            "as this rank's column")
    if layout.world_size < 2:
        raise TypeError("sdcguard: an FSDP2 mesh of one rank has no other rank to check it against")
    return layout


def tensor_parallel_columns(model: torch.nn.Module) -> list[list[list[int]]] | None:
    """With tensor parallelism (``parallelize_module`` before ``fully_shard``), the FSDP grid of every
    TP rank, read from a parameter whose DTensor mesh has one dimension more than FSDP2's
    (``("dp_replicate", "dp_shard", "tp")``, torchtitan's names or any others): ``columns[k][i][j]``
    is the rank of replica i, shard j, TP rank k. None without tensor parallelism; TypeError for a
    mesh with more than one dimension beyond FSDP2's (pipeline or context parallelism in it)."""
    found: list[list[list[int]]] | None = None
    for path, _, group in param_groups(model):
        info = group.mesh_info
        fsdp_names = info.mesh.mesh_dim_names
        _refuse_unchecked_dims(f"fully_shard({path or 'root'})", info.mesh)
        for fsdp_param in group.fsdp_params:
            mesh = getattr(fsdp_param.sharded_param, "device_mesh", None)
            if mesh is None or mesh.ndim == info.mesh.ndim:
                continue
            names = mesh.mesh_dim_names
            _refuse_unchecked_dims(f"{path or 'root'}'s parameters", mesh)
            if names is None or fsdp_names is None:
                raise TypeError(f"sdcguard: fully_shard({path or 'root'}): name the device mesh's dimensions "
                                "(init_device_mesh(..., mesh_dim_names=...)) so the tensor-parallel one can be told apart")
            extra = [n for n in names if n not in fsdp_names]
            if len(extra) != 1:
                raise TypeError(f"sdcguard: {path or 'root'}'s parameters are spread over {names}: sdcguard checks "
                                "FSDP2 with one tensor-parallel dimension beside its own, not yet "
                                f"{', '.join(extra)} together")
            order = [names.index(n) for n in fsdp_names] + [names.index(extra[0])]
            grid = mesh.mesh.permute(*order)
            if grid.ndim == 2:  # pure FSDP: one replica
                grid = grid.unsqueeze(0)
            columns = [grid[:, :, k].tolist() for k in range(grid.shape[2])]
            if found is not None and found != columns:
                raise TypeError(f"sdcguard: {path or 'root'} uses another tensor-parallel mesh than the model's "
                                "other layers")
            found = columns
    return found


UNCHECKED_DIMS = {"cp": "context parallelism", "context_parallel": "context parallelism",
                  "ep": "expert parallelism", "expert_parallel": "expert parallelism"}
"""Mesh dimension names (torchtitan's, and spelled out) of parallelisms sdcguard does not check."""


def unchecked_dim(names: tuple[str, ...] | None, sizes: dict[str, int] | None = None) -> str | None:
    """Pure: why a device mesh with these dimension names is not checked, or None. A context-parallel
    group splits one batch's sequence and exchanges keys and values (ring attention); an
    expert-parallel group sends several data-parallel ranks' tokens to each other's experts
    (all-to-all). sdcguard would take their ranks for data-parallel shards with batches of their
    own, or for a tensor-parallel group; its replay ring and attribution model neither. A name
    counts alone or flattened into another (``dp_shard_cp``, older torchtitan's FSDP dimension).
    ``sizes``: the root mesh's dimension sizes, where known: a CP or EP dimension of size 1 (older
    torchtitan names its FSDP dimension ``dp_shard_cp`` even without context parallelism) is
    nothing to refuse; without sizes a name is refused."""
    sizes = sizes or {}
    for name in names or ():
        parts = [name] if name in UNCHECKED_DIMS else [p for p in name.split("_") if p in UNCHECKED_DIMS]
        parts = [p for p in parts if sizes.get(p, 2) > 1]  # a size not known: refused
        what = UNCHECKED_DIMS[parts[0]] if parts else None
        if what is not None:
            return (f"the device mesh dimension {name!r} ({what}) is not checked: its ranks compute together (ring "
                    "attention's key/value exchange, the experts' token all-to-all), which sdcguard's replay ring "
                    "and attribution do not model; checked are FSDP2/HSDP dimensions and one tensor-parallel one")
    return None


def _refuse_unchecked_dims(where: str, mesh: Any) -> None:
    why = unchecked_dim(mesh.mesh_dim_names, _root_sizes(mesh))
    if why is not None:
        raise TypeError(f"sdcguard: {where}: {why}")


def _root_sizes(mesh: Any) -> dict[str, int]:
    """Every named dimension's size in ``mesh`` and in the root mesh it was sliced or flattened from."""
    sizes: dict[str, int] = {}
    for m in (getattr(mesh, "_get_root_mesh", lambda: None)(), mesh):
        if m is not None and m.mesh_dim_names:
            sizes.update(zip(m.mesh_dim_names, m.mesh.shape))
    return sizes


def columns_layout(columns: list[list[list[int]]], rank: int) -> ShardLayout:
    """Pure: the layout from every TP rank's FSDP grid (``columns[k][i][j]``)."""
    grids = tuple(tuple(tuple(int(r) for r in row) for row in grid) for grid in columns)
    flat = sorted(r for grid in grids for row in grid for r in row)
    if flat != list(range(len(flat))) or len({(len(g), len(g[0])) for g in grids}) != 1:
        raise ValueError(f"the mesh {columns!r} must hold every rank of the job exactly once, in equal grids")
    mine = next(g for g in grids if any(rank in row for row in g))
    return ShardLayout(mine, rank, grids)


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
