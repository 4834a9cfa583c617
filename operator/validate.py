"""Validation of an alarm Event against the cluster (SPEC §6.1).

An alarm is acted on only if its record parses, its job is a PyTorchJob that opted in, and every
pod it names exists, belongs to that job and runs on the node the record claims: a forged or stale
alarm must never cordon a node.  Anything else raises :class:`Rejected` with a short reason (the
metric label) and a message for people.
"""
from __future__ import annotations

from typing import Any, Mapping

from sdcguard.contract import alarm as alarm_schema
from sdcguard.contract import names

from . import kube
from .settings import Settings


def job_enabled(annotations: Mapping[str, str]) -> bool:
    """``sdcguard.dev/enabled: "true"`` (any case, spaces ignored): read alike by the pod webhook,
    the alarm-key handler and alarm validation."""
    return str(annotations.get(names.ENABLED_ANNOTATION, "")).strip().lower() == "true"


class Rejected(Exception):
    """An alarm that is not acted on; ``reason`` is a CamelCase word for metrics and Events."""

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(f"{reason}: {message}")
        self.reason = reason
        self.message = message


def annotation(event: dict[str, Any]) -> str:
    """The exact alarm annotation text (what the signature covers)."""
    annotations = (event.get("metadata") or {}).get("annotations") or {}
    text = annotations.get(names.ALARM_ANNOTATION)
    if text is None:
        raise Rejected("MissingAnnotation", f"the Event has no {names.ALARM_ANNOTATION} annotation")
    return text


def parse(event: dict[str, Any], settings: Settings) -> dict[str, Any]:
    """The alarm record of an Event, schema-checked, with the job checks that need no API call."""
    text = annotation(event)
    try:
        record = alarm_schema.loads(text)
    except alarm_schema.AlarmError as exc:
        reason = "UnsupportedSchema" if "unsupported alarm schema" in str(exc) else "MalformedAlarm"
        raise Rejected(reason, str(exc)) from None
    job = record["job"]
    if job is None:
        raise Rejected("NoJob", "the alarm names no Kubernetes job")
    if job["kind"] != names.JOB_KIND:
        raise Rejected("UnsupportedJobKind", f"job kind {job['kind']!r} is not {names.JOB_KIND}")
    event_ns = (event.get("metadata") or {}).get("namespace")
    if event_ns and job["namespace"] != event_ns:
        raise Rejected("NamespaceMismatch", f"an Event in {event_ns!r} names a job in {job['namespace']!r}")
    if settings.namespaces and job["namespace"] not in settings.namespaces:
        raise Rejected("NamespaceNotWatched", f"namespace {job['namespace']!r} is not watched")
    return record


def check_job(record: dict[str, Any]) -> dict[str, Any]:
    """The PyTorchJob of the alarm, which must exist and carry sdcguard.dev/enabled: "true"."""
    job = record["job"]
    try:
        body = kube.custom().get_namespaced_custom_object(names.JOB_GROUP, names.JOB_VERSION, job["namespace"],
                                                          names.JOB_PLURAL, job["name"])
    except Exception as exc:
        if kube.not_found(exc):
            raise Rejected("JobNotFound", f"{names.JOB_KIND} {job['namespace']}/{job['name']} does not exist") from None
        raise
    annotations = (body.get("metadata") or {}).get("annotations") or {}
    if not job_enabled(annotations):  # read exactly as the pod webhook and the key handler read it
        raise Rejected("JobNotEnabled",
                       f"{names.JOB_KIND} {job['name']} is not annotated {names.ENABLED_ANNOTATION}: \"true\"")
    return body


def check_pods(record: dict[str, Any]) -> None:
    """Every suspect pod (or, with no suspect, the reporter's) exists, is the job's, runs where claimed."""
    job = record["job"]
    identities = record["suspects"] or [record["reporter"]]
    for identity in identities:
        pod_name, node_name = identity.get("pod"), identity.get("node")
        if not pod_name or not node_name:
            raise Rejected("MissingIdentity", f"rank {identity['rank']} has no pod or node in the alarm")
        try:
            pod = kube.core().read_namespaced_pod(pod_name, job["namespace"])
        except Exception as exc:
            if kube.not_found(exc):
                raise Rejected("PodNotFound", f"pod {job['namespace']}/{pod_name} does not exist") from None
            raise
        owner = (pod.metadata.labels or {}).get(names.JOB_NAME_LABEL)
        if owner != job["name"]:
            raise Rejected("PodNotInJob", f"pod {pod_name} belongs to job {owner!r}, not {job['name']!r}")
        if pod.spec is None or pod.spec.node_name != node_name:
            actual = pod.spec.node_name if pod.spec else None
            raise Rejected("NodeMismatch", f"pod {pod_name} runs on {actual!r}, the alarm claims {node_name!r}")
