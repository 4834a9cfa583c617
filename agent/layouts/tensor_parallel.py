"""Tensor parallelism (``parallelize_module``: Colwise, Rowwise, SequenceParallel) under FSDP2 or
HSDP over the data-parallel dimensions — torchtitan's 2-D and 3-D meshes.

Rank ``(i, j, k)`` holds TP shard ``k`` of FSDP shard ``j`` of replica ``i``; the ranks ``(i, j, *)``
form a tensor-parallel group, which computes one batch together (its activations are all-reduced
or all-gathered inside the forward and the backward). What the checks need follows from that:

- Each TP rank has an FSDP mesh of its own (``columns[k]``, the ranks with TP index ``k``), and its
  reduce-scatters and all-reduces run there on its TP shard's gradients: checks 1 and 4 read them
  exactly as for FSDP2 (``sharding/``), every TP rank's reductions summed in the one vote.
- Check 3 compares every (TP shard, FSDP shard) position across its replicas.
- Check 2: the whole mesh replays together, each rank its ring target's batch. The ring (same local
  index, next node) must map every TP group onto another position for position, so that a group
  replays one group's batch with each rank in its own TP place: checked at start-up. Each rank then
  compares its TP shard's local gradients with its counterpart's. A fault in one rank's forward
  reaches its whole group through the activation all-reduce, so the group is named (one node when
  TP stays inside a node, as the start-up plan checks and says); a fault in one rank's own gradient
  (after the backward's collectives) differs on that rank alone and names it.
- Forward seeds (dropout) are the group's: every rank of a TP group drops the same activations.
"""
from __future__ import annotations

import dataclasses
from typing import Any

from ..checks.topology import Topology
from ..sharding.layout import ShardLayout
from .fsdp import Sharded


class TensorParallel(Sharded):
    """The :class:`~sdcguard.layouts.base.Layout` of an FSDP2/HSDP model with a tensor-parallel dimension."""

    def ring(self, mesh: ShardLayout, topology: Topology) -> Topology:
        return tp_ring(mesh, topology)

    def check_mesh(self, mesh: ShardLayout, topology: Topology) -> None:
        refusal = ring_refusal(mesh, topology)
        if refusal is not None:
            raise TypeError(f"sdcguard: {refusal}")

    def seed_rank(self, rank: int) -> int:
        # on every forward: looked up once per rank, not searched in the mesh each time
        seeds = self.__dict__.setdefault("_seed_ranks", {})
        if rank not in seeds:
            seeds[rank] = self.mesh.tp_group(rank)[0]
        return seeds[rank]

    def plan_lines(self) -> list[str]:
        return super().plan_lines() + tp_plan(self.mesh, self.topology)

    def where(self, rank: int) -> dict[str, Any]:
        group = self.mesh.tp_group(rank)
        nodes = sorted({self.topology.identities[r].get("node") or f"node {r // self.topology.ranks_per_node}"
                        for r in group})
        return {**super().where(rank), "tp_group": group, "tp_group_nodes": nodes}


def tp_ring(mesh: ShardLayout, topology: Topology) -> Topology:
    """Pure: on one node the default ring reaches the next GPU, which shares its rank's TP group;
    there a rank replays the batch of the same TP rank of the next group (``r + tp``) instead.
    Across nodes the default ring (same local index, next node) stands."""
    if topology.nodes >= 2 or mesh.tp < 2 or topology.world_size <= mesh.tp:
        return topology
    world = topology.world_size
    return dataclasses.replace(topology, ring=tuple((r + mesh.tp) % world for r in range(world)))


def ring_refusal(mesh: ShardLayout, topology: Topology) -> str | None:
    """Pure: why the replay ring cannot audit this mesh, or None. Rank ``r`` replays the batch of
    ``topology.replay_target(r)`` (the same local index on the next node; on one node, see
    :func:`tp_ring`); a TP group computes one batch together, so the ring must carry each TP group
    onto another, rank ``k`` onto rank ``k``."""
    world = topology.world_size
    if world != mesh.world_size:
        return f"the mesh holds {mesh.world_size} ranks, the job {world}"
    for rank in range(world):
        group = mesh.tp_group(rank)
        target = [topology.replay_target(r) for r in group]
        offset = (target[0] - group[0]) % world
        if mesh.tp_group(target[0]) != target or target == group:
            return (f"the replay ring (rank r replays rank r + {offset}'s batch) does not carry tensor-parallel "
                    f"group {group} onto another group rank for rank: lay each TP group out on consecutive ranks "
                    "(TP the fastest mesh dimension, as torchtitan does) and within a node (ranks_per_node a "
                    f"multiple of {mesh.tp})")
    return None


def tp_plan(mesh: ShardLayout, topology: Topology) -> list[str]:
    """Pure: what the start-up plan says of tensor parallelism: where the groups are, and what a
    fault in one rank's forward is named as."""
    per_node = topology.ranks_per_node
    spans = any(len({r // per_node for r in mesh.tp_group(rank)}) > 1 for rank in range(mesh.world_size))
    where = ("each tensor-parallel group spans nodes: a fault in a rank's forward names its group on "
             "several nodes" if spans else
             f"each tensor-parallel group ({mesh.tp} ranks) lies within one node: a fault in a rank's forward "
             "reaches its whole group through the activation collectives, and the group (one node) is named; "
             "a fault in one rank's own gradient names that rank")
    return [where, "forward seeds are the tensor-parallel group's: its ranks drop the same activations"]
