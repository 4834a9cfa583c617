"""Per-rank check statistics left in the spool for the sidecar to export as metrics.

``<spool>/stats/rank-<r>.json`` (schema ``sdcguard.dev/stats/v1``): steps, per-check run counts and
seconds, last verified step, alarms. Rewritten atomically at most every ``interval`` seconds (and
at once after an alarm), without fsync: losing the last few seconds of counters is harmless,
slowing the training step is not.

Additive in v1, ``audit_schedule``: how the audit interval is chosen — ``{"mode": "fixed",
"interval": K}`` (0: no audits), or under an integrity budget (``Config.max_overhead``,
``sdcguard.budget``) ``{"mode": "budget", "interval", "reason", "max_overhead",
"max_audit_interval", "decided", "decided_at_step", "decisions", "changes", "wanted_here",
"premium_here", "measured_here": {"ordinary_cost_s", "audit_cost_s", "step_time_s"},
"samples_here"}``: ``interval`` is the one every rank agreed on, ``*_here`` this rank's own view.

Additive in v1, ``cost``: what the checks cost on this rank, measured while training
(``sdcguard.budget.Meter``, every Guard), absent before the first measured step —
``{"step_time_s"`` (a step without sdcguard: median wall time less the checks' phases),
``"step_time_from"``, ``"checked_step_s"`` (a step with them: ``step_time_s x (1 + premium)``),
``"world_size"``, ``"steps"`` and ``"measured_steps"`` (``{ordinary, audit, weights}``: steps of each
kind), ``"checks": {kind: {"runs", "seconds_each", "seconds", "premium"}}`` (kind ``ordinary``: checks
1 and 4, on every step; ``audit``: checks 2 and 3 before the update, with ``"outside_phases_s"``;
``weights``: check 3 after an update on a step that is no audit), ``"premium"`` (their sum: the
fraction the checks add to the run) and ``"premium_seconds"``}``.
"""
from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from .alarm import now_rfc3339
from .spool import write_json_atomic

STATS_SCHEMA = "sdcguard.dev/stats/v1"


def stats_path(spool: str, rank: int) -> Path:
    return Path(spool) / "stats" / f"rank-{rank}.json"


@dataclass(slots=True)
class CheckStats:
    identity: dict[str, Any]
    job: dict[str, str] | None
    interval: float = 15.0
    steps: int = 0
    last_step: int | None = None
    last_verified_step: int | None = None
    alarms: int = 0
    runs: dict[str, int] = field(default_factory=dict)
    seconds: dict[str, float] = field(default_factory=dict)
    audit_schedule: dict[str, Any] | None = None
    """How the audit interval is chosen and what it is now (see the module's docstring)."""
    measure: Callable[[], dict[str, Any] | None] | None = field(default=None, repr=False, compare=False)
    """What the checks cost so far (``cost``), computed when the record is written, not on every step."""
    _written_at: float = 0.0

    def timed(self, check: str, started: float) -> None:
        """Count one run of ``check`` that began at ``started`` (a perf_counter reading)."""
        self.add(check, time.perf_counter() - started)

    def add(self, check: str, seconds: float) -> None:
        """Count one run of ``check`` that took ``seconds``."""
        self.runs[check] = self.runs.get(check, 0) + 1
        self.seconds[check] = self.seconds.get(check, 0.0) + seconds

    def cost(self) -> dict[str, Any] | None:
        """The ``cost`` record now (see the module's docstring), or None while nothing is measured."""
        return self.measure() if self.measure is not None else None

    def as_dict(self) -> dict[str, Any]:
        cost = self.cost()
        return {
            "schema": STATS_SCHEMA, **self.identity, "job": self.job, "steps": self.steps,
            "last_step": self.last_step, "last_verified_step": self.last_verified_step,
            "alarms": self.alarms,
            "checks": {c: {"runs": self.runs[c], "seconds": round(self.seconds[c], 6)} for c in sorted(self.runs)},
            **({"audit_schedule": self.audit_schedule} if self.audit_schedule is not None else {}),
            **({"cost": cost} if cost is not None else {}),
            "updated": now_rfc3339(),
        }

    def flush(self, spool: str | None, force: bool = False) -> None:
        now = time.monotonic()
        if spool is None or (not force and now - self._written_at < self.interval):
            return
        self._written_at = now
        write_json_atomic(stats_path(spool, self.identity["rank"]), json.dumps(self.as_dict()), durable=False)
