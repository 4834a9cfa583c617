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
    ring: tuple[int, ...] | None = None
    """rank -> the rank whose batch it replays, where a layout's ring is not "same local index,
    next node" (a pipeline: the same stage of another replica); None: that default."""

    @property
    def nodes(self) -> int:
        return self.world_size // self.ranks_per_node

    @property
    def ring_offset(self) -> int:
        """How far the replay ring reaches: the next node; on a single node, the next GPU."""
        return self.ranks_per_node if self.nodes >= 2 else 1

    @property
    def units(self) -> int:
        """Independent failure units the ring spans (nodes, or GPUs of a single node; with a
        layout's own ring, the ranks one cycle of it visits: a ring of 2-cycles has 2 units, and
        a mismatch between them stays ambiguous)."""
        if self.ring is not None:
            seen, rank = {0}, self.ring[0]
            while rank not in seen:
                seen.add(rank)
                rank = self.ring[rank]
            return len(seen)
        return self.nodes if self.nodes >= 2 else self.world_size

    def replay_target(self, rank: int) -> int:
        """The rank whose batch ``rank`` replays: same local index, next node (docs/design.md §3)."""
        if self.ring is not None:
            return self.ring[rank]
        return (rank + self.ring_offset) % self.world_size

    def replayer_of(self, rank: int) -> int:
        """The rank that replays ``rank``'s batch."""
        if self.ring is not None:
            return self.ring.index(rank)
        return (rank - self.ring_offset) % self.world_size

    def reporter(self, suspects: list[int]) -> int:
        """The rank that writes the alarm: the lowest one not under suspicion."""
        healthy = [r for r in range(self.world_size) if r not in suspects]
        return healthy[0] if healthy else 0


def identity(rank: int, pod: str | None, node: str | None, pod_uid: str | None,
             gpu: dict[str, Any] | None = None) -> dict[str, Any]:
    """What an alarm says of a rank: ``{rank, pod, node}``, and the pod's uid and the rank's GPU
    (``{index, uuid}``, :func:`local_gpu`) where they are known."""
    who: dict[str, Any] = {"rank": rank, "pod": pod, "node": node}
    if pod_uid:
        who["pod_uid"] = pod_uid
    if gpu is not None:
        who["gpu"] = dict(gpu)
    return who


def local_gpu(compute: torch.device | None, local_index: int) -> dict[str, Any]:
    """This rank's ``suspects[].gpu``: on CUDA the device index and the GPU's UUID, which is what
    dcgm-exporter labels its series with (``UUID``; its ``gpu`` label is the host's index, which a
    container that sees only some GPUs numbers differently); elsewhere the rank's local index on
    its node, the GPU it stands for in a CPU run, with ``uuid`` None."""
    if compute is not None and compute.type == "cuda":
        index = compute.index if compute.index is not None else torch.cuda.current_device()
        raw = getattr(torch.cuda.get_device_properties(index), "uuid", None)  # torch >= 2.1 on CUDA
        return {"index": index, "uuid": None if raw is None else uuid_text(bytes(raw.bytes))}
    return {"index": local_index, "uuid": None}


def uuid_text(raw: bytes) -> str:
    """A CUDA device UUID (16 bytes, ``cudaDeviceProp.uuid``) as nvidia-smi and DCGM print it:
    ``GPU-`` and 8-4-4-4-12 lowercase hex (torch's own ``str()`` lacks the prefix)."""
    return "GPU-" + str(uuid.UUID(bytes=raw))


def gather_topology(config: Config, group: dist.ProcessGroup | None = None,
                    device: torch.device | None = None, compute: torch.device | None = None) -> Topology:
    """One collective at start-up: every rank's identity (with its GPU: ``compute`` is the device
    the model runs on), and rank 0's run id."""
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    per_node = config.ranks_per_node or world
    if world % per_node:
        raise ValueError(
            f"world size {world} is not a multiple of ranks_per_node {per_node} "
            "(set SDCGUARD_RANKS_PER_NODE or LOCAL_WORLD_SIZE)"
        )
    mine = {"rank": rank, "pod": config.pod, "node": config.node, "pod_uid": config.pod_uid,
            "gpu": local_gpu(compute, rank % per_node),
            "run_id": uuid.uuid4().hex[:12], "threads": torch.get_num_threads()}
    everyone: list[Any] = gather_objects(mine, group, device)
    identities = {e["rank"]: identity(e["rank"], e["pod"], e["node"], e["pod_uid"], e["gpu"]) for e in everyone}
    threads = {e["rank"]: e["threads"] for e in everyone}
    return Topology(rank, world, per_node, identities, run_id=everyone[0]["run_id"], threads=threads)
