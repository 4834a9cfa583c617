"""Check 2's attribution rules: who is the suspect, from the ring's mismatching pairs.

Pure functions over digests, so every branch is unit-tested without processes; ``audit.Replayer``
gathers the digests and runs the tie-break replays these rules ask for.

Every rank ``r`` replays the batch of ``owner(r)``; a pair ``(replayer, owner)`` mismatches when the
replay's digest differs from the owner's own. Then:
  - a rank in two mismatching pairs (its own batch replayed differently, and its replay of another's
    batch different) is the suspect: a persistent fault;
  - a single mismatching pair is settled by a tie-break replay on a third unit: the side that
    disagrees with the third opinion is the suspect (a transient fault); when the third agrees with
    neither, both are suspects and the verdict is ambiguous;
  - with fewer than three units there is no third opinion: both sides, ambiguous.
"""
from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from typing import Callable

OWNER, REPLAYER, NEITHER = "owner", "replayer", "neither"


def mismatching_pairs(digests: list[list[bytes]], replay_target: Callable[[int], int]) -> list[tuple[int, int]]:
    """``(replayer, owner)`` pairs whose replay differs; ``digests[r] = [own pass, replay]``."""
    return [(r, replay_target(r)) for r in range(len(digests))
            if digests[r][1] != digests[replay_target(r)][0]]


@dataclass(frozen=True, slots=True)
class Attribution:
    suspects: set[int]
    """Ranks named so far (persistent faults, or everyone involved when there is no third unit)."""
    ambiguous: bool
    tiebreaks: list[tuple[int, int]]
    """Pairs still to settle by a third opinion (replayer, owner), in order."""


def attribute(pairs: list[tuple[int, int]], units: int) -> Attribution:
    """What the pairs alone say, and which pairs need a tie-break replay."""
    if units < 3:
        return Attribution({x for pair in pairs for x in pair}, bool(pairs), [])
    counts = Counter(x for pair in pairs for x in pair)
    persistent = {x for x, c in counts.items() if c >= 2}
    open_pairs = [(r, o) for r, o in pairs if r not in persistent and o not in persistent]
    return Attribution(persistent, False, open_pairs)


def settle(owner_digest: bytes, replay_digest: bytes, third_opinion: bytes) -> str:
    """Whom the third unit's replay of the owner's batch agrees with: OWNER (so the replayer
    erred), REPLAYER (so the owner erred) or NEITHER (both suspect, ambiguous)."""
    if third_opinion == owner_digest:
        return OWNER
    if third_opinion == replay_digest:
        return REPLAYER
    return NEITHER


def suspects_after(agrees_with: str, replayer: int, owner: int) -> set[int]:
    """The suspects one settled tie-break adds."""
    return {OWNER: {replayer}, REPLAYER: {owner}}.get(agrees_with, {replayer, owner})
