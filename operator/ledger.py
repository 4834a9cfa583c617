"""The per-job ledger of alarm ids already handled (docs/design.md §9): an alarm counts once, for good.

A ConfigMap ``sdcguard-alarms-<job>`` in the job's namespace, owned by the job (the garbage
collector removes it with the job, never with an incident), maps each alarm id to the Event that
brought it first, the incident it opened or joined, and the alarm's time. Written with a
compare-and-swap on its resourceVersion (as the storm guard's ledger is), so two replicas or two
handlers cannot both claim one id. Entries older than the freshness bound are dropped on the next
write: such an alarm is refused as ``StaleAlarm`` before the ledger is asked.

:func:`claim` answers "first" (this Event is the first with this id; a retry of the same Event
gets "first" again, so a crash between claim and incident loses nothing) or "seen" (another Event
brought this id before: a replay, or a resent duplicate).
"""
from __future__ import annotations

import json
import logging
import re
import time
from typing import Any

import kopf

from sdcguard.contract import alarm as alarm_schema
from sdcguard.contract import names

from . import kube
from .settings import Settings

log = logging.getLogger("sdcguard_operator.ledger")

RETRIES = 16
_KEY = re.compile(r"[^-._a-zA-Z0-9]+")


def ledger_name(job: str) -> str:
    return f"{names.ALARM_LEDGER_PREFIX}{job}"[:253]


def _key(alarm_id: str) -> str:
    return _KEY.sub("_", alarm_id)[:253] or "_"


MANAGED_BY = {"app.kubernetes.io/managed-by": "sdcguard"}
MAX_LEDGER_BYTES = 512 * 1024
"""A ledger this large cannot be the operator's (entries older than the freshness bound are dropped):
it is replaced (the API server refuses a ConfigMap over 1 MiB, so a claim would fail with 422)."""


def _manifest(namespace: str, job: dict[str, Any]) -> dict[str, Any]:
    return {"metadata": {"name": ledger_name(job["metadata"]["name"]), "namespace": namespace,
                         "labels": {**MANAGED_BY, names.INCIDENT_JOB_LABEL: job["metadata"]["name"][:63]},
                         "ownerReferences": [_owner(job)]}, "data": {}}


def foreign(ledger: Any, job: dict[str, Any]) -> str | None:
    """Why a ConfigMap of the ledger's name is not one the operator may adopt, or None: it lacks the
    operator's label, is owned by anything but this job (uid), is ``immutable`` (no claim could be
    written: 422), or is filled beyond what a ledger ever holds. A tenant can pre-create any of these."""
    meta = ledger.metadata
    if (meta.labels or {}).get("app.kubernetes.io/managed-by") != "sdcguard":
        return "NotLabelled"
    owners = meta.owner_references or []
    if len(owners) != 1 or owners[0].uid != job["metadata"]["uid"] or owners[0].kind != names.JOB_KIND:
        return "ForeignOwner"
    if getattr(ledger, "immutable", None):
        return "Immutable"
    if sum(len(k) + len(v or "") for k, v in (ledger.data or {}).items()) > MAX_LEDGER_BYTES:
        return "Oversized"
    return None


def _replace(namespace: str, ledger: Any, job: dict[str, Any], why: str) -> None:
    """Delete a ledger the operator may not adopt (precondition: the very object read) and create its
    own; counted and logged (a replay of an id it held is then refused by freshness alone)."""
    import kubernetes

    name = ledger.metadata.name
    try:
        kube.core().delete_namespaced_config_map(name, namespace, body=kubernetes.client.V1DeleteOptions(
            preconditions=kubernetes.client.V1Preconditions(uid=ledger.metadata.uid)))
    except Exception as exc:
        if not kube.not_found(exc):
            raise
    message = f"alarm ledger ConfigMap {namespace}/{name} replaced ({why}): not one the operator may adopt"
    log.warning(message)
    kopf.event(job, type="Warning", reason="ForeignObjectReplaced", message=message)
    try:
        kube.core().create_namespaced_config_map(namespace, _manifest(namespace, job))
    except Exception as exc:
        if not kube.conflict(exc):
            raise


def _read_or_create(namespace: str, job: dict[str, Any]) -> Any:
    name = ledger_name(job["metadata"]["name"])
    for _ in range(3):
        ledger = kube.read_or_create(f"ConfigMap {namespace}/{name}",
                                     lambda: kube.core().read_namespaced_config_map(name, namespace),
                                     lambda: kube.core().create_namespaced_config_map(namespace,
                                                                                      _manifest(namespace, job)))
        why = foreign(ledger, job)
        if why is None:
            return ledger
        _replace(namespace, ledger, job, why)
    raise RuntimeError(f"alarm ledger {namespace}/{name}: replaced by someone else again and again")


def _owner(job: dict[str, Any]) -> dict[str, Any]:
    meta = job["metadata"]
    return {"apiVersion": names.JOB_API_VERSION, "kind": names.JOB_KIND, "name": meta["name"], "uid": meta["uid"]}


def claim(record: dict[str, Any], job: dict[str, Any], event_name: str, incident: str, settings: Settings,
          now: float | None = None) -> str:
    """Record the alarm id for this Event: "first", or "seen" (another Event had it)."""
    namespace = job["metadata"]["namespace"]
    key = _key(record["id"])
    for _ in range(RETRIES):
        ledger = _read_or_create(namespace, job)
        data = dict(ledger.data or {})
        if key in data:
            try:
                entry = json.loads(data[key])
            except ValueError:
                entry = {}
            if not isinstance(entry, dict):
                entry = {}
            return "first" if entry.get("event") == event_name else "seen"
        horizon = (time.time() if now is None else now) - settings.max_alarm_age_seconds
        patch: dict[str, Any] = {k: None for k, v in data.items() if _time(v) < horizon}  # stale or unreadable
        patch[key] = json.dumps({"event": event_name, "incident": incident, "time": record["time"]},
                                sort_keys=True, separators=(",", ":"))
        try:
            kube.core().patch_namespaced_config_map(ledger.metadata.name, namespace, {
                "metadata": {"resourceVersion": ledger.metadata.resource_version,
                             "ownerReferences": [_owner(job)]}, "data": patch})
            return "first"
        except Exception as exc:
            if _invalid(exc):  # the API server refuses the ledger as it is (e.g. too large): start a new one
                _replace(namespace, ledger, job, "Unwritable")
                continue
            if not kube.conflict(exc):
                raise
    raise kopf.TemporaryError(f"alarm ledger {namespace}/{ledger_name(job['metadata']['name'])}: still conflicting",
                              delay=1)


def _invalid(exc: BaseException) -> bool:
    import kubernetes
    return isinstance(exc, kubernetes.client.ApiException) and exc.status == 422


def _time(value: str) -> float:
    try:
        return alarm_schema.rfc3339_seconds(json.loads(value)["time"])
    except (ValueError, KeyError, TypeError, AttributeError):
        return float("-inf")  # unreadable (not the operator's entry): dropped on the next write
