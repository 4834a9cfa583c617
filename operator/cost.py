"""What an incident cost (``SDCIncident.status.cost``): the rollback's GPU time, and whether it was
a false-positive investigation. Pure functions of what the objects record; the incident writes
their results (``incident.py``) and ``kubectl sdcguard report`` prints them.

- **Rollback waste**: resuming from the alarm's last good checkpoint redoes ``steps_at_risk`` steps
  on every rank, each taking the checked step time the library measured (the alarm's
  ``step_seconds``): steps at risk x step seconds x ranks GPU-seconds
  (:func:`sdcguard.contract.cost.rollback_gpu_seconds`). An alarm of an older library lacks the
  figures: the waste is then left out, never guessed.
- **False-positive investigation**: an incident whose every node replacement was denied by a person
  after that node's deep health check passed — the hardware was looked at, found healthy, and
  kept. (A denial after a failed or skipped check, or any replacement carried out, is not one.)
"""
from __future__ import annotations

from typing import Any, Mapping

from sdcguard.contract import cost as arithmetic
from sdcguard.contract.phases import ReplacementPhase


def rollback(steps_at_risk: Any, alarm: Mapping[str, Any]) -> dict[str, Any]:
    """``status.cost``'s rollback fields: the figures and their product, each only where known."""
    seconds = arithmetic.rollback_gpu_seconds(steps_at_risk, alarm.get("step_seconds"), alarm.get("world_size"))
    fields = {
        "stepsAtRisk": steps_at_risk if arithmetic.is_count(steps_at_risk, 0) else None,
        "stepSeconds": alarm.get("step_seconds"),
        "worldSize": alarm.get("world_size"),
        "rollbackGpuSeconds": None if seconds is None else round(seconds, 6),
        "rollbackGpuHours": None if seconds is None else round(arithmetic.gpu_hours(seconds), 9),
    }
    return {k: v for k, v in fields.items() if v is not None}


def denied_after_passed_check(replacement_status: Mapping[str, Any]) -> bool:
    """A NodeReplacement a person denied although its node's deep health check passed."""
    return replacement_status.get("phase") == ReplacementPhase.DENIED \
        and (replacement_status.get("healthCheck") or {}).get("result") == "Passed"


def false_positive(replacements: Mapping[str, str], denied_healthy: list[str] | tuple[str, ...]) -> bool:
    """Whether an incident was a false-positive investigation: it opened replacements, and every one
    (name -> last phase, ``status.replacements``) was denied after a passed health check
    (``denied_healthy``)."""
    return bool(replacements) and all(phase == ReplacementPhase.DENIED and name in denied_healthy
                                      for name, phase in replacements.items())
