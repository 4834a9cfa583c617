"""SDCIncident: one per fault (job, check, step), and its containment flow (SPEC §6.3-6.4, 6.8).

Duplicate alarms of one fault (every rank reporting it, a resent Event) map to the same name, so
the API server's create conflict is what joins them: no in-memory dedup to lose on restart.

The spec is the validated alarm; the status opens with the recovery plan taken from it
(:func:`recovery`): the checkpoint to resume from and its step, the suspect window, and how many
steps are at risk (redone after resuming). Records from older libraries lack some of these
fields; they are then left out of the status (a merge patch drops nulls), never guessed.
"""
from __future__ import annotations

import hashlib
import re
from typing import Any

import kopf

from sdcguard.contract import names

from . import contain, hyperpod, kube, localize, metrics, replacement
from .settings import Settings


def incident_name(record: dict[str, Any]) -> str:
    """DNS-1123 name from (job, check, step); long job names keep a hash so names stay unique."""
    raw = f"{record['job']['name']}-{record['check']}-{record['step']}".lower()
    name = re.sub(r"[^a-z0-9-]+", "-", raw).strip("-")
    if len(name) > 63:
        digest = hashlib.sha256(raw.encode()).hexdigest()[:8]
        name = f"{name[:54].rstrip('-')}-{digest}"
    return name


def find(namespace: str, name: str) -> dict[str, Any] | None:
    try:
        return kube.get_incident(namespace, name)
    except Exception as exc:
        if kube.not_found(exc):
            return None
        raise


def manifest(record: dict[str, Any], event_name: str) -> dict[str, Any]:
    job = record["job"]
    window = record.get("suspect_window") or {"first_step": record["step"], "last_step": record["step"]}
    return {
        "apiVersion": names.API_VERSION, "kind": "SDCIncident",
        "metadata": {"name": incident_name(record), "namespace": job["namespace"],
                     "labels": {names.INCIDENT_JOB_LABEL: job["name"][:63]}},
        "spec": {
            "job": dict(job), "check": record["check"], "step": record["step"], "ambiguous": record["ambiguous"],
            "suspects": [dict(s) for s in record["suspects"]], "reporter": dict(record["reporter"]),
            "suspectWindow": {"firstStep": window.get("first_step"), "lastStep": window.get("last_step")},
            "lastVerifiedStep": record["last_verified_step"], "lastGoodCheckpoint": record["last_good_checkpoint"],
            "alarmId": record["id"], "event": event_name, "alarm": record,
        },
    }


def recovery(spec: dict[str, Any]) -> dict[str, Any]:
    """The recovery plan of an incident, as status fields, from its spec (the alarm)."""
    alarm = spec.get("alarm") or {}
    window = spec.get("suspectWindow") or {}
    first, last = _step(window.get("firstStep")), _step(window.get("lastStep"))
    resume_step = _step(alarm.get("last_good_checkpoint_step"))
    at_risk = _step(alarm.get("steps_at_risk"))
    if at_risk is None and resume_step is not None:
        at_risk = spec["step"] - resume_step
    return {
        "resumeFrom": spec.get("lastGoodCheckpoint"),
        "resumeFromStep": resume_step,
        "suspectWindow": {"firstStep": first, "lastStep": last, "range": window_range(first, last)},
        "stepsAtRisk": at_risk,
        "lastAuditedStep": _step(alarm.get("last_audited_step")),
        "lastWeightsVerifiedStep": _step(alarm.get("last_weights_verified_step")),
    }


def window_range(first: int | None, last: int | None) -> str:
    """``first-last`` as ``kubectl get`` shows it (``?`` for an unknown end)."""
    return f"{'?' if first is None else first}-{'?' if last is None else last}"


def resume_text(status: dict[str, Any]) -> str:
    """Where to resume, for messages: ``ckpt.pt (step 19)``, or that there is no verified checkpoint."""
    path, step = status.get("resumeFrom"), status.get("resumeFromStep")
    if not path:
        return "no verified checkpoint"
    return f"{path} (step {step})" if step is not None else str(path)


