"""``sdcguard report SPOOL``: what one job's integrity checking cost, from its spool.

It reads the ranks' statistics (``<spool>/stats/rank-<r>.json``: steps, the checks' measured cost,
the audit schedule) and the alarms there (pending, published or quarantined), and tells: steps
run, checks run by kind, the measured premium of each kind and in all, the audit interval and why,
each alarm's rollback waste, and the cost of the accepted, integrity-checked run — the premium
plus the waste, in GPU-hours (one rank is one GPU). Standard library only (no torch): a spool
copied off a node can be read anywhere. The arithmetic is :mod:`sdcguard.contract.cost` and
:func:`summarize` (pure); :func:`read_spool` and :func:`render_text` are the I/O around it.
"""
from __future__ import annotations

import json
import statistics
from pathlib import Path
from typing import Any

from .contract import alarm as alarm_schema
from .contract import cost as arithmetic
from .contract.spool import ALARM_SUFFIX, PUBLISHED_DIR, QUARANTINE_DIR
from .contract.stats import STATS_SCHEMA

KINDS = ("ordinary", "audit", "weights")
KIND_NAMES = {"ordinary": "ordinary checks (1, 4; every step)", "audit": "audits (checks 2, 3)",
              "weights": "weight checks (3, after an update)"}


class SpoolError(ValueError):
    """A directory that holds no statistics to report on."""


def read_spool(spool: str | Path) -> tuple[list[dict[str, Any]], list[dict[str, Any]], list[str]]:
    """(every rank's statistics, every distinct alarm record, what was skipped and why)."""
    root = Path(spool)
    if not root.is_dir():
        raise SpoolError(f"{root} is not a directory")
    skipped: list[str] = []
    stats = []
    for path in sorted((root / "stats").glob("rank-*.json")):
        try:
            data = json.loads(path.read_text(encoding="utf-8"))
            if not isinstance(data, dict) or data.get("schema") != STATS_SCHEMA or not isinstance(data.get("rank"), int):
                raise ValueError(f"not a {STATS_SCHEMA} record")
        except (OSError, ValueError) as exc:
            skipped.append(f"{path.name}: {exc}")
            continue
        stats.append(data)
    if not stats:
        raise SpoolError(f"{root} holds no statistics (stats/rank-*.json): not a spool, or no Guard wrote to it")
    alarms: dict[str, dict[str, Any]] = {}
    for folder in (root, root / PUBLISHED_DIR, root / QUARANTINE_DIR):
        # published/ may hold name.alarm.json.<ns> when a record was published twice
        for path in sorted(folder.glob(f"*{ALARM_SUFFIX}*")) if folder.is_dir() else []:
            if path.name.startswith("."):
                continue
            try:
                record = alarm_schema.loads(path.read_bytes())
            except (OSError, alarm_schema.AlarmError) as exc:
                skipped.append(f"{folder.name}/{path.name}: {exc}")
                continue
            alarms.setdefault(record["id"], record)
    return stats, sorted(alarms.values(), key=lambda a: (a["step"], a["id"])), skipped


def summarize(stats: list[dict[str, Any]], alarms: list[dict[str, Any]]) -> dict[str, Any]:
    """The job's cost from its ranks' statistics and its alarms (pure).

    Per-check figures are the mean over the ranks that measured them; GPU time is each rank's own
    (its premium seconds), extrapolated to the job's ``world_size`` ranks when the spool holds only
    some of them (a spool is per pod)."""
    ranks = sorted(s["rank"] for s in stats)
    measured = [s["cost"] for s in stats if isinstance(s.get("cost"), dict)]
    world = max([c.get("world_size") or 0 for c in measured] + [a.get("world_size") or 0 for a in alarms]
                + [len(stats)])
    steps = max(int(s.get("steps") or 0) for s in stats)
    phases: dict[str, int] = {}
    for s in stats:
        for phase, entry in (s.get("checks") or {}).items():
            phases[phase] = max(phases.get(phase, 0), int((entry or {}).get("runs") or 0))
    checks: dict[str, dict[str, Any]] = {}
    step_time = checked_step = premium = None
    premium_gpu_seconds = 0.0
    if measured:
        for kind in KINDS:
            figures = [c["checks"][kind] for c in measured]
            checks[kind] = {"runs": max(f["runs"] for f in figures),
                            "seconds_each": statistics.fmean(f["seconds_each"] for f in figures),
                            "premium": statistics.fmean(f["premium"] for f in figures)}
        step_time = statistics.fmean(c["step_time_s"] for c in measured)
        checked_step = statistics.fmean(c["checked_step_s"] for c in measured)
        premium = sum(c["premium"] for c in checks.values())
        premium_gpu_seconds = sum(c["premium_seconds"] for c in measured) * world / len(measured)
    rollbacks = []
    for record in alarms:
        waste = arithmetic.rollback(record)
        rollbacks.append({"id": record["id"], "check": record["check"], "step": record["step"],
                          "drill": record.get("drill") is True, "suspect_ranks": record["suspect_ranks"],
                          "steps_at_risk": record.get("steps_at_risk"), "rollback": waste})
    plain = arithmetic.run_gpu_seconds(steps, step_time or 0.0, world)
    total = arithmetic.checked_run(premium_gpu_seconds, [r["rollback"]["gpu_seconds"] for r in rollbacks
                                                         if r["rollback"] is not None], plain)
    total["rollbacks_unknown"] = sum(1 for r in rollbacks if r["rollback"] is None)
    return {
        "ranks": ranks, "world_size": world, "steps": steps, "step_time_s": step_time,
        "checked_step_s": checked_step, "checks": checks, "phase_runs": phases, "premium": premium,
        "audit_schedule": _schedule(stats), "alarms": rollbacks,
        "run_gpu_hours": round(arithmetic.gpu_hours(plain), 9), "cost": total,
    }


