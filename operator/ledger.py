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
import re
import time
from typing import Any

from sdcguard.contract import alarm as alarm_schema
from sdcguard.contract import names

from . import kube
from .settings import Settings

RETRIES = 16
_KEY = re.compile(r"[^-._a-zA-Z0-9]+")


def ledger_name(job: str) -> str:
    return f"{names.ALARM_LEDGER_PREFIX}{job}"[:253]


def _key(alarm_id: str) -> str:
    return _KEY.sub("_", alarm_id)[:253] or "_"


def _read_or_create(namespace: str, job: dict[str, Any]) -> Any:
    name = ledger_name(job["metadata"]["name"])
    try:
        return kube.core().read_namespaced_config_map(name, namespace)
    except Exception as exc:
        if not kube.not_found(exc):
            raise
    try:
        return kube.core().create_namespaced_config_map(namespace, {
            "metadata": {"name": name, "namespace": namespace,
                         "labels": {"app.kubernetes.io/managed-by": "sdcguard", names.INCIDENT_JOB_LABEL:
                                    job["metadata"]["name"][:63]},
                         "ownerReferences": [_owner(job)]}, "data": {}})
    except Exception as exc:
        if not kube.conflict(exc):
            raise
    return kube.core().read_namespaced_config_map(name, namespace)


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
            return "first" if entry.get("event") == event_name else "seen"
        horizon = (time.time() if now is None else now) - settings.max_alarm_age_seconds
        patch: dict[str, Any] = {k: None for k, v in data.items() if _time(v) < horizon}
        patch[key] = json.dumps({"event": event_name, "incident": incident, "time": record["time"]},
                                sort_keys=True, separators=(",", ":"))
        try:
            kube.core().patch_namespaced_config_map(ledger.metadata.name, namespace, {
                "metadata": {"resourceVersion": ledger.metadata.resource_version,
                             "ownerReferences": [_owner(job)]}, "data": patch})
            return "first"
        except Exception as exc:
            if not kube.conflict(exc):
                raise
    raise RuntimeError(f"alarm ledger {namespace}/{ledger_name(job['metadata']['name'])}: still conflicting")


def _time(value: str) -> float:
    try:
        return alarm_schema.rfc3339_seconds(json.loads(value)["time"])
    except (ValueError, KeyError, TypeError):
        return float("inf")  # unreadable: kept