def _step(value: Any) -> int | None:
    """An optional step of the alarm record: an integer, else None (the CRD schema wants integers)."""
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def open_or_join(record: dict[str, Any], event_name: str) -> tuple[str, bool]:
    """Create the incident, or join the existing one; (name, created)."""
    body = manifest(record, event_name)
    namespace, name = body["metadata"]["namespace"], body["metadata"]["name"]
    try:
        kube.custom().create_namespaced_custom_object(names.GROUP, names.VERSION, namespace, names.INCIDENTS, body)
    except Exception as exc:
        if not kube.conflict(exc):
            raise
        join(namespace, name, record["id"], event_name)
        return name, False
    metrics.INCIDENTS.labels(record["check"]).inc()
    return name, True


def join(namespace: str, name: str, alarm_id: str, event_name: str) -> None:
    """Record a duplicate alarm once (idempotent: the same Event seen again changes nothing)."""
    def change(status: dict[str, Any]) -> dict[str, Any]:
        duplicates = list(status.get("duplicates") or [])
        if any(d.get("event") == event_name for d in duplicates):
            return {}
        duplicates.append({"alarmId": alarm_id, "event": event_name, "time": kube.now()})
        timeline = list(status.get("timeline") or []) + [{
            "time": kube.now(), "event": "DuplicateAlarm", "message": f"alarm {alarm_id} (Event {event_name}) joined"}]
        return {"duplicates": duplicates, "alarmCount": len(duplicates) + 1, "timeline": timeline}
    kube.update_status(names.INCIDENTS, namespace, name, change)


def reconcile(body: dict[str, Any], settings: Settings) -> None:
    """Contain an incident: suspend, cordon (storm guard), localize, open NodeReplacements.

    Idempotent: every step checks the status (and the cluster) first, so on.create, on.resume and
    retries can all call it.  Raises kopf.TemporaryError while the storm guard holds a node back.
    """
    namespace, name = body["metadata"]["namespace"], body["metadata"]["name"]
    spec = body["spec"]
    ref = f"{namespace}/{name}"
    status = kube.get_incident(namespace, name).get("status") or {}
    if not status.get("phase"):
        status = _open(namespace, name, spec)
    elif "suspectWindow" not in status:  # opened by an operator that did not record the plan yet
        status = _backfill_recovery(namespace, name, spec)
    status = _suspend(namespace, name, spec, status, settings)
    held = _cordon_all(namespace, name, ref, spec, status, settings)
    status = kube.get_incident(namespace, name).get("status") or {}
    _open_replacements(namespace, name, ref, status, settings)
    if held:
        if not kube.is_true(status, "StormGuard"):
            _record(namespace, name, "StormGuard",
                    f"{held} not cordoned: {settings.max_concurrent_suspect_nodes} suspect nodes already "
                    "cordoned (maxConcurrentSuspectNodes)",
                    only_if=lambda st: not kube.is_true(st, "StormGuard"),
                    conditions=[kube.condition("StormGuard", True, "MaxConcurrentSuspectNodes",
                                               f"held back: {', '.join(held)}")])
        raise kopf.TemporaryError(f"storm guard holds {held}", delay=settings.storm_guard_recheck_seconds)
    status = kube.get_incident(namespace, name).get("status") or {}
    if kube.is_true(status, "StormGuard"):
        _record(namespace, name, "StormGuardReleased", "every suspect node is now cordoned",
                only_if=lambda st: kube.is_true(st, "StormGuard"),
                conditions=[kube.condition("StormGuard", False, "SlotFree", "all suspect nodes cordoned")])
    if status.get("phase") == "Containing":
        waiting = bool(status.get("replacements"))
        _record(namespace, name, "Contained",
                "awaiting approval of node replacement" if waiting else "contained; no node to replace",
                phase="AwaitingApproval" if waiting else "Contained", only_if=lambda st: st.get("phase") == "Containing",
                conditions=[kube.condition("Contained", True, "Contained", "job and suspect nodes contained")])
    sync(ref)


