"""Validation of an alarm Event against the cluster (docs/design.md §6.1).

An alarm is acted on only if its record parses, its job is a PyTorchJob that opted in and is the
instance the record names (uid), the record is fresh, and every pod it names exists, is controlled
by that job (ownerReference uid), is the pod the record names (uid), was created before the alarm,
and runs on the node the record claims: a forged, replayed or stale alarm must never cordon a node.  Anything else raises :class:`Rejected` with a short reason (the
metric label) and a message for people.
"""
from __future__ import annotations

import re
import time
from typing import Any, Mapping

from sdcguard.contract import alarm as alarm_schema
from sdcguard.contract import names
from sdcguard.contract.text import has_format_characters

from . import kube, metrics
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
    # Bounded before it is parsed: the HMAC can only be checked once the record names its job.
    if len(text) > names.ALARM_MAX_BYTES or len(text.encode("utf-8", "surrogatepass")) > names.ALARM_MAX_BYTES:
        raise Rejected("MalformedAlarm", f"the alarm annotation is longer than {names.ALARM_MAX_BYTES} bytes")
    if nesting(text) > names.ALARM_MAX_DEPTH:
        raise Rejected("MalformedAlarm", f"the alarm record nests deeper than {names.ALARM_MAX_DEPTH} levels")
    try:
        record = alarm_schema.loads(text)
    except alarm_schema.AlarmError as exc:
        reason = "UnsupportedSchema" if "unsupported alarm schema" in str(exc) else "MalformedAlarm"
        raise Rejected(reason, str(exc)) from None
    except Exception as exc:  # noqa: BLE001 - whatever a crafted record makes the parser raise
        raise Rejected("MalformedAlarm", f"the alarm record does not parse ({type(exc).__name__})") from None
    try:
        return _parsed(record, event, settings)
    except Rejected:
        raise
    except Exception as exc:  # noqa: BLE001 - a record of unexpected shape is malformed, never a crash
        raise Rejected("MalformedAlarm", f"the alarm record is not well formed ({type(exc).__name__})") from None


def nesting(text: str) -> int:
    """How deep the JSON ``text`` nests (arrays and objects), counted without parsing it."""
    depth = deepest = 0
    in_string = escaped = False
    for char in text:
        if in_string:
            if escaped:
                escaped = False
            elif char == "\\":
                escaped = True
            elif char == '"':
                in_string = False
        elif char == '"':
            in_string = True
        elif char in "[{":
            depth += 1
            deepest = max(deepest, depth)
        elif char in "]}":
            depth -= 1
    return deepest


def _parsed(record: dict[str, Any], event: dict[str, Any], settings: Settings) -> dict[str, Any]:
    job = record["job"]
    if job is None:
        raise Rejected("NoJob", "the alarm names no Kubernetes job")
    if job["kind"] != names.JOB_KIND:
        raise Rejected("UnsupportedJobKind", f"job kind {job['kind']!r} is not {names.JOB_KIND}")
    _check_strings(record)
    event_ns = (event.get("metadata") or {}).get("namespace")
    if event_ns and job["namespace"] != event_ns:
        raise Rejected("NamespaceMismatch", f"an Event in {event_ns!r} names a job in {job['namespace']!r}")
    if settings.namespaces and job["namespace"] not in settings.namespaces:
        raise Rejected("NamespaceNotWatched", f"namespace {job['namespace']!r} is not watched")
    return record


DNS_NAME = re.compile(r"^[a-z0-9]([-a-z0-9.]*[a-z0-9])?$")
UID = re.compile(r"^[-a-zA-Z0-9]*$")
PRINTABLE = re.compile(r"^[^\x00-\x1f\x7f-\x9f]*$")
SHA256 = re.compile(r"^[0-9a-f]{64}$")


def _check_strings(record: dict[str, Any]) -> None:
    """The strings the operator copies into an SDCIncident (and people read in ``kubectl get`` and
    ``kubectl sdcguard``) match the CRD's patterns and lengths: names are DNS names, the checkpoint
    and the id printable (no control characters: no ANSI escapes, no Unicode format characters such
as U+202E), else MalformedAlarm. Whole-string matches (``fullmatch``: ``$`` would let a trailing
newline through)."""
    def bad(what: str, value: Any, pattern: re.Pattern[str], limit: int, nullable: bool = True) -> None:
        if value is None and nullable:
            return
        if not isinstance(value, str) or len(value) > limit or not pattern.fullmatch(value) \
                or has_format_characters(value):
            raise Rejected("MalformedAlarm", f"{what} {str(value)[:80]!r} is not allowed "
                           f"(at most {limit} characters of {pattern.pattern})")
    job = record.get("job") or {}
    bad("job.name", job.get("name"), DNS_NAME, 253)
    bad("job.namespace", job.get("namespace"), DNS_NAME, 63)
    bad("job.uid", job.get("uid"), UID, 64)
    bad("check", record.get("check"), DNS_NAME, 63, nullable=False)
    bad("id", record.get("id"), PRINTABLE, 253, nullable=False)
    for identity in list(record.get("suspects") or []) + [record.get("reporter") or {}]:
        bad("pod", identity.get("pod"), DNS_NAME, 253)
        bad("node", identity.get("node"), DNS_NAME, 253)
        bad("pod_uid", identity.get("pod_uid"), UID, 64)
    bad("last_good_checkpoint", record.get("last_good_checkpoint"), PRINTABLE, 4096)
    sha = record.get("last_good_checkpoint_sha256")
    if sha is not None:
        bad("last_good_checkpoint_sha256", sha, SHA256, 64)


