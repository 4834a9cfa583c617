"""A resumed run's Event: which checkpoint the job actually resumed from reaches its incidents.

The library leaves a resume record (``sdcguard.dev/resume/v1``, :mod:`sdcguard.contract.resume`)
in the spool whenever a run starts from a checkpoint; the sidecar publishes it, signed with the
job's key, as a ``SilentDataCorruption`` Event of type Normal carrying ``sdcguard.dev/resume``.

It is checked like an alarm (:mod:`.intake`): the signature under the key of the *live* job it
names (so a tenant can write a resume only for a job whose key its sidecar holds), the Event in
the job's own namespace, the job's uid, freshness. It is then recorded, once, on each incident of
that job instance (``spec.jobUid``, the operator's sealed incidents only) opened before it and
without a resume yet: ``status.resumed`` (checkpoint path, step, sha256; whether it is the one the
alarm named and whether it lies before the suspect window) and a ``Resumed`` timeline entry. A job
deleted and created again is another instance (another uid, another key): its resumes reach no
incident of the old one. The outcome is written to the Event's ``sdcguard.dev/intake`` annotation.
"""
from __future__ import annotations

import logging
from typing import Any

from sdcguard.contract import alarm as alarm_schema
from sdcguard.contract import names
from sdcguard.contract import resume as resume_schema
from sdcguard.contract.text import strip_format_characters

from . import incident, intake, kube, signature_check, validate
from .settings import Settings


def is_resume(event: dict[str, Any]) -> bool:
    """A resume Event (and not an alarm): what the alarm Event handler hands to :func:`receive`."""
    annotations = (event.get("metadata") or {}).get("annotations") or {}
    return names.RESUME_ANNOTATION in annotations and names.ALARM_ANNOTATION not in annotations


def receive(event: dict[str, Any], settings: Settings, logger: logging.Logger | logging.LoggerAdapter,
            final: bool = True) -> str:
    """Handle the Event once and write the outcome on it; returns it (``resumed:<incidents>``,
    ``resumed:none``, ``rejected:<reason>``)."""
    recorded = (event["metadata"].get("annotations") or {}).get(names.INTAKE_ANNOTATION)
    if recorded:
        return recorded
    try:
        outcome = _handle(event, settings, logger)
    except validate.Rejected as rejected:
        outcome = _reject(event, logger, rejected)
    except Exception as exc:  # noqa: BLE001 - a transient failure is retried by kopf, the rest is a rejection
        if kube.worth_retrying(exc) and not final:
            raise
        outcome = _reject(event, logger, validate.Rejected("IntakeError", f"{type(exc).__name__}: {str(exc)[:300]}"))
    return intake.record(event, outcome)


def _handle(event: dict[str, Any], settings: Settings, logger: logging.Logger | logging.LoggerAdapter) -> str:
    namespace = event["metadata"].get("namespace") or ""
    if not intake.LIMITER.allow(namespace, settings, key=event["metadata"].get("uid")):
        raise validate.Rejected("RateLimited", f"namespace {namespace} posted too many sdcguard Events")
    signature = signature_check.presented(event, settings, logger)
    text = event["metadata"]["annotations"][names.RESUME_ANNOTATION]
    if len(text.encode("utf-8", "surrogatepass")) > names.ALARM_MAX_BYTES:
        raise validate.Rejected("MalformedResume", f"the resume record is longer than {names.ALARM_MAX_BYTES} bytes")
    try:
        record = resume_schema.loads(text)
    except resume_schema.ResumeError as exc:
        raise validate.Rejected("MalformedResume", str(exc)) from None
    if record["job"]["namespace"] != namespace:
        raise validate.Rejected("NamespaceMismatch", f"the record names a job of namespace "
                                f"{record['job']['namespace']}, the Event is in {namespace}")
    job = validate.check_job(record, settings)
    job_uid = job["metadata"]["uid"]
    if signature is not None:
        signature_check.verify(record, text, signature, job_uid, settings)
    if record["job"].get("uid") != job_uid and (record["job"].get("uid") or settings.require_alarm_uids):
        raise validate.Rejected("JobUidMismatch", f"the record is about {names.JOB_KIND} uid "
                                f"{record['job'].get('uid')}, the live {record['job']['name']} is uid {job_uid}")
    at = validate.check_fresh(record, settings)
    recorded = [name for name in _candidates(namespace, record["job"]["name"], job_uid, at, settings)
                if _record_on(namespace, name, record, event["metadata"]["name"])]
    logger.info(f"resume {record['id']} of {namespace}/{record['job']['name']}: "
                f"recorded on {recorded or 'no incident'}")
    return f"resumed:{','.join(recorded) or 'none'}"


