"""An alarm record as the core ``v1`` Event that docs/design.md §4 defines (built here, posted by the sidecar).

The Event's name is a pure function of the alarm id, so a sidecar that crashed after the API
server stored the Event but before it moved the record out of the spool collides with its own
earlier Event (HTTP 409) instead of publishing a duplicate.

Signed alarms (docs/design.md §4): the sidecar adds ``sdcguard.dev/alarm-signature: v1=<hex HMAC-SHA256(key,
UTF-8 bytes of the sdcguard.dev/alarm annotation value)>`` with the job's key; the operator checks
it with :func:`signature_matches` (constant time) before it acts on anything. Standard library only.
"""
from __future__ import annotations

import hashlib
import hmac
import re
from typing import Any, Mapping

from . import alarm as _alarm
from . import names

_NOT_DNS = re.compile(r"[^a-z0-9-]+")
_SLUG_MAX = 200  # a DNS subdomain may be 253 characters; leave room for prefix and digest


def event_name(alarm_id: str) -> str:
    """A valid, deterministic Event name for an alarm id: a readable slug plus a digest of the
    exact id (two ids that slug alike still get different names)."""
    slug = _NOT_DNS.sub("-", alarm_id.lower()).strip("-")[:_SLUG_MAX].strip("-") or "alarm"
    digest = hashlib.sha256(alarm_id.encode("utf-8")).hexdigest()[:10]
    return f"sdcguard-{slug}-{digest}"


def alarm_signature(key: bytes, annotation: str) -> str:
    """The signature annotation's value for the exact alarm annotation text."""
    digest = hmac.new(key, annotation.encode("utf-8"), hashlib.sha256).hexdigest()
    return f"{names.ALARM_SIGNATURE_SCHEME}={digest}"


def signature_matches(key: bytes, annotation: str, signature: str) -> bool:
    """Whether ``signature`` signs ``annotation`` with ``key``; compared in constant time."""
    return hmac.compare_digest(alarm_signature(key, annotation).encode("ascii"),
                               signature.encode("utf-8", "surrogatepass"))


def event_namespace(record: Mapping[str, Any], fallback: str) -> str:
    """The job's namespace; ``fallback`` (the sidecar's own namespace) outside a job."""
    job = record.get("job")
    return job["namespace"] if job else fallback


def involved_pod(record: Mapping[str, Any]) -> str | None:
    """The first suspect's pod, else the reporter's pod (docs/design.md §4); None outside Kubernetes."""
    for suspect in record.get("suspects") or []:
        if suspect.get("pod"):
            return suspect["pod"]
    return (record.get("reporter") or {}).get("pod")


def message(record: Mapping[str, Any]) -> str:
    """One human line: what fired, where, who is suspected, and from where to resume."""
    job = record.get("job")
    where = f" in {job['kind']} {job['namespace']}/{job['name']}" if job else ""
    suspects = record.get("suspects") or []
    if not suspects:
        who = "no rank can be named (the fault is in the reduced gradient)"
    else:
        names = ", ".join(
            f"rank {s['rank']}" + (f" (pod {s['pod']} on node {s['node']})" if s.get("pod") else "")
            for s in suspects
        )
        who = ("ambiguous between " if record.get("ambiguous") else "suspect ") + names
    tail = f"; last verified step {record.get('last_verified_step')}"
    if record.get("last_good_checkpoint"):
        tail += f", last good checkpoint {record['last_good_checkpoint']}"
    return f"Silent data corruption caught by check {record['check']} at step {record['step']}{where}: {who}{tail}"