def sync(ref: str) -> None:
    """Re-read the incident's NodeReplacements: a progress note lost to a crash is made up for here."""
    for replacement_name in (kube.get_incident(*ref.split("/", 1)).get("status") or {}).get("replacements") or {}:
        try:
            phase = (kube.get_replacement(replacement_name).get("status") or {}).get("phase")
        except Exception as exc:
            if kube.not_found(exc):
                continue
            raise
        if phase:
            note(ref, "", "", replacement_name, phase)


def _open(namespace: str, name: str, spec: dict[str, Any]) -> dict[str, Any]:
    """First record, with the recovery plan; duplicates may have joined already (their count is kept)."""
    plan = recovery(spec)
    at_risk = f", {plan['stepsAtRisk']} steps at risk" if plan["stepsAtRisk"] is not None else ""
    message = (f"{spec['check']} alarm at step {spec['step']} naming "
               f"{', '.join(str(s['node']) for s in spec['suspects']) or 'no rank'}; resume from "
               f"{resume_text(plan)}{at_risk}")

    def change(status: dict[str, Any]) -> dict[str, Any]:
        if status.get("phase"):
            return {}  # opened meanwhile (a retry whose first write landed)
        return {"phase": "Containing", **plan,
                "alarmCount": 1 + len(status.get("duplicates") or []),
                "timeline": [{"time": kube.now(), "event": "Opened", "message": message}]
                + list(status.get("timeline") or [])}
    return kube.update_status(names.INCIDENTS, namespace, name, change).get("status") or {}


def _backfill_recovery(namespace: str, name: str, spec: dict[str, Any]) -> dict[str, Any]:
    """Add the recovery plan to an incident opened without it; the timeline is left as it is."""
    return kube.update_status(names.INCIDENTS, namespace, name,
                              lambda status: {} if "suspectWindow" in status else recovery(spec)).get("status") or {}


def _record(namespace: str, name: str, event: str, message: str, **fields: Any) -> dict[str, Any]:
    """One transition; ``only_if`` makes it happen once when handlers race (the timer and on.create)."""
    return kube.record(names.INCIDENTS, namespace, name, event, message, **fields).get("status") or {}


def _no_condition(type_: str) -> Any:
    return lambda status: not any(c.get("type") == type_ for c in status.get("conditions") or [])


def _node_unset(node: str, key: str) -> Any:
    return lambda status: not ((status.get("nodes") or {}).get(node) or {}).get(key)


def needs_work(status: dict[str, Any], **_: Any) -> bool:
    """Level-triggered safety net (a kopf timer): an incident not yet contained, or held by the
    storm guard, is reconciled again even if a lost progress patch left kopf nothing to retry."""
    return status.get("phase") in (None, "Containing") or kube.is_true(status, "StormGuard")


def _suspend(namespace: str, name: str, spec: dict[str, Any], status: dict[str, Any], settings: Settings) -> dict[str, Any]:
    if not settings.suspend_jobs or any(c.get("type") == "JobSuspended" for c in status.get("conditions") or []):
        return status
    job = spec["job"]
    if contain.suspend_job(job):
        return _record(namespace, name, "JobSuspended", f"PyTorchJob {job['name']}: spec.runPolicy.suspend=true",
                       only_if=_no_condition("JobSuspended"),
                       conditions=[kube.condition("JobSuspended", True, "Suspended", "suspended by sdcguard; "
                                                  "resume it yourself from status.resumeFrom")])
    return _record(namespace, name, "JobNotSuspended", f"PyTorchJob {job['name']} no longer exists",
                   only_if=_no_condition("JobSuspended"),
                   conditions=[kube.condition("JobSuspended", False, "JobNotFound", "the job no longer exists")])


