"""The incident as evidence: ``kubectl sdcguard report INCIDENT`` (docs/operator.md, Evidence report).

What the release guidance asks an incident to preserve — the fault signature, the affected ranks
and hardware, the job's inventory at the time, the training-step numbers, the checkpoints named
and resumed from, every decision with who and when, the telemetry and the cost — built by one pure
function (:func:`build`) over the SDCIncident and the NodeReplacements it opened, as the API
returns them, and rendered as text (:func:`render`) or printed as JSON. Standard library only:
the kubectl plugin uses it.

A NodeReplacement's status is shown only where it is the operator's sealed record (``trusted``,
the plugin's seal check); otherwise its decisions are listed as ``unsealed status``.
"""
from __future__ import annotations

import json
from typing import Any, Callable, Iterable, Mapping

from sdcguard.contract.text import telemetry_line

from . import history

OPERATOR = "sdcguard operator"
UNSEALED = "unsealed status"
NOT_RECORDED = "not recorded"


def _alarm(spec: Mapping[str, Any]) -> dict[str, Any]:
    return dict(spec["alarm"]) if isinstance(spec.get("alarm"), Mapping) else {}


def _gpu(identity: Mapping[str, Any]) -> dict[str, Any] | None:
    index, uuid = history.gpu_index(identity), history.gpu_uuid(identity)
    return None if index is None and uuid is None else {"index": index, "uuid": uuid}


def _identity(identity: Mapping[str, Any], status: Mapping[str, Any]) -> dict[str, Any]:
    node = identity.get("node")
    return {"rank": identity.get("rank"), "pod": identity.get("pod"), "podUid": identity.get("pod_uid"),
            "node": node, "instanceId": history.instance_of(node, status) if node else None, "gpu": _gpu(identity)}


def signature(spec: Mapping[str, Any]) -> dict[str, Any]:
    """What fired, where, and its evidence (the digests the check compared), as the signed alarm says."""
    alarm = _alarm(spec)
    return {"check": spec.get("check"), "step": spec.get("step"), "ambiguous": spec.get("ambiguous"),
            "alarmId": spec.get("alarmId"), "time": alarm.get("time"), "signed": bool(spec.get("alarmSignature")),
            "drill": bool(spec.get("drill")), "evidence": alarm.get("evidence") or {}}


def affected(spec: Mapping[str, Any], status: Mapping[str, Any]) -> dict[str, Any]:
    """The suspect ranks and, for each, its pod, node, instance and GPU; the reporting rank."""
    alarm = _alarm(spec)
    suspects = [_identity(s, status) for s in history.suspects(spec)]
    reporter = alarm.get("reporter") or spec.get("reporter")
    return {"ranks": alarm.get("suspect_ranks") or [s["rank"] for s in suspects], "suspects": suspects,
            "reporter": _identity(reporter, status) if isinstance(reporter, Mapping) else None,
            "pods": sorted({s["pod"] for s in suspects if s["pod"]}),
            "nodes": sorted({s["node"] for s in suspects if s["node"]}),
            "instances": sorted({s["instanceId"] for s in suspects if s["instanceId"]}),
            "gpus": [s["gpu"] for s in suspects if s["gpu"]]}


def inventory(status: Mapping[str, Any]) -> dict[str, Any] | None:
    """Every pod, node and instance of the job when the incident opened (None: an older operator)."""
    taken = status.get("inventory")
    if not isinstance(taken, Mapping):
        return None
    nodes = taken.get("nodes") or {}
    return {"recordedAt": taken.get("recordedAt"), "error": taken.get("error"), "pods": list(taken.get("pods") or []),
            "nodes": dict(nodes),
            "instances": sorted({n["instanceId"] for n in nodes.values()
                                 if isinstance(n, Mapping) and n.get("instanceId")})}


def steps(spec: Mapping[str, Any], status: Mapping[str, Any]) -> dict[str, Any]:
    window = status.get("suspectWindow") or spec.get("suspectWindow") or {}
    alarm = _alarm(spec)
    return {"alarmStep": spec.get("step"), "suspectWindow": {"firstStep": window.get("firstStep"),
                                                             "lastStep": window.get("lastStep")},
            "stepsAtRisk": status.get("stepsAtRisk", alarm.get("steps_at_risk")),
            "lastVerifiedStep": spec.get("lastVerifiedStep"),
            "lastAuditedStep": status.get("lastAuditedStep", alarm.get("last_audited_step")),
            "lastWeightsVerifiedStep": status.get("lastWeightsVerifiedStep", alarm.get("last_weights_verified_step"))}


