"""Who is where: ranks, nodes, the replay ring, and which rank reports an alarm."""
from __future__ import annotations

import uuid
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from ..config import Config
from .exchange import gather_objects


@dataclass(frozen=True, slots=True)
class Topology:
    """The data-parallel group as every rank sees it (identical on all ranks)."""

    rank: int
    world_size: int
    ranks_per_node: int
    identities: dict[int, dict[str, Any]]
    """rank -> ``{rank, pod, node}`` as each rank read it from its own environment."""
    run_id: str
    """Chosen by rank 0 at start-up; makes alarm ids unique per run and equal on every rank."""
    threads: dict[int, int]
    """rank -> torch intra-op thread count (replay is bit-exact on CPU only when they agree)."""

    @property
    def nodes(self) -> int:
        return self.world_size // self.ranks_per_node

    @property
    def ring_offset(self) -> int:
        """How far the replay ring reaches: the next node; on a single node, the next GPU."""
        return self.ranks_per_node if self.nodes >= 2 else 1

    @property
    def units(self) -> int:
        """Independent failure units the ring spans (nodes, or GPUs of a single node)."""
        return self.nodes if self.nodes >= 2 else self.world_size

    def replay_target(self, rank: int) -> int:
        """The rank whose batch ``rank`` replays: same local index, next node (docs/design.md §3)."""
        return (rank + self.ring_offset) % self.world_size

    def replayer_of(self, rank: int) -> int:
        """The rank that replays ``rank``'s batch."""
        return (rank - self.ring_offset) % self.world_size

    def reporter(self, suspects: list[int]) -> int:
        """The rank that writes the alarm: the lowest one not under suspicion."""
        healthy = [r for r in range(self.world_size) if r not in suspects]
        return healthy[0] if healthy else 0


def identity(rank: int, pod: str | None, node: str | None, pod_uid: str | None) -> dict[str, Any]:
    """What an alarm says of a rank: ``{rank, pod, node}``, and the pod's uid where it is known."""
    who: dict[str, Any] = {"rank": rank, "pod": pod, "node": node}
    if pod_uid:
        who["pod_uid"] = pod_uid
    return who


def gather_topology(config: Config, group: dist.ProcessGroup | None = None,
                    device: torch.device | None = None) -> Topology:
    """One collective at start-up: every rank's identity, and rank 0's run id."""
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    per_node = config.ranks_per_node or world
    if world % per_node:
        raise ValueError(
            f"world size {world} is not a multiple of ranks_per_node {per_node} "
            "(set SDCGUARD_RANKS_PER_NODE or LOCAL_WORLD_SIZE)"
        )
    mine = {"rank": rank, "pod": config.pod, "node": config.node, "pod_uid": config.pod_uid,
            "run_id": uuid.uuid4().hex[:12], "threads": torch.get_num_threads()}
    everyone: list[Any] = gather_objects(mine, group, device)
    identities = {e["rank"]: identity(e["rank"], e["pod"], e["node"], e["pod_uid"]) for e in everyone}
    threads = {e["rank"]: e["threads"] for e in everyone}
    return Topology(rank, world, per_node, identities, run_id=everyone[0]["run_id"], threads=threads)