def _candidates(namespace: str, job: str, job_uid: str, at: float, settings: Settings) -> list[str]:
    """The operator's incidents of this job instance, opened before the resume, without one yet."""
    items = kube.custom().list_namespaced_custom_object(
        names.GROUP, names.VERSION, namespace, names.INCIDENTS,
        label_selector=f"{names.INCIDENT_JOB_LABEL}={job[:63]}").get("items") or []
    found = []
    for item in items:
        spec, status = item.get("spec") or {}, item.get("status") or {}
        if spec.get("jobUid") != job_uid or (spec.get("job") or {}).get("name") != job or status.get("resumed"):
            continue
        alarm_time = (spec.get("alarm") or {}).get("time") if isinstance(spec.get("alarm"), dict) else None
        try:
            if alarm_time is None or alarm_schema.rfc3339_seconds(alarm_time) > at + settings.clock_skew_seconds:
                continue
        except ValueError:
            continue
        try:
            incident.verify(item, settings)
        except incident.NotVerified:
            continue  # not the operator's: nothing is written on it
        found.append(item["metadata"]["name"])
    return found


def resumed_status(record: dict[str, Any], status: dict[str, Any], event_name: str) -> dict[str, Any]:
    """``status.resumed`` from a verified record and the incident's recovery plan (pure)."""
    checkpoint = record["checkpoint"]
    named = status.get("resumeFrom")
    same = bool(named) and checkpoint["path"] == named and (
        status.get("resumeFromStep") is None or status.get("resumeFromStep") == checkpoint["step"]) and (
        not status.get("resumeFromSha256") or not checkpoint.get("sha256")
        or status["resumeFromSha256"] == checkpoint["sha256"])
    first = (status.get("suspectWindow") or {}).get("firstStep")
    reporter = record.get("reporter") or {}
    return {"time": record["time"], "path": checkpoint["path"], "step": checkpoint["step"],
            "sha256": checkpoint.get("sha256"), "event": event_name, "pod": reporter.get("pod"),
            "node": reporter.get("node"), "matchesNamedCheckpoint": same,
            "beforeSuspectWindow": None if first is None else checkpoint["step"] < first}


def _record_on(namespace: str, name: str, record: dict[str, Any], event_name: str) -> bool:
    def change(status: dict[str, Any]) -> dict[str, Any]:
        if status.get("resumed"):
            return {}
        resumed = {k: v for k, v in resumed_status(record, status, event_name).items() if v is not None}
        named = f" ({status['resumeFrom']})" if status.get("resumeFrom") else ""
        where = "the checkpoint the alarm named" if resumed["matchesNamedCheckpoint"] else \
            f"NOT the checkpoint the alarm named{named}"
        if resumed.get("beforeSuspectWindow") is False:
            where += "; it lies INSIDE or after the suspect window"
        message = strip_format_characters(f"the job resumed from {resumed['path']} (step {resumed['step']}): {where}")
        timeline = list(status.get("timeline") or []) + [{"time": kube.now(), "event": "Resumed", "message": message}]
        return {"resumed": resumed, "timeline": timeline}
    body = kube.update_status(names.INCIDENTS, namespace, name, change)
    return ((body.get("status") or {}).get("resumed") or {}).get("event") == event_name


def _reject(event: dict[str, Any], logger: logging.Logger | logging.LoggerAdapter, rejected: validate.Rejected) -> str:
    logger.warning(f"resume Event {event['metadata']['name']} rejected: {rejected.reason}: "
                   f"{strip_format_characters(rejected.message)}")
    return f"rejected:{rejected.reason}"
