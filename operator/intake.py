"""Alarm intake: an Event with reason SilentDataCorruption becomes an SDCIncident, or is rejected.

The signature comes first (:mod:`.signature_check`): an unsigned Event, or one whose signature does not
match under the key of the named job (its live uid), is rejected before anything is written.
Then the tenant boundary (docs/design.md §9): the record's ``job.uid`` and ``pod_uid`` are the live ones,
its time is fresh, its id is not in the job's ledger (:mod:`.ledger`: an id counts once, also
after its incident is gone: ``ReplayedAlarm``), and every suspect pod is controlled by the job and
runs on the node named, and is older than the alarm. A rejection is logged with its reason,
counted, reported as a Warning Event (on the operator's pod when it knows it, else on the alarm
Event's involved pod) and touches nothing else.  The outcome is written to the alarm Event's
``sdcguard.dev/intake`` annotation, and an Event that already carries one is not handled again
(the record lives in the API, not in this process: another replica or a restart sees it too).
Handling twice is harmless anyway: the incident's name is derived from the fault, and joining
records each alarm Event once.
"""
from __future__ import annotations

import logging
from typing import Any

import kopf

from sdcguard.contract import names

from . import incident, kube, ledger, metrics, signature_check, validate
from .settings import Settings


def receive(event: dict[str, Any], settings: Settings, logger: logging.Logger | logging.LoggerAdapter) -> str:
    """The alarm Event handler's work: handle the Event and record the outcome on it; returns it."""
    return record(event, handle(event, settings, logger))


def handle(event: dict[str, Any], settings: Settings, logger: logging.Logger | logging.LoggerAdapter) -> str:
    """Process one alarm Event; returns the outcome ("incident:<name>", "joined:<name>", "rejected:<reason>")."""
    recorded = (event["metadata"].get("annotations") or {}).get(names.INTAKE_ANNOTATION)
    if recorded:
        return recorded
    return _handle(event, settings, logger)


def record(event: dict[str, Any], outcome: str) -> str:
    """Write the outcome onto the alarm Event ourselves (not only through kopf's final patch, which
    is lost if the API server fails it: kopf would then never look at this Event again). Raises on
    failure, so kopf retries the handler, which then finds the outcome or recomputes it."""
    meta = event["metadata"]
    if (meta.get("annotations") or {}).get(names.INTAKE_ANNOTATION) != outcome:
        kube.core().patch_namespaced_event(meta["name"], meta["namespace"],
                                           {"metadata": {"annotations": {names.INTAKE_ANNOTATION: outcome}}})
    return outcome


def _handle(event: dict[str, Any], settings: Settings, logger: logging.Logger | logging.LoggerAdapter) -> str:
    event_name = event["metadata"]["name"]
    try:
        signature = signature_check.presented(event, settings, logger)
        record = validate.parse(event, settings)
        text = validate.annotation(event)
        job = validate.check_job(record, settings)
        job_uid = job["metadata"]["uid"]
        if signature is not None:
            signature_check.verify(record, text, signature, job_uid, settings)
        validate.check_uids(record, job_uid, settings)
        validate.check_fresh(record, settings)
        namespace, name = record["job"]["namespace"], incident.incident_name(record)
        first = ledger.claim(record, job, event_name, name, settings) == "first"
        existing = incident.find(namespace, name)
        if existing is not None:  # a duplicate of a fault already validated (or a replay while it is open)
            _check_ours(existing, settings)
            incident.join(namespace, name, record["id"], event_name)
            metrics.ALARMS_ACCEPTED.labels("duplicate").inc()
            logger.info(f"alarm {record['id']} joined incident {namespace}/{name}")
            return f"joined:{name}"
        if not first:
            raise validate.Rejected("ReplayedAlarm", f"alarm id {record['id']} was handled before (ledger "
                                    f"{namespace}/{ledger.ledger_name(record['job']['name'])}); it counts once")
        validate.check_pods(record, job_uid, settings)
        name, created = incident.open_or_join(record, event_name, text, signature, job_uid, settings)
        if not created:
            _check_ours(incident.find(namespace, name) or {}, settings)
    except validate.Rejected as rejected:
        metrics.ALARMS_REJECTED.labels(rejected.reason).inc()
        logger.warning(f"alarm Event {event_name} rejected: {rejected.reason}: {rejected.message}")
        kopf.event(_report_target(event, settings), type="Warning", reason="AlarmRejected",
                   message=f"alarm Event {event_name} rejected ({rejected.reason}): {rejected.message}"[:1000])
        return f"rejected:{rejected.reason}"
    metrics.ALARMS_ACCEPTED.labels("new" if created else "duplicate").inc()
    logger.info(f"alarm {record['id']} -> incident {namespace}/{name} ({'new' if created else 'joined'})")
    return f"{'incident' if created else 'joined'}:{name}"


def _check_ours(body: dict[str, Any], settings: Settings) -> None:
    """An incident of that name that the operator did not create is never joined (nor acted on)."""
    try:
        incident.verify(body, settings)
    except incident.NotVerified as exc:
        raise validate.Rejected("ForeignIncident", f"SDCIncident {body.get('metadata', {}).get('name')} exists but "
                                f"was not created by sdcguard ({exc.reason}: {exc.message})") from None


def _report_target(event: dict[str, Any], settings: Settings) -> dict[str, Any]:
    if settings.pod_name and settings.pod_namespace:
        return {"apiVersion": "v1", "kind": "Pod",
                "metadata": {"name": settings.pod_name, "namespace": settings.pod_namespace}}
    # kopf never posts Events about Events: report on the alarm's involved object (a pod) instead.
    involved = event.get("involvedObject") or {}
    return {"apiVersion": involved.get("apiVersion") or "v1", "kind": involved.get("kind") or "Pod",
            "metadata": {"name": involved.get("name") or "unknown",
                         "namespace": involved.get("namespace") or event["metadata"].get("namespace"),
                         "uid": involved.get("uid")}}
