"""What a check concluded, the same on every rank, before it becomes an alarm record."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

# Differing parameter names an alarm lists per suspect or pair (the count is always given).
MAX_NAMED_PARAMETERS = 16


def parameter_summary(names: list[str]) -> dict[str, Any]:
    """Evidence for a set of differing parameters that stays small for any model size."""
    return {"count": len(names), "names": names[:MAX_NAMED_PARAMETERS]}


@dataclass(frozen=True, slots=True)
class Verdict:
    check: str
    suspects: list[int] = field(default_factory=list)
    ambiguous: bool = False
    evidence: dict[str, Any] = field(default_factory=dict)
