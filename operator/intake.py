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
import threading
import time
from typing import Any

import kopf

from sdcguard.contract import names
from sdcguard.contract.text import strip_format_characters

from . import incident, kube, ledger, metrics, signature_check, validate
from .settings import Settings


def receive(event: dict[str, Any], settings: Settings, logger: logging.Logger | logging.LoggerAdapter,
            final: bool = True) -> str:
    """The alarm Event handler's work: handle the Event and record the outcome on it; returns it.
    ``final``: kopf will not try again (its last retry), so a transient failure is a rejection too."""
    return record(event, handle(event, settings, logger, final=final))


def handle(event: dict[str, Any], settings: Settings, logger: logging.Logger | logging.LoggerAdapter,
           final: bool = True) -> str:
    """Process one alarm Event; returns the outcome ("incident:<name>", "joined:<name>", "rejected:<reason>").

    Never a silent drop: a failure that is not a rejection — a crafted record the checks did not
    foresee, an object the operator cannot write — becomes the rejection ``IntakeError`` (counted,
    logged, a Warning Event, the ``SdcguardAlarmsRejected`` alert); only a transient API error (or a
    write still conflicting after its fresh reads) is raised for kopf to retry, and on kopf's last
    try it is an ``IntakeError`` as well."""
    recorded = (event["metadata"].get("annotations") or {}).get(names.INTAKE_ANNOTATION)
    if recorded:
        return recorded
    try:
        return _handle(event, settings, logger)
    except Exception as exc:  # noqa: BLE001 - every failure ends as a counted rejection or a retry
        if kube.worth_retrying(exc) and not final:
            raise
        return _reject(event, settings, logger, validate.Rejected(
            "IntakeError", f"handling failed ({type(exc).__name__}: {str(exc)[:300]})"))


class RateLimiter:
    """A token bucket per namespace: ``rate_per_minute`` Events, ``burst`` at once (in memory: a
    restarted or new leader starts with full buckets). An Event let through once (``key``: its
    uid) is let through again: kopf's retry of a transient failure spends no second token."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._buckets: dict[str, tuple[float, float]] = {}
        self._admitted: dict[str, float] = {}
        self.reported: dict[str, float] = {}

    def allow(self, namespace: str, settings: Settings, now: float | None = None, key: str | None = None) -> bool:
        if not settings.alarm_rate_per_minute:
            return True
        now = time.monotonic() if now is None else now
        with self._lock:
            if key is not None and key in self._admitted:
                return True
            tokens, then = self._buckets.get(namespace, (float(settings.alarm_burst), now))
            tokens = min(float(settings.alarm_burst), tokens + (now - then) * settings.alarm_rate_per_minute / 60.0)
            allowed = tokens >= 1.0
            self._buckets[namespace] = (tokens - 1.0 if allowed else tokens, now)
            if allowed and key is not None:
                self._admitted[key] = now
            if len(self._buckets) > 4096:  # forget namespaces whose buckets are full again
                self._buckets = {k: v for k, v in self._buckets.items() if now - v[1] < 3600}
            if len(self._admitted) > 4096:  # kopf's retries of an Event end within the hour
                self._admitted = {k: t for k, t in self._admitted.items() if now - t < 3600}
            return allowed


LIMITER = RateLimiter()


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
        namespace = event["metadata"].get("namespace") or ""
        if not LIMITER.allow(namespace, settings, key=event["metadata"].get("uid")):
            raise validate.Rejected("RateLimited", f"namespace {namespace} posted more than "
                                    f"{settings.alarm_rate_per_minute:g} alarm Events a minute (burst "
                                    f"{settings.alarm_burst}; SDCGUARD_ALARM_RATE_PER_MINUTE)")
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
        if existing is not None and (existing.get("spec") or {}).get("event") == event_name:
            # kopf's retry of the Event that opened it (its outcome's write failed): not a duplicate
            _check_ours(existing, settings)
            return f"incident:{name}"
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
        _check_incident_cap(namespace, record, job_uid, settings)
        name, created = incident.open_or_join(record, event_name, text, signature, job_uid, settings)
        if not created:
            _check_ours(incident.find(namespace, name) or {}, settings)
    except validate.Rejected as rejected:
        return _reject(event, settings, logger, rejected)
    metrics.ALARMS_ACCEPTED.labels("new" if created else "duplicate").inc()
    logger.info(f"alarm {record['id']} -> incident {namespace}/{name} ({'new' if created else 'joined'})")
    return f"{'incident' if created else 'joined'}:{name}"


def _reject(event: dict[str, Any], settings: Settings, logger: logging.Logger | logging.LoggerAdapter,
            rejected: validate.Rejected) -> str:
    """Count, log and report a rejection (a Warning Event; for ``RateLimited`` at most one a minute
    per namespace, so a flood does not become a flood of the operator's Events)."""
    event_name = event["metadata"]["name"]
    message = strip_format_characters(rejected.message)
    metrics.ALARMS_REJECTED.labels(rejected.reason).inc()
    logger.warning(f"alarm Event {event_name} rejected: {rejected.reason}: {message}")
    namespace = event["metadata"].get("namespace") or ""
    now = time.monotonic()
    if rejected.reason != "RateLimited" or now - LIMITER.reported.get(namespace, -120.0) >= 60.0:
        if rejected.reason == "RateLimited":
            LIMITER.reported[namespace] = now
        try:
            kopf.event(_report_target(event, settings), type="Warning", reason="AlarmRejected",
                       message=f"alarm Event {event_name} rejected ({rejected.reason}): {message}"[:1000])
        except Exception as exc:  # noqa: BLE001 - the rejection is counted and logged already
            logger.warning(f"could not post the rejection Event: {exc}")
    return f"rejected:{rejected.reason}"


def _check_incident_cap(namespace: str, record: dict[str, Any], job_uid: str, settings: Settings) -> None:
    """A job instance may open at most ``max_incidents_per_job`` SDCIncidents (a new fault past it is
    rejected; the label selector is applied here too, the emulator ignores it)."""
    if not settings.max_incidents_per_job:
        return
    job = record["job"]["name"]
    items = kube.custom().list_namespaced_custom_object(
        names.GROUP, names.VERSION, namespace, names.INCIDENTS,
        label_selector=f"{names.INCIDENT_JOB_LABEL}={job[:63]}").get("items") or []
    mine = [i for i in items if (i.get("spec") or {}).get("jobUid") == job_uid
            and ((i.get("metadata") or {}).get("labels") or {}).get(names.INCIDENT_JOB_LABEL) == job[:63]]
    if len(mine) >= settings.max_incidents_per_job:
        raise validate.Rejected("TooManyIncidents", f"{names.JOB_KIND} {job} (uid {job_uid}) already has "
                                f"{len(mine)} SDCIncidents (SDCGUARD_MAX_INCIDENTS_PER_JOB)")


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
