"""The cost of a checked run, in GPU time: the arithmetic shared by ``sdcguard report`` (a spool's
statistics and alarms) and the operator (an incident's ``status.cost``). Pure; standard library only.

Every figure is measured inside the run (``sdcguard.budget.Meter``): the step time, the checks'
premium, and the checked step time an alarm carries (``step_seconds``). One rank is one GPU.
"""
from __future__ import annotations

import math
from typing import Any

SECONDS_PER_HOUR = 3600.0


def gpu_hours(gpu_seconds: float) -> float:
    return gpu_seconds / SECONDS_PER_HOUR


def rollback_gpu_seconds(steps_at_risk: Any, step_seconds: Any, world_size: Any) -> float | None:
    """What resuming after an alarm redoes: steps at risk x the measured time of a checked step x
    the job's ranks, in GPU-seconds. None when any figure is missing or is not one (an alarm of an
    older library, a step never measured): unknown, never guessed."""
    if not (is_count(steps_at_risk, 0) and is_count(world_size, 1)):
        return None
    if isinstance(step_seconds, bool) or not isinstance(step_seconds, (int, float)) \
            or not math.isfinite(step_seconds) or step_seconds < 0:
        return None
    return steps_at_risk * float(step_seconds) * world_size


def rollback(record: dict[str, Any]) -> dict[str, Any] | None:
    """An alarm record's rollback waste, ``{steps_at_risk, step_seconds, world_size, gpu_seconds,
    gpu_hours}``, or None when the record lacks what it takes."""
    seconds = rollback_gpu_seconds(record.get("steps_at_risk"), record.get("step_seconds"), record.get("world_size"))
    if seconds is None:
        return None
    return {"steps_at_risk": record["steps_at_risk"], "step_seconds": record["step_seconds"],
            "world_size": record["world_size"], "gpu_seconds": round(seconds, 6),
            "gpu_hours": round(gpu_hours(seconds), 9)}


def run_gpu_seconds(steps: int, step_seconds: float, world_size: int) -> float:
    """The compute of ``steps`` steps of ``step_seconds`` on ``world_size`` ranks."""
    return max(0, steps) * max(0.0, step_seconds) * max(1, world_size)


def checked_run(premium_gpu_seconds: float, rollback_gpu_seconds: list[float], plain_gpu_seconds: float) -> dict[str, Any]:
    """The cost of one accepted, integrity-checked run beyond the run itself: the checks' premium
    plus the rollbacks' waste, in GPU-hours and as a fraction of the run without sdcguard
    (``plain_gpu_seconds``; the fraction is None when that is 0)."""
    waste = sum(rollback_gpu_seconds)
    extra = premium_gpu_seconds + waste
    return {"premium_gpu_hours": round(gpu_hours(premium_gpu_seconds), 9),
            "rollback_gpu_hours": round(gpu_hours(waste), 9),
            "gpu_hours": round(gpu_hours(extra), 9),
            "fraction_of_run": round(extra / plain_gpu_seconds, 9) if plain_gpu_seconds > 0 else None}


def is_count(value: Any, least: int) -> bool:
    """An integer (not a boolean) of at least ``least``."""
    return isinstance(value, int) and not isinstance(value, bool) and value >= least