def build_event(
    record: Mapping[str, Any], *, fallback_namespace: str, fallback_pod: str | None = None,
    host: str | None = None, key: bytes | None = None,
) -> dict[str, Any]:
    """The Event body for one validated alarm record (a plain dict, ready to POST), signed with
    ``key`` when one is given."""
    namespace = event_namespace(record, fallback_namespace)
    pod = involved_pod(record) or fallback_pod
    if pod:
        involved = {"apiVersion": "v1", "kind": "Pod", "name": pod, "namespace": namespace}
    elif record.get("job"):
        job = record["job"]
        involved = {"apiVersion": names.JOB_API_VERSION, "kind": job["kind"], "name": job["name"],
                    "namespace": namespace}
    else:
        raise ValueError("alarm names no pod and no job: nothing for the Event to be about")
    source: dict[str, str] = {"component": names.EVENT_COMPONENT}
    if host:
        source["host"] = host
    text = _alarm.dumps(record)
    annotations = {names.ALARM_ANNOTATION: text}
    if key is not None:
        annotations[names.ALARM_SIGNATURE_ANNOTATION] = alarm_signature(key, text)
    return {
        "apiVersion": "v1",
        "kind": "Event",
        "metadata": {
            "name": event_name(record["id"]),
            "namespace": namespace,
            "labels": {names.CHECK_LABEL: _NOT_DNS.sub("-", str(record["check"]).lower())[:63].strip("-")},
            "annotations": annotations,
        },
        "type": "Warning",
        "reason": names.EVENT_REASON,
        "message": message(record),
        "involvedObject": involved,
        "source": source,
        "firstTimestamp": record["time"],
        "lastTimestamp": record["time"],
        "count": 1,
        "reportingComponent": names.EVENT_COMPONENT,
        "reportingInstance": fallback_pod or names.EVENT_COMPONENT,
    }


def resume_event_name(resume_id: str) -> str:
    """The resume record's Event name: deterministic, like an alarm's (a resent record collides)."""
    return event_name(f"resume-{resume_id}")


def resume_message(record: Mapping[str, Any]) -> str:
    checkpoint = record["checkpoint"]
    job = record["job"]
    digest = f", sha256 {checkpoint['sha256'][:12]}" if checkpoint.get("sha256") else ""
    return (f"{job['kind']} {job['namespace']}/{job['name']} resumed from checkpoint {checkpoint['path']} "
            f"(step {checkpoint['step']}{digest})")


def build_resume_event(record: Mapping[str, Any], *, fallback_pod: str | None = None, host: str | None = None,
                       key: bytes | None = None) -> dict[str, Any]:
    """The Event for one validated resume record (:mod:`.resume`): reason ``SilentDataCorruption``
    (so the operator's one watch sees it, and ``kubectl get events --field-selector
    reason=SilentDataCorruption`` shows a job's alarms and its resumes together), type Normal, the
    record in ``sdcguard.dev/resume``, signed with ``key`` as an alarm is."""
    from . import resume as _resume
    job = record["job"]
    pod = (record.get("reporter") or {}).get("pod") or fallback_pod
    involved = ({"apiVersion": "v1", "kind": "Pod", "name": pod, "namespace": job["namespace"]} if pod else
                {"apiVersion": names.JOB_API_VERSION, "kind": job["kind"], "name": job["name"],
                 "namespace": job["namespace"]})
    text = _resume.dumps(record)
    annotations = {names.RESUME_ANNOTATION: text}
    if key is not None:
        annotations[names.ALARM_SIGNATURE_ANNOTATION] = alarm_signature(key, text)
    source: dict[str, str] = {"component": names.EVENT_COMPONENT}
    if host:
        source["host"] = host
    return {
        "apiVersion": "v1", "kind": "Event",
        "metadata": {"name": resume_event_name(record["id"]), "namespace": job["namespace"],
                     "annotations": annotations},
        "type": "Normal", "reason": names.EVENT_REASON, "message": resume_message(record),
        "involvedObject": involved, "source": source,
        "firstTimestamp": record["time"], "lastTimestamp": record["time"], "count": 1,
        "reportingComponent": names.EVENT_COMPONENT, "reportingInstance": fallback_pod or names.EVENT_COMPONENT,
    }
