"""Check 3: are all replicas' weights still identical?

Each rank fingerprints every parameter and sends one 16-byte digest of the list; only when the
digests disagree are the per-parameter fingerprints exchanged, to say which parameters differ.
The replica that differs from a strict majority is named — rank 0 is no privileged reference.
"""
from __future__ import annotations

from collections import Counter
from typing import Any, Sequence

import torch
import torch.distributed as dist

from ..contract.alarm import CHECK_WEIGHTS
from .exchange import gather_objects
from ..fingerprint import Fingerprint, digest, fingerprint_many, fingerprint_sums, to_fingerprints
from .verdict import Verdict, parameter_summary



class WeightCheck:
    """This rank's weights as fingerprinted for one check. Made from the fingerprints' sums still
    on the device, it reads them to the host when first asked (on an audit step: after the replay,
    whose kernels a read before it would have held up)."""

    __slots__ = ("names", "_fingerprints", "_sums")

    def __init__(self, names: list[str], fingerprints: list[Fingerprint] | None = None, *,
                 sums: torch.Tensor | None = None) -> None:
        if (fingerprints is None) == (sums is None):
            raise ValueError("a WeightCheck takes its fingerprints or their sums, one of the two")
        self.names = names
        self._fingerprints = fingerprints
        self._sums = sums

    @property
    def fingerprints(self) -> list[Fingerprint]:
        if self._fingerprints is None:
            self._fingerprints, self._sums = to_fingerprints(self._sums), None
        return self._fingerprints

    @property
    def digest(self) -> bytes:
        return digest(self.fingerprints)


def fingerprint_weights(named_parameters: Sequence[tuple[str, torch.Tensor]]) -> WeightCheck:
    """The fingerprints of ``named_parameters``, computed now and read to the host when first used
    (parameters on several devices: read now, one transfer per device)."""
    names = [n for n, _ in named_parameters]
    params = [p for _, p in named_parameters]
    if len({p.device for p in params}) == 1:
        return WeightCheck(names, sums=fingerprint_sums(params))
    return WeightCheck(names, fingerprint_many(params))


def weights_verdict(mine: WeightCheck, digests: list[bytes], rank: int, group: dist.ProcessGroup | None = None,
                    device: torch.device | None = None) -> Verdict | None:
    """Collective when the digests differ: None when every rank's digest agrees; otherwise the
    per-parameter fingerprints are fetched only from the odd replicas and one rank of the
    majority (:func:`exchange_fingerprints`), and :func:`judge_weights` names the odd ones."""
    if len(set(digests)) == 1:
        return None
    return judge_weights(digests, exchange_fingerprints(mine, digests, rank, group, device), mine.names)


def exchange_fingerprints(mine: WeightCheck, digests: list[bytes], rank: int, group: dist.ProcessGroup | None,
                          device: torch.device | None) -> list[list[Fingerprint] | None]:
    """Every rank's per-parameter fingerprints where a judgement needs them, else None."""
    majority = strict_majority(digests)
    if majority is None:
        return [None] * len(digests)
    needed = {r for r, d in enumerate(digests) if d != majority} | {digests.index(majority)}
    said = gather_objects([list(fp) for fp in mine.fingerprints] if rank in needed else None, group, device)
    return [None if f is None else [Fingerprint(int(a), int(b)) for a, b in f] for f in said]


def strict_majority(digests: list[bytes]) -> bytes | None:
    """The digest more than half the ranks hold, if any."""
    top, count = Counter(digests).most_common(1)[0]
    return top if count * 2 > len(digests) else None


def judge_weights(
    digests: list[bytes], fingerprints: list[list[Fingerprint] | None], names: list[str]
) -> Verdict:
    """Name the ranks outside a strict majority; without one, every rank is a candidate.

    ``fingerprints`` needs entries only for the suspects and the first rank of the majority."""
    majority = strict_majority(digests)
    groups = Counter(digests)
    if majority is None:
        return Verdict(CHECK_WEIGHTS, suspects=list(range(len(digests))), ambiguous=True, evidence={
            "majority_digest": None, "digest_groups": {d.hex(): n for d, n in groups.items()}})
    suspects = [r for r, d in enumerate(digests) if d != majority]
    reference = fingerprints[digests.index(majority)]
    return Verdict(CHECK_WEIGHTS, suspects=suspects, evidence={
        "majority_digest": majority.hex(),
        "majority_size": groups[majority],
        "suspect_digests": {r: digests[r].hex() for r in suspects},
        "differing_parameters": {r: _differing(names, fingerprints[r], reference) for r in suspects},
    })


def _differing(names: list[str], theirs: list[Fingerprint], reference: list[Fingerprint]) -> dict[str, Any]:
    return parameter_summary([n for n, a, b in zip(names, theirs, reference) if a != b])