def _cordon_all(namespace: str, name: str, ref: str, spec: dict[str, Any], status: dict[str, Any],
                settings: Settings) -> list[str]:
    """Cordon every suspect node not yet recorded as cordoned; return those the storm guard holds."""
    held = []
    nodes = dict.fromkeys(s["node"] for s in spec["suspects"] if s.get("node"))
    recorded = status.get("nodes") or {}
    for node in nodes:
        if (recorded.get(node) or {}).get("cordoned") or (recorded.get(node) or {}).get("missing"):
            continue
        outcome = contain.cordon(node, ref, settings)
        if outcome == "storm-guard":
            held.append(node)
        elif outcome == "missing":
            _record(namespace, name, "NodeMissing", f"node {node} no longer exists", nodes={node: {"missing": True}},
                    only_if=_node_unset(node, "missing"))
        else:
            text = f"cordoned and labelled {names.SUSPECT_LABEL}=true" if outcome == "cordoned" else \
                "already cordoned as suspect by another incident"
            _record(namespace, name, "NodeCordoned", f"{node}: {text}", only_if=_node_unset(node, "cordoned"),
                    nodes={node: {"cordoned": True, "cordonedAt": kube.now()}},
                    conditions=[kube.condition("NodesCordoned", True, "Cordoned", "suspect nodes cordoned")])
    return held


def _open_replacements(namespace: str, name: str, ref: str, status: dict[str, Any], settings: Settings) -> None:
    for node, state in (status.get("nodes") or {}).items():
        if not state.get("cordoned") or state.get("replacement") or state.get("localizeError"):
            continue
        try:
            found = localize.localize(kube.core().read_node(node), settings)
        except localize.NotLocalized as exc:
            _record(namespace, name, "NotLocalized", str(exc), nodes={node: {"localizeError": str(exc)}})
            continue
        except hyperpod.Throttled as exc:
            raise kopf.TemporaryError(f"localizing {node}: {exc}", delay=settings.retry_seconds) from None
        except hyperpod.AwsError as exc:
            _record(namespace, name, "NotLocalized", str(exc), nodes={node: {"localizeError": str(exc)}})
            continue
        replacement_name = replacement.ensure(node, found, ref)
        _record(namespace, name, "ReplacementCreated",
                f"{node} is instance {found.instance_id} of {found.cluster} (from {found.source}); "
                f"NodeReplacement {replacement_name}",
                nodes={node: {"instanceId": found.instance_id, "cluster": found.cluster,
                              "instanceGroup": found.instance_group, "replacement": replacement_name}},
                replacements={replacement_name: "Opened"}, only_if=_node_unset(node, "replacement"))


def note(ref: str, event: str, message: str, replacement_name: str, phase: str) -> None:
    """A NodeReplacement reports progress to an incident's timeline; the incident resolves when all are done."""
    namespace, name = ref.split("/", 1)

    def change(status: dict[str, Any]) -> dict[str, Any]:
        replacements = dict(status.get("replacements") or {})
        patch: dict[str, Any] = {}
        if replacements.get(replacement_name) != phase:
            replacements[replacement_name] = phase
            patch["replacements"] = replacements
        timeline = list(status.get("timeline") or [])
        if event:
            timeline.append({"time": kube.now(), "event": event, "message": message})
        if all(p in replacement.TERMINAL for p in replacements.values()) and status.get("phase") == "AwaitingApproval":
            timeline.append({"time": kube.now(), "event": "Resolved",
                             "message": f"every node replacement is done; resume from {resume_text(status)}"})
            patch["phase"] = "Resolved"
            patch["conditions"] = kube.merge_conditions(status.get("conditions") or [], [kube.condition(
                "Resolved", True, "ReplacementsDone", f"resume the job from {resume_text(status)}")])
        if len(timeline) != len(status.get("timeline") or []):
            patch["timeline"] = timeline
        return patch
    try:
        kube.update_status(names.INCIDENTS, namespace, name, change)
    except Exception as exc:
        if not kube.not_found(exc):
            raise