def _schedule(stats: list[dict[str, Any]]) -> dict[str, Any] | None:
    """The audit schedule as the lowest rank states it (the interval is agreed on every rank)."""
    for s in sorted(stats, key=lambda s: s["rank"]):
        schedule = s.get("audit_schedule")
        if isinstance(schedule, dict):
            why = schedule.get("reason") or (
                f"audit_every={schedule['interval']}" if schedule.get("interval") else
                "no audits (one rank, or audit_every=0)")
            return {"mode": schedule.get("mode"), "interval": schedule.get("interval"), "reason": why,
                    "max_overhead": schedule.get("max_overhead"), "rank": s["rank"]}
    return None


def _pct(x: float | None) -> str:
    return "unknown" if x is None else f"{x * 100:.3g}%"


def _ms(x: float | None) -> str:
    return "unknown" if x is None else f"{x * 1e3:.3g} ms"


def _hours(x: float | None) -> str:
    """GPU-hours, or GPU-seconds below a tenth of an hour (a short run, a small job)."""
    if x is None:
        return "unknown"
    return f"{x:.4g} GPU-h" if x >= 0.1 else f"{x * arithmetic.SECONDS_PER_HOUR:.4g} GPU-s"


def render_text(summary: dict[str, Any], spool: str = "") -> str:
    """The summary for a person."""
    s = summary
    lines = [f"sdcguard report{' ' + spool if spool else ''}",
             f"  ranks in this spool: {', '.join(map(str, s['ranks']))} of {s['world_size']}; steps run: {s['steps']}",
             f"  step without sdcguard: {_ms(s['step_time_s'])}; with its checks: {_ms(s['checked_step_s'])}"]
    if s["checks"]:
        lines.append("  checks (measured while training, mean over ranks):")
        for kind in KINDS:
            c = s["checks"][kind]
            lines.append(f"    {KIND_NAMES[kind]:<36} {c['runs']:>7} runs  {_ms(c['seconds_each']):>10} each  "
                         f"premium {_pct(c['premium'])}")
        lines.append(f"    {'total premium':<36} {_pct(s['premium'])}")
    else:
        lines.append("  checks: nothing measured yet (no step followed another)")
    sched = s["audit_schedule"]
    if sched is not None:
        budget = f" (integrity budget {_pct(sched['max_overhead'])})" if sched.get("mode") == "budget" else ""
        lines.append(f"  audit interval: every {sched['interval']} steps, {sched['mode']}{budget}: {sched['reason']}")
    if s["phase_runs"]:
        lines.append("  timed check phases run (most on any rank): "
                     + ", ".join(f"{phase} {n}" for phase, n in sorted(s["phase_runs"].items())))
    lines.append(f"  alarms: {len(s['alarms'])}")
    for a in s["alarms"]:
        r = a["rollback"]
        waste = (f"{r['steps_at_risk']} steps at risk x {_ms(r['step_seconds'])} x {r['world_size']} ranks = "
                 f"{_hours(r['gpu_hours'])}") if r else "rollback waste unknown (the record lacks its figures)"
        lines.append(f"    {a['id']}: {a['check']} at step {a['step']}{' (drill)' if a['drill'] else ''}: {waste}")
    c = s["cost"]
    lines.append(f"  cost of this integrity-checked run: {_hours(c['gpu_hours'])} = premium "
                 f"{_hours(c['premium_gpu_hours'])} + rollbacks {_hours(c['rollback_gpu_hours'])}"
                 f"{' (+ ' + str(c['rollbacks_unknown']) + ' unknown)' if c['rollbacks_unknown'] else ''}; "
                 f"{_pct(c['fraction_of_run'])} of the run's {_hours(s['run_gpu_hours'])} without sdcguard")
    return "\n".join(lines)


def main(spool: str, output: str = "text") -> int:
    """``sdcguard report``: 0 printed, 2 nothing to report on."""
    import sys
    try:
        stats, alarms, skipped = read_spool(spool)
    except SpoolError as exc:
        print(f"sdcguard report: error: {exc}", file=sys.stderr)
        return 2
    for reason in skipped:
        print(f"sdcguard report: skipped {reason}", file=sys.stderr)
    summary = summarize(stats, alarms)
    if output == "json":
        print(json.dumps({"spool": str(spool), **summary}, indent=2, sort_keys=True))
    else:
        print(render_text(summary, str(spool)))
    return 0