def checkpoints(spec: Mapping[str, Any], status: Mapping[str, Any]) -> dict[str, Any]:
    """The checkpoint the alarm named (where to resume), and the one the run actually resumed from."""
    alarm = _alarm(spec)
    path = status.get("resumeFrom") if "resumeFrom" in status else spec.get("lastGoodCheckpoint")
    named = None if not path else {
        "path": path, "step": status.get("resumeFromStep", spec.get("lastGoodCheckpointStep")),
        "sha256": status.get("resumeFromSha256") or spec.get("lastGoodCheckpointSha256"),
        "keptFrom": alarm.get("last_good_checkpoint_kept_from")}
    resumed = status.get("resumed")
    return {"named": named, "resumed": dict(resumed) if isinstance(resumed, Mapping) else None}


def _entry(time: Any, what: str, who: str, detail: str = "", source: str = "") -> dict[str, Any]:
    return {"time": time, "what": what, "who": who, "detail": detail, "object": source}


def decisions(incident: Mapping[str, Any], replacements: Iterable[Mapping[str, Any]],
              trusted: Callable[[Mapping[str, Any]], bool]) -> list[dict[str, Any]]:
    """Every decision and action, oldest first, with who made it: the incident's own timeline
    (opened, suspended, cordoned, repeat offender, resolved, resumed: the operator, or the job for a
    resume) and each NodeReplacement's (health check and its result, approval or denial by the
    person admission recorded, replacement, release)."""
    meta = incident.get("metadata") or {}
    ref = f"SDCIncident {meta.get('namespace')}/{meta.get('name')}"
    out = []
    for e in (incident.get("status") or {}).get("timeline") or []:
        who = "the job (its resume record, signed by its sidecar)" if e.get("event") == "Resumed" else OPERATOR
        out.append(_entry(e.get("time"), e.get("event") or "", who, e.get("message") or "", ref))
    for body in replacements:
        name = (body.get("metadata") or {}).get("name")
        source = f"NodeReplacement {name}"
        spec, status = body.get("spec") or {}, body.get("status") or {}
        if not trusted(body):
            out.append(_entry(None, "Replacement", UNSEALED, "its status was not written by the sdcguard operator: "
                              "its phase, health check and decision are not shown", source))
            continue
        decision = status.get("decision") or {}
        decided = None
        if decision.get("decision"):
            groups = [g for g in decision.get("groups") or [] if g != "system:authenticated"]
            who = str(decision.get("by") or "unknown") + (f" (groups: {', '.join(groups)})" if groups else "")
            decided = _entry(decision.get("time"), str(decision["decision"]), who, decision.get("reason") or "", source)
        for e in status.get("timeline") or []:
            event = e.get("event") or ""
            if event in ("Approved", "Denied") and decided is not None:
                out.append(decided)  # in the timeline's place (times have whole seconds), with who decided
                decided = None
                continue  # a later "Denied" is the operator acting on it (the node uncordoned)
            who = OPERATOR
            if event == "Released":
                who = (status.get("released") or {}).get("by") or spec.get("releasedBy") or "unknown"
            out.append(_entry(e.get("time"), event, who, e.get("message") or "", source))
        if decided is not None:
            out.append(decided)
    return sorted(out, key=lambda e: (history.seconds(e["time"]) is None, history.seconds(e["time"]) or 0.0))


