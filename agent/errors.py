"""The one exception a detected fault raises, on every rank, after the ranks agree."""
from __future__ import annotations

from typing import Any


class SDCDetected(RuntimeError):
    """A check found silent data corruption; the step was not applied (or, for check 3, the
    next checkpoint is blocked). Every rank raises it with the same alarm record, so the whole
    job stops cleanly instead of hanging in a collective that one rank skipped."""

    def __init__(self, *, alarm: dict[str, Any]) -> None:
        self.alarm = alarm
        self.check: str = alarm["check"]
        self.step: int = alarm["step"]
        self.suspect_ranks: list[int] = list(alarm["suspect_ranks"])
        self.ambiguous: bool = alarm["ambiguous"]
        who = ", ".join(_describe(s) for s in alarm["suspects"]) or "no rank can be named"
        super().__init__(f"silent data corruption: check {self.check} at step {self.step}: {who}")


class ConfigurationError(ValueError):
    """The training set-up cannot support a check (e.g. ranks that cannot replay bit for bit)."""


def _describe(suspect: dict[str, Any]) -> str:
    where = [f"rank {suspect['rank']}"]
    if suspect.get("node"):
        where.append(f"node {suspect['node']}")
    if suspect.get("pod"):
        where.append(f"pod {suspect['pod']}")
    return " ".join(where)
