"""Check 3 for HSDP: every shard's fingerprint compared across its replicas.

The ranks of one column of the mesh hold the same shard; each rank fingerprints its local shard
of every parameter (``weights.fingerprint_weights`` on ``p.to_local()``). The common case costs two
16-byte all-reduces: the shard's replicas agree (``exchange.agree`` on the replicate group), then
every rank learns whether every column agreed (a veto over the world). Only then are the digests
gathered, the per-parameter fingerprints fetched from the odd replicas and one of each majority,
and :func:`judge_shard_weights` names, per shard, the replica outside a strict majority — with
``weights.judge_weights``, as for DDP. With one replica (pure FSDP) there is nothing to compare.
"""
from __future__ import annotations

from typing import Any, Sequence

import torch
import torch.distributed as dist

from ..checks.exchange import DIGEST_BYTES, agree, gather_digests, gather_objects
from ..checks.verdict import Verdict
from ..checks.weights import WeightCheck, fingerprint_weights, judge_weights, strict_majority
from ..contract.alarm import CHECK_WEIGHTS
from ..fingerprint import Fingerprint
from .layout import ShardLayout


def local_shards(named_parameters: Sequence[tuple[str, torch.Tensor]]) -> list[tuple[str, torch.Tensor]]:
    """Each parameter's local shard (a DTensor's ``to_local()``; a plain tensor as it is)."""
    return [(n, p.to_local() if hasattr(p, "to_local") else p) for n, p in named_parameters]


def fingerprint_shards(named_parameters: Sequence[tuple[str, torch.Tensor]]) -> WeightCheck:
    return fingerprint_weights(local_shards(named_parameters))


def replicas_agree(mine: WeightCheck, device: torch.device, replicate_group: dist.ProcessGroup) -> bool:
    """Whether every shard's replicas hold the same digest, the same answer on every rank."""
    ok = agree(mine.digest, device, replicate_group)
    return agree(bytes(DIGEST_BYTES), device, None, veto=not ok)


def shard_weights_verdict(mine: WeightCheck, layout: ShardLayout, device: torch.device) -> Verdict | None:
    """Collective over the world, after ``replicas_agree`` said no: the verdict every rank reaches."""
    digests = [d for [d] in gather_digests([mine.digest], device, None)]
    needed = ranks_needed(digests, layout)
    said = gather_objects([list(fp) for fp in mine.fingerprints] if layout.rank in needed else None, None, device)
    fingerprints = [None if f is None else [Fingerprint(int(a), int(b)) for a, b in f] for f in said]
    return judge_shard_weights(digests, fingerprints, mine.names, layout)


def ranks_needed(digests: list[bytes], layout: ShardLayout) -> set[int]:
    """Pure: the ranks whose per-parameter fingerprints a judgement needs: per differing shard,
    its odd replicas and the first of its majority."""
    needed: set[int] = set()
    for k, j in layout.positions():
        ranks = layout.replicas_of_shard(j, k)
        column = [digests[r] for r in ranks]
        majority = strict_majority(column)
        if len(set(column)) == 1 or majority is None:
            continue
        needed |= {r for r, d in zip(ranks, column) if d != majority} | {ranks[column.index(majority)]}
    return needed


def judge_shard_weights(digests: list[bytes], fingerprints: list[list[Fingerprint] | None], names: list[str],
                        layout: ShardLayout) -> Verdict | None:
    """Pure: per shard, the replicas outside a strict majority (``weights.judge_weights`` on that
    shard's column), as global ranks with their ``(replica, shard)`` coordinates; None when every
    shard's replicas agree. A shard without a strict majority names all its replicas, ambiguous."""
    suspects: list[int] = []
    ambiguous = False
    shards: dict[Any, Any] = {}
    for k, j in layout.positions():
        ranks = layout.replicas_of_shard(j, k)
        column = [digests[r] for r in ranks]
        if len(set(column)) == 1:
            continue
        found = judge_weights(column, [fingerprints[r] for r in ranks], names)
        named = [ranks[i] for i in found.suspects]
        suspects += named
        ambiguous |= found.ambiguous
        evidence = dict(found.evidence)
        if "suspect_digests" in evidence:
            evidence["suspect_digests"] = {ranks[i]: d for i, d in evidence["suspect_digests"].items()}
            evidence["differing_parameters"] = {ranks[i]: d for i, d in evidence["differing_parameters"].items()}
        shards[j if layout.tp == 1 else f"{j}/tp{k}"] = {"replicas": ranks, "suspects": named, **evidence}
    if not shards:
        return None
    return Verdict(CHECK_WEIGHTS, suspects=sorted(suspects), ambiguous=ambiguous, evidence={
        "mesh": mesh_evidence(layout),
        "coordinates": {r: layout.coordinates(r) for r in sorted(suspects)},
        "shards": shards,
    })


def mesh_evidence(layout: ShardLayout) -> dict[str, int]:
    """The mesh's dimensions as an alarm's evidence states them."""
    mesh = {"replicas": layout.replicas, "shards": layout.shards}
    if layout.tp > 1:
        mesh["tp"] = layout.tp
    return mesh