def check_job(record: dict[str, Any], settings: Settings) -> dict[str, Any]:
    """The PyTorchJob of the alarm, which must exist, carry sdcguard.dev/enabled: "true", and be the
    job instance the record was signed for (``job.uid``, docs/design.md §9)."""
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


def check_uids(record: dict[str, Any], job_uid: str, settings: Settings) -> None:
    """The signed ``job.uid`` and every ``suspects[].pod_uid`` are present (unless the migration
    setting allows records without them) and the job's is the live job's."""
    missing = [] if record["job"].get("uid") else ["job.uid"]
    missing += [f"suspects[rank {s.get('rank')}].pod_uid" for s in record["suspects"] if not s.get("pod_uid")]
    if not record["suspects"] and not record["reporter"].get("pod_uid"):
        missing.append("reporter.pod_uid")
    if missing:
        if settings.require_alarm_uids:
            raise Rejected("MissingUid", f"the alarm does not bind {', '.join(missing)} "
                           "(SDCGUARD_REQUIRE_ALARM_UIDS is true)")
        metrics.ALARMS_WITHOUT_UIDS.inc()
    if record["job"].get("uid") and record["job"]["uid"] != job_uid:
        raise Rejected("JobUidMismatch", f"the alarm is about {names.JOB_KIND} uid {record['job']['uid']}, the live "
                       f"{record['job']['name']} is uid {job_uid} (a recreated job)")


def check_fresh(record: dict[str, Any], settings: Settings, now: float | None = None) -> float:
    """The alarm's ``time`` is neither older than the freshness bound nor in the future; its epoch seconds."""
    now = time.time() if now is None else now
    try:
        at = alarm_schema.rfc3339_seconds(record["time"])
    except (TypeError, ValueError):
        raise Rejected("MalformedAlarm", f"time {record.get('time')!r} is not RFC 3339") from None
    if at < now - settings.max_alarm_age_seconds:
        raise Rejected("StaleAlarm", f"the alarm is from {record['time']}, older than "
                       f"SDCGUARD_MAX_ALARM_AGE_SECONDS ({settings.max_alarm_age_seconds:g} s)")
    if at > now + settings.clock_skew_seconds:
        raise Rejected("StaleAlarm", f"the alarm's time {record['time']} is in the future")
    return at


def controller_uid(pod: Any) -> str | None:
    """The uid of the pod's controlling owner when it is a PyTorchJob, else None."""
    for ref in pod.metadata.owner_references or []:
        if ref.controller:
            return ref.uid if ref.kind == names.JOB_KIND and ref.api_version == names.JOB_API_VERSION else None
    return None


def check_pods(record: dict[str, Any], job_uid: str, settings: Settings) -> None:
    """Every suspect pod (or, with no suspect, the reporter's) exists, is controlled by this very job
    (owner uid), runs on the node the alarm names, is the pod the alarm names (pod_uid), and was
    created before the alarm was raised (docs/design.md §9): the blast radius is the job's own pods' nodes."""
    job = record["job"]
    at = alarm_schema.rfc3339_seconds(record["time"])
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
        check_pod(pod, identity, job, job_uid, at, settings)


def check_pod(pod: Any, identity: dict[str, Any], job: dict[str, Any], job_uid: str, at: float,
              settings: Settings) -> None:
    """One live pod against the alarm's identity (see :func:`check_pods`)."""
    pod_name, node_name = identity.get("pod"), identity.get("node")
    owner = (pod.metadata.labels or {}).get(names.JOB_NAME_LABEL)
    if owner != job["name"]:
        raise Rejected("PodNotInJob", f"pod {pod_name} belongs to job {owner!r}, not {job['name']!r}")
    if controller_uid(pod) != job_uid:
        raise Rejected("PodNotInJob", f"pod {pod_name} is not controlled by {names.JOB_KIND} {job['name']} "
                       f"(uid {job_uid}): only the job's own pods count")
    if identity.get("pod_uid") and identity["pod_uid"] != pod.metadata.uid:
        raise Rejected("PodUidMismatch", f"the alarm names pod {pod_name} uid {identity['pod_uid']}, the live pod "
                       f"is uid {pod.metadata.uid} (recreated since)")
    if pod.spec is None or pod.spec.node_name != node_name:
        actual = pod.spec.node_name if pod.spec else None
        raise Rejected("NodeMismatch", f"pod {pod_name} runs on {actual!r}, the alarm claims {node_name!r}")
    created = pod.metadata.creation_timestamp
    if created is not None and at < created.timestamp() - settings.clock_skew_seconds:
        raise Rejected("StaleAlarm", f"the alarm ({at:.0f}) is older than pod {pod_name} "
                       f"(created {created.isoformat()}): it cannot be about this pod")
    deleted = pod.metadata.deletion_timestamp
    if deleted is not None and at > deleted.timestamp() + settings.clock_skew_seconds:
        # (the deletion timestamp is when the grace period ends: no container of the pod runs after it)
        raise Rejected("StaleAlarm", f"the alarm ({at:.0f}) is newer than the end of pod {pod_name} "
                       f"(deleted at {deleted.isoformat()}): it cannot be about this pod")
