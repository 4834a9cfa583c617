"""The drill's report: every rank's result and the alarms, judged (see ``sdcguard.faults.judge``).

Besides which check caught each fault, a drill that resumes after its alarms is judged on its
recovery: each alarm records the step the run resumed from, a resume from a state inside the
fault's suspect window is ``resume-unsafe``, and the final weights (one digest when every replica
agrees) can be compared bit for bit with the same drill run without faults.
Standard library only.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any

from ..faults.judge import PASSING, Judgement, Schedule, expectation, judge_faults, suspect_window
from ..faults.spec import FaultSpec

__all__ = ["build_report", "print_summary", "Schedule", "expectation", "judge_faults", "PASSING"]


def build_report(cfg: dict[str, Any], results: list[dict[str, Any]], alarms: list[dict[str, Any]]) -> dict[str, Any]:
    """The JSON report from the drill's config, each rank's result and the spooled alarms."""
    faults = [FaultSpec(**f) for f in cfg["faults"]]
    stopped_at = results[0]["stopped_at_step"]
    plan = Schedule(cfg["steps"], cfg["audit_every"], cfg["weight_check_every"], cfg["nodes"], cfg["checkpoint_every"],
                    checks_weights=not cfg.get("shard") or cfg["replicate"] > 1,  # pure FSDP: no check 3
                    # pure FSDP's update re-run (AdamW); not over pipeline stages
                    checks_updates=bool(cfg.get("shard")) and cfg["replicate"] == 1 and cfg.get("tp", 1) == 1
                    and not cfg.get("pp"),
                    tp=cfg.get("tp", 1),
                    pipeline=pipeline_grid(cfg["world_size"], cfg["pp"]) if cfg.get("pp") else None,
                    pipeline_audits_first_step=bool(cfg.get("shard")))  # FSDP2 stages: step 0 is audited too
    recoveries = _recoveries(results[0]["recoveries"], alarms)
    verdict: Judgement = judge_faults(faults, alarms, plan, stopped_at=stopped_at,
                                      resumed_at={r["alarm"]: r["resume_step"] for r in recoveries})
    digests = {r["rank"]: r["final_weights"] for r in results}
    public_cfg = {k: v for k, v in cfg.items() if k not in ("workdir", "print_every")}
    return {
        "config": public_cfg,
        **verdict.as_dict(),
        "fired": merge_fired(results),
        "alarms": alarms,
        "recoveries": recoveries,
        "resumed_from": [r["resumed_from"] for r in recoveries],
        "steps_completed": results[0]["steps_completed"],
        "stopped_at_step": stopped_at,
        "final_weight_digests": digests,
        "final_weights_digest": next(iter(digests.values())) if len(set(digests.values())) == 1 else None,
    }


def pipeline_grid(world: int, pp: int) -> tuple[tuple[int, int], ...]:
    """``(replica, position)`` of every rank of the pipeline drill: a replica is ``pp``
    consecutive ranks (as ``drill/pipeline.py`` lays them out)."""
    return tuple((r // pp, r % pp) for r in range(world))


def merge_fired(results: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One entry per (kind, step) with the ranks it struck (an all-reduce fault strikes all)."""
    merged: dict[tuple[str, int], list[int]] = {}
    for result in results:
        for event in result["fired"]:
            merged.setdefault((event["kind"], event["step"]), []).append(event["rank"])
    return [{"kind": k, "step": s, "ranks": sorted(r)} for (k, s), r in sorted(merged.items(), key=lambda i: i[0][1])]


def _recoveries(resumes: list[dict[str, Any]], alarms: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Each resume (alarm id, resume step, checkpoint file) with what its alarm said."""
    by_id = {a["id"]: a for a in alarms}
    out = []
    for resume in resumes:
        alarm = by_id.get(resume["alarm"], {"step": resume["step"], "check": None})
        first, last = suspect_window(alarm)
        named = alarm.get("last_good_checkpoint")
        out.append({
            "alarm": resume["alarm"], "check": alarm["check"], "step": alarm["step"],
            "suspect_window": {"first_step": first, "last_step": last},
            "last_good_checkpoint": Path(named).name if named else None,
            "resume_step": resume["resume_step"], "resumed_from": resume["resumed_from"],
        })
    return out


def print_summary(report: dict[str, Any]) -> None:
    print("[drill] ---- summary ----")
    for e in report["fired"]:
        ranks = "every rank" if len(e["ranks"]) == report["config"]["world_size"] else \
            "rank " + ", ".join(map(str, e["ranks"]))
        print(f"[drill] fired    {e['kind']} on {ranks} at step {e['step']}")
    for a in report["alarms"]:
        who = ", ".join(f"rank {s['rank']} on {s['node'] or '?'}" for s in a["suspects"]) or "no rank"
        amb = " (ambiguous)" if a["ambiguous"] else ""
        print(f"[drill] alarm    check {a['check']} at step {a['step']}: {who}{amb}")
    for r in report["recoveries"]:
        w = r["suspect_window"]
        source = r["resumed_from"] or ("the start" if r["resume_step"] < 0 else "a verified in-memory copy")
        print(f"[drill] resume   after step {r['step']} alarm (suspect steps {w['first_step']}..{w['last_step']}): "
              f"from step {r['resume_step']} ({source})")
    for row in report["injected"]:
        fault = FaultSpec(**{k: row[k] for k in FaultSpec.__slots__})
        print(f"[drill] verdict  {fault}: {row['outcome'].upper()} ({row['why']})")
    for alarm_id in report["unexplained_alarms"]:
        print(f"[drill] verdict  UNEXPLAINED alarm {alarm_id} (a false alarm, or a misjudged fault)")
    stop = report["stopped_at_step"]
    digest = report["final_weights_digest"]
    print(f"[drill] {report['steps_completed']} steps completed"
          + (f", stopped at step {stop}" if stop is not None else ", run finished")
          + (f"; final weights {digest[:16]}" if digest else "; replicas' final weights differ"))
    print(f"[drill] drill {'PASSED' if report['passed'] else 'FAILED'}")
