"""Check 3: are all replicas' weights still identical?

Each rank fingerprints every parameter and sends one 16-byte digest of the list; only when the
digests disagree are the per-parameter fingerprints exchanged, to say which parameters differ.
The replica that differs from a strict majority is named — rank 0 is no privileged reference.
"""
from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from typing import Any, Sequence

import torch
import torch.distributed as dist

from .alarm import CHECK_WEIGHTS
from .exchange import gather_digests, gather_objects
from .fingerprint import Fingerprint, digest, fingerprint
from .verdict import Verdict

# How many differing parameter names an alarm lists per suspect (the count is always given).
MAX_NAMED_PARAMETERS = 16


@dataclass(frozen=True, slots=True)
class WeightCheck:
    """This rank's weights as fingerprinted for one check."""

    names: list[str]
    fingerprints: list[Fingerprint]

    @property
    def digest(self) -> bytes:
        return digest(self.fingerprints)


def fingerprint_weights(named_parameters: Sequence[tuple[str, torch.Tensor]]) -> WeightCheck:
    names = [n for n, _ in named_parameters]
    return WeightCheck(names, [fingerprint(p) for _, p in named_parameters])


def compare_weights(
    mine: WeightCheck, device: torch.device, group: dist.ProcessGroup | None = None
) -> tuple[Verdict | None, list[bytes]]:
    """Gather every rank's digest; on disagreement fetch details and name the odd replicas.

    Returns the verdict (None when all agree) and the digests indexed by rank.
    """
    digests = [d for [d] in gather_digests([mine.digest], device, group)]
    if len(set(digests)) == 1:
        return None, digests
    everyone = gather_objects(mine.fingerprints, group)
    return judge_weights(digests, everyone, mine.names), digests


def judge_weights(
    digests: list[bytes], fingerprints: list[list[Fingerprint]], names: list[str]
) -> Verdict:
    """Name the ranks outside a strict majority; without one, every rank is a candidate."""
    world = len(digests)
    top, count = Counter(digests).most_common(1)[0]
    majority = top if count * 2 > world else None
    if majority is None:
        suspects = list(range(world))
        reference = None
    else:
        suspects = [r for r, d in enumerate(digests) if d != majority]
        reference = fingerprints[digests.index(majority)]
    evidence: dict[str, Any] = {
        "digests": {r: d.hex() for r, d in enumerate(digests)},
        "majority_digest": majority.hex() if majority else None,
    }
    if reference is not None:
        evidence["differing_parameters"] = {
            r: _differing(names, fingerprints[r], reference) for r in suspects
        }
    return Verdict(CHECK_WEIGHTS, suspects=suspects, ambiguous=majority is None, evidence=evidence)


def _differing(names: list[str], theirs: list[Fingerprint], reference: list[Fingerprint]) -> dict[str, Any]:
    bad = [n for n, a, b in zip(names, theirs, reference) if a != b]
    return {"count": len(bad), "names": bad[:MAX_NAMED_PARAMETERS]}