def build(incident: Mapping[str, Any], replacements: Iterable[Mapping[str, Any]] = (),
          trusted: Callable[[Mapping[str, Any]], bool] = lambda _: True) -> dict[str, Any]:
    """The evidence report of one incident (a JSON-ready dict). ``replacements``: the
    NodeReplacements its ``status.replacements`` names (those found); ``trusted``: whether a
    NodeReplacement's status is the operator's sealed record."""
    meta, spec, status = incident.get("metadata") or {}, incident.get("spec") or {}, incident.get("status") or {}
    replacements = list(replacements)
    job = spec.get("job") or {}
    return {
        "incident": {"namespace": meta.get("namespace"), "name": meta.get("name"), "phase": status.get("phase"),
                     "created": meta.get("creationTimestamp"), "alarms": status.get("alarmCount"),
                     "job": {"kind": job.get("kind"), "namespace": job.get("namespace"), "name": job.get("name"),
                             "uid": spec.get("jobUid") or job.get("uid")}},
        "signature": signature(spec),
        "affected": affected(spec, status),
        "inventory": inventory(status),
        "steps": steps(spec, status),
        "checkpoints": checkpoints(spec, status),
        "decisions": decisions(incident, replacements, trusted),
        "replacements": [{"name": (r.get("metadata") or {}).get("name"),
                          "node": (r.get("spec") or {}).get("nodeName"),
                          "instanceId": (r.get("spec") or {}).get("instanceId"),
                          "phase": (r.get("status") or {}).get("phase") if trusted(r) else UNSEALED,
                          "healthCheck": ((r.get("status") or {}).get("healthCheck") or {}).get("result")
                          if trusted(r) else UNSEALED} for r in replacements],
        "repeatOffenders": status.get("repeatOffenders"),
        "telemetry": status.get("telemetry"),
        "cost": status.get("cost"),
        # The replacements' phases as the incident last read them (names only: a missing one is listed).
        "replacementsNamed": dict(status.get("replacements") or {}),
        "conditions": [{k: c.get(k) for k in ("type", "status", "reason", "message", "lastTransitionTime")}
                       for c in status.get("conditions") or []],
    }


# --- text ---------------------------------------------------------------------------------------

def _flat(value: Any) -> str:
    """One line (a value can never start a line of its own in the report), ``-`` for nothing."""
    if value is None or value == "":
        return "-"
    text = value if isinstance(value, str) else json.dumps(value, sort_keys=True)
    return " ".join(text.split())


def _who(identity: Mapping[str, Any]) -> str:
    gpu = identity.get("gpu") or {}
    where = f"instance {_flat(identity.get('instanceId'))}"
    if gpu:
        where += f", GPU {_flat(gpu.get('index'))}" + (f" {_flat(gpu['uuid'])}" if gpu.get("uuid") else "")
    return f"rank {_flat(identity.get('rank'))}: pod {_flat(identity.get('pod'))} on node {_flat(identity.get('node'))} ({where})"


