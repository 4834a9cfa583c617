"""Kubernetes API access shared by the handlers: clients, names, and status records.

Progress lives in the objects, never in memory: every step writes its outcome into the object's
status (conditions + timeline) before the next step starts, so a restarted operator can tell
"done" from "not yet".
"""
from __future__ import annotations

import datetime
import os
import threading
from collections import defaultdict
from collections.abc import Callable
from typing import Any

import kubernetes

from sdcguard.contract import names

CLUSTER_LABEL = "sagemaker.amazonaws.com/cluster-name"
GROUP_LABEL = "sagemaker.amazonaws.com/instance-group-name"

_client: kubernetes.client.ApiClient | None = None
_client_lock = threading.Lock()
_object_locks: defaultdict[tuple[str, str | None, str], threading.Lock] = defaultdict(threading.Lock)
_object_locks_guard = threading.Lock()


def api_client() -> kubernetes.client.ApiClient:
    """One client per process: in-cluster config when running in a pod, else $KUBECONFIG."""
    global _client
    with _client_lock:
        if _client is None:
            try:
                kubernetes.config.load_incluster_config()
                configuration = kubernetes.client.Configuration.get_default_copy()
            except kubernetes.config.ConfigException:
                configuration = kubernetes.client.Configuration()
                kubernetes.config.load_kube_config(config_file=os.environ.get("KUBECONFIG"),
                                                   client_configuration=configuration)
            _client = kubernetes.client.ApiClient(configuration)
        return _client


def core() -> kubernetes.client.CoreV1Api:
    return kubernetes.client.CoreV1Api(api_client())


def custom() -> kubernetes.client.CustomObjectsApi:
    return kubernetes.client.CustomObjectsApi(api_client())


def not_found(exc: BaseException) -> bool:
    return isinstance(exc, kubernetes.client.ApiException) and exc.status == 404


def conflict(exc: BaseException) -> bool:
    return isinstance(exc, kubernetes.client.ApiException) and exc.status == 409


def now() -> str:
    return datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds").replace("+00:00", "Z")


def object_lock(kind: str, namespace: str | None, name: str) -> threading.Lock:
    """Serialises read-modify-write of one object's status inside this (single, standalone) operator."""
    with _object_locks_guard:
        return _object_locks[(kind, namespace, name)]


def condition(type_: str, status: bool, reason: str, message: str) -> dict[str, str]:
    return {"type": type_, "status": "True" if status else "False", "reason": reason, "message": message}


def merge_conditions(existing: list[dict[str, Any]], updates: list[dict[str, str]]) -> list[dict[str, Any]]:
    """Kubernetes convention: one entry per type; lastTransitionTime moves only when status flips."""
    merged = {c["type"]: dict(c) for c in existing or []}
    for update in updates:
        old = merged.get(update["type"])
        entry = dict(update)
        entry["lastTransitionTime"] = old["lastTransitionTime"] if old and old["status"] == update["status"] else now()
        merged[update["type"]] = entry
    return list(merged.values())


def get_incident(namespace: str, name: str) -> dict[str, Any]:
    return custom().get_namespaced_custom_object(names.GROUP, names.VERSION, namespace, names.INCIDENTS, name)


def get_replacement(name: str) -> dict[str, Any]:
    return custom().get_cluster_custom_object(names.GROUP, names.VERSION, names.REPLACEMENTS, name)


def update_status(plural: str, namespace: str | None, name: str,
                  change: Callable[[dict[str, Any]], dict[str, Any]]) -> dict[str, Any]:
    """Read the object, compute a status patch from its current status, apply it (merge patch).

    Under a per-object lock: merge patches replace lists whole and the emulator offers no
    optimistic concurrency, so appends (timeline, alarms) are serialised here.  The operator runs
    as a single standalone instance.
    """
    with object_lock(plural, namespace, name):
        body = get_incident(namespace, name) if namespace else get_replacement(name)
        patch = change(body.get("status") or {})
        if not patch:
            return body
        if namespace:
            return custom().patch_namespaced_custom_object_status(names.GROUP, names.VERSION, namespace, plural,
                                                                  name, {"status": patch})
        return custom().patch_cluster_custom_object_status(names.GROUP, names.VERSION, plural, name,
                                                           {"status": patch})


def record(plural: str, namespace: str | None, name: str, event: str | None = None, message: str = "",
           conditions: list[dict[str, str]] | None = None, **status: Any) -> dict[str, Any]:
    """Write one transition into an object's status: fields, conditions and a timeline entry."""
    def change(current: dict[str, Any]) -> dict[str, Any]:
        patch: dict[str, Any] = dict(status)
        if conditions:
            patch["conditions"] = merge_conditions(current.get("conditions", []), conditions)
        if event:
            patch["timeline"] = list(current.get("timeline", [])) + [{"time": now(), "event": event, "message": message}]
        return patch
    return update_status(plural, namespace, name, change)


def is_true(status: dict[str, Any], type_: str) -> bool:
    return any(c.get("type") == type_ and c.get("status") == "True" for c in status.get("conditions") or [])
