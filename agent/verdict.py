"""What a check concluded, the same on every rank, before it becomes an alarm record."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True, slots=True)
class Verdict:
    check: str
    suspects: list[int] = field(default_factory=list)
    ambiguous: bool = False
    evidence: dict[str, Any] = field(default_factory=dict)