def render(report: Mapping[str, Any]) -> str:
    """The report as text, section by section (every value on its own line, flattened)."""
    lines: list[str] = []
    add = lines.append
    inc, sig = report["incident"], report["signature"]
    job = inc["job"]
    add(f"SDCIncident {_flat(inc['namespace'])}/{_flat(inc['name'])}   phase {_flat(inc['phase'])}   "
        f"created {_flat(inc['created'])}")
    add(f"Job: {_flat(job['kind'])} {_flat(job['namespace'])}/{_flat(job['name'])} (uid {_flat(job['uid'])})")
    add("")
    add("Fault signature")
    add(f"  check {_flat(sig['check'])} at step {_flat(sig['step'])}, alarm {_flat(sig['alarmId'])} at "
        f"{_flat(sig['time'])}; {'signed' if sig['signed'] else 'UNSIGNED'}; "
        f"{'ambiguous' if sig['ambiguous'] else 'not ambiguous'}{'; DRILL (synthetic fault)' if sig['drill'] else ''}")
    for name, value in sorted((sig.get("evidence") or {}).items()):
        add(f"  evidence {_flat(name)}: {_flat(value)}")
    aff = report["affected"]
    add("")
    add(f"Affected: ranks {_flat(', '.join(str(r) for r in aff['ranks']))}")
    for suspect in aff["suspects"]:
        add(f"  suspect {_who(suspect)}")
    if aff.get("reporter"):
        add(f"  reported by {_who(aff['reporter'])}")
    add("")
    inv = report["inventory"]
    if inv is None:
        add(f"Inventory at the time: {NOT_RECORDED} (incident opened by an older operator)")
    else:
        add(f"Inventory at the time ({_flat(inv['recordedAt'])}): {len(inv['pods'])} pods, {len(inv['nodes'])} nodes, "
            f"{len(inv['instances'])} instances" + (f"; incomplete: {_flat(inv['error'])}" if inv.get("error") else ""))
        for pod in inv["pods"]:
            node = pod.get("node")
            instance = (inv["nodes"].get(node) or {}).get("instanceId") if node else None
            add(f"  pod {_flat(pod.get('pod'))} ({_flat(pod.get('replicaType'))} {_flat(pod.get('replicaIndex'))}, "
                f"{_flat(pod.get('phase'))}) on node {_flat(node)} instance {_flat(instance)}")
        for node, where in sorted(inv["nodes"].items()):
            if not any(p.get("node") == node for p in inv["pods"]):
                add(f"  node {_flat(node)}: {_flat(where)}")
    st = report["steps"]
    window = st["suspectWindow"]
    add("")
    add(f"Steps: alarm at {_flat(st['alarmStep'])}; suspect window {_flat(window['firstStep'])}-"
        f"{_flat(window['lastStep'])}; {_flat(st['stepsAtRisk'])} steps at risk; last verified "
        f"{_flat(st['lastVerifiedStep'])}, last audited {_flat(st['lastAuditedStep'])}, weights last verified "
        f"{_flat(st['lastWeightsVerifiedStep'])}")
    cp = report["checkpoints"]
    add("")
    add("Checkpoints")
    named = cp["named"]
    add("  named by the alarm: " + ("none verified (resume from the start)" if not named else
        f"{_flat(named['path'])} step {_flat(named['step'])} sha256 {_flat(named['sha256'])}"
        + (f" (kept from {_flat(named['keptFrom'])})" if named.get("keptFrom") else "")))
    resumed = cp["resumed"]
    if not resumed:
        add("  resumed from: not yet (no resume record of this job reached the incident)")
    else:
        verdict = "the checkpoint named" if resumed.get("matchesNamedCheckpoint") else "NOT the checkpoint named"
        if resumed.get("beforeSuspectWindow") is False:
            verdict += ", INSIDE or after the suspect window"
        add(f"  resumed from: {_flat(resumed.get('path'))} step {_flat(resumed.get('step'))} sha256 "
            f"{_flat(resumed.get('sha256'))} at {_flat(resumed.get('time'))} by pod {_flat(resumed.get('pod'))} "
            f"({verdict})")
    add("")
    add("Decisions (who, when)")
    for e in report["decisions"]:
        add(f"  {_flat(e['time'])}  {_flat(e['what'])}  by {_flat(e['who'])}  [{_flat(e['object'])}]  "
            f"{_flat(e['detail'])}")
    for r in report["replacements"]:
        add(f"  NodeReplacement {_flat(r['name'])}: node {_flat(r['node'])} instance {_flat(r['instanceId'])}, phase "
            f"{_flat(r['phase'])}, health check {_flat(r['healthCheck'])}")
    missing = sorted(set(report["replacementsNamed"]) - {r["name"] for r in report["replacements"]})
    for name in missing:
        add(f"  NodeReplacement {_flat(name)}: not found (last phase the incident read: "
            f"{_flat(report['replacementsNamed'][name])})")
    add("")
    offenders = report.get("repeatOffenders")
    if offenders is None:
        add(f"Repeat offenders: {NOT_RECORDED}")
    elif not offenders:
        add("Repeat offenders: none (no other incident named this hardware within the window)")
    else:
        add("Repeat offenders")
        for o in offenders:
            add(f"  {_flat(o.get('kind'))} {_flat(o.get('id'))} on node {_flat(o.get('node'))}: "
                f"{len(o.get('incidents') or [])} incidents in {_flat(o.get('jobs'))} jobs: "
                f"{_flat(', '.join(o.get('incidents') or []))}")
    add("")
    telemetry = report.get("telemetry")
    if not telemetry:
        add(f"Telemetry: {NOT_RECORDED}")
    else:
        add(f"Telemetry: {_flat(telemetry_line(telemetry))}: {_flat(telemetry.get('message'))}")
        for finding in telemetry.get("findings") or []:
            add(f"  finding: {_flat(finding)}")
    add("")
    cost = report.get("cost")
    if not cost:
        add(f"Cost: {NOT_RECORDED}")
    else:
        add("Cost: " + "; ".join(f"{_flat(k)} {_flat(v)}" for k, v in sorted(cost.items())))
    return "\n".join(lines)
