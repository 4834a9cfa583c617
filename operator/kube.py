"""Kubernetes API access shared by the handlers: clients, names, and status records.

Progress lives in the objects, never in memory: every step writes its outcome into the object's
status (conditions + timeline) before the next step starts, so a restarted operator can tell
"done" from "not yet".

Writes use the API server's optimistic concurrency, not locks: a status update carries the
``resourceVersion`` it was computed from, and a 409 Conflict (someone wrote in between: another
handler of this process, another replica, a person) means "read again and recompute".  A claim
(:func:`claim`) is the compare-and-swap the AWS calls are guarded by: it succeeds only if the
object is still exactly as read.
"""
from __future__ import annotations

import datetime
import os
import socket
import threading
import time
import uuid
from collections.abc import Callable
from typing import Any

import kopf
import kubernetes

from sdcguard.contract import names

CLUSTER_LABEL = names.HYPERPOD_CLUSTER_LABEL
GROUP_LABEL = names.HYPERPOD_GROUP_LABEL

_client: kubernetes.client.ApiClient | None = None
_client_lock = threading.Lock()
CONFLICT_RETRIES = 8
CREATE_TRIES = 4
"""A create answered 409 with nothing there to read is tried this many times in one handler run."""
_identity: list[str] = []


def identity() -> str:
    """Who this process is, in records of intents (``attemptedBy``) and in the leader Lease: the pod
    name (downward API) plus a per-process suffix, so a restarted container is a new identity.
    Made on first use (nothing is read at import)."""
    with _client_lock:
        if not _identity:
            _identity.append(f"{os.environ.get(names.ENV_POD_NAME) or socket.gethostname()}-{uuid.uuid4().hex[:8]}")
        return _identity[0]


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


def read_or_create(what: str, read: Callable[[], Any], create: Callable[[], Any]) -> Any:
    """Read an object, creating it when it is absent; returns it.  A 409 to the create is someone
    else's create (the next read finds it), or an overloaded API server's answer to a create it did
    not do (the next read finds nothing, and the create is tried again, after a pause); after
    :data:`CREATE_TRIES` a ``kopf.TemporaryError``: the handler is retried later."""
    for attempt in range(CREATE_TRIES):
        if attempt:
            pause_before_retry(attempt)
        try:
            return read()
        except kubernetes.client.ApiException as exc:
            if not not_found(exc):
                raise
        try:
            return create()
        except kubernetes.client.ApiException as exc:
            if not conflict(exc):
                raise
    raise kopf.TemporaryError(f"{what}: neither read nor created after {CREATE_TRIES} tries", delay=1)


def pause_before_retry(attempt: int = 1) -> None:
    """A short pause before writing again to an API server that answered a write it did not do."""
    time.sleep(min(1.0, 0.2 * attempt))


def worth_retrying(exc: BaseException) -> bool:
    """A handler's failure that a later try may not meet: a transient API answer, or the
    operator's own "try again later" (a write still conflicting after its fresh reads)."""
    return transient(exc) or isinstance(exc, kopf.TemporaryError)


def transient(exc: BaseException) -> bool:
    """An API answer worth retrying as it is: 429, 5xx, or no answer at all."""
    if isinstance(exc, kubernetes.client.ApiException):
        return exc.status in (0, 429) or (exc.status or 0) >= 500
    import urllib3
    return isinstance(exc, (urllib3.exceptions.HTTPError, OSError))


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


def _get(plural: str, namespace: str | None, name: str) -> dict[str, Any]:
    if namespace:
        return custom().get_namespaced_custom_object(names.GROUP, names.VERSION, namespace, plural, name)
    return custom().get_cluster_custom_object(names.GROUP, names.VERSION, plural, name)


def _patch_status(plural: str, namespace: str | None, name: str, resource_version: str | None,
                  patch: dict[str, Any]) -> dict[str, Any]:
    """Merge-patch the status, conditional on ``resource_version`` (409 if the object changed)."""
    body: dict[str, Any] = {"status": patch}
    if resource_version is not None:
        body["metadata"] = {"resourceVersion": resource_version}
    if namespace:
        return custom().patch_namespaced_custom_object_status(names.GROUP, names.VERSION, namespace, plural,
                                                              name, body)
    return custom().patch_cluster_custom_object_status(names.GROUP, names.VERSION, plural, name, body)


class StatusSeal:
    """The operator's seal on what it writes into an object's status (``status.seal``): an HMAC
    (``mac(name, canonical status)``) over every status field but ``conditions`` and the seal
    itself. Anyone with ``/status`` rights can write a status; nobody without the master key can
    seal one. Installed per plural (:data:`SEALS`) by the module that owns the object."""

    UNSEALED = ("conditions", "seal")

    def __init__(self, mac: Callable[[str, str], str]) -> None:
        self._mac = mac

    @staticmethod
    def canonical(status: dict[str, Any]) -> str:
        import json
        covered = {k: v for k, v in status.items() if k not in StatusSeal.UNSEALED}
        return json.dumps(_without_nulls(covered), sort_keys=True, separators=(",", ":"))

    def make(self, name: str, status: dict[str, Any]) -> str:
        return self._mac(name, self.canonical(status))

    def valid(self, name: str, status: dict[str, Any]) -> bool:
        """A status the operator sealed as it is, or one it has not written yet (nothing but conditions)."""
        import hmac
        if not any(k not in StatusSeal.UNSEALED for k in status) and not status.get("seal"):
            return True
        return isinstance(status.get("seal"), str) and hmac.compare_digest(status["seal"], self.make(name, status))


SEALS: dict[str, StatusSeal] = {}
"""plural -> the seal every status write of that plural carries (cluster-scoped objects: the name)."""


class StatusNotSealed(Exception):
    """The status was written by someone else than the operator: not acted on, not written over."""


def _without_nulls(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: _without_nulls(v) for k, v in value.items() if v is not None}
    if isinstance(value, list):
        return [_without_nulls(v) for v in value]
    return value


def merge_patch(target: Any, patch: Any) -> Any:
    """RFC 7386 JSON merge patch: what the API server stores for ``target`` patched with ``patch``."""
    if not isinstance(patch, dict):
        return patch
    result = dict(target) if isinstance(target, dict) else {}
    for key, value in patch.items():
        if value is None:
            result.pop(key, None)
        else:
            result[key] = merge_patch(result.get(key), value)
    return result


def sealed_status(plural: str, name: str, status: dict[str, Any]) -> bool:
    """Whether ``status`` is as the operator sealed it (always true for an unsealed plural)."""
    seal = SEALS.get(plural)
    return seal is None or seal.valid(name, status)


def _sealed_patch(plural: str, name: str, status: dict[str, Any], patch: dict[str, Any],
                  unsealed: bool) -> dict[str, Any]:
    seal = SEALS.get(plural)
    if seal is None:
        return patch
    if unsealed:  # a marker (conditions only) on a status that may not be sealed: the seal is not renewed
        extra = [k for k in patch if k not in StatusSeal.UNSEALED]
        if extra:
            raise ValueError(f"an unsealed write may only set conditions, not {extra}")
        return patch
    if not seal.valid(name, status):
        raise StatusNotSealed(f"{plural}/{name}: the status does not carry the operator's seal (written by "
                              "someone else): not acted on, not written over")
    return {**patch, "seal": seal.make(name, merge_patch(status, patch))}


def update_status(plural: str, namespace: str | None, name: str,
                  change: Callable[[dict[str, Any]], dict[str, Any]], unsealed: bool = False) -> dict[str, Any]:
    """Read the object, compute a status patch from its current status, apply it (merge patch)
    conditional on the resourceVersion read; on 409, read again and recompute.

    ``change`` must be a function of the status it is given (it may be called several times).
    Merge patches replace lists whole, so appends (timeline, duplicates) are only safe this way.
    A sealed plural (:data:`SEALS`): the status read must carry the operator's seal
    (:class:`StatusNotSealed` otherwise) and the patch renews it, unless ``unsealed`` (conditions only).
    """
    for _ in range(CONFLICT_RETRIES):
        body = _get(plural, namespace, name)
        patch = change(body.get("status") or {})
        if not patch:
            return body
        patch = _sealed_patch(plural, name, body.get("status") or {}, patch, unsealed)
        try:
            return _patch_status(plural, namespace, name, body["metadata"].get("resourceVersion"), patch)
        except kubernetes.client.ApiException as exc:
            if not conflict(exc):
                raise
    raise kopf.TemporaryError(f"{plural}/{name}: still conflicting after {CONFLICT_RETRIES} fresh reads", delay=1)


def claim(plural: str, namespace: str | None, name: str, still: Callable[[dict[str, Any]], bool],
          patch: dict[str, Any]) -> dict[str, Any] | None:
    """Compare-and-swap: write ``patch`` only if ``still(status)`` holds for a fresh read *and*
    nothing changes the object before the write lands.  Returns the new body, or None when the
    object moved on (the caller re-reads and decides again; it must not act)."""
    body = _get(plural, namespace, name)
    if not still(body.get("status") or {}):
        return None
    patch = _sealed_patch(plural, name, body.get("status") or {}, patch, False)
    try:
        return _patch_status(plural, namespace, name, body["metadata"].get("resourceVersion"), patch)
    except kubernetes.client.ApiException as exc:
        if conflict(exc):
            return None
        raise


def record(plural: str, namespace: str | None, name: str, event: str | None = None, message: str = "",
           conditions: list[dict[str, str]] | None = None, only_if: Callable[[dict[str, Any]], bool] | None = None,
           unsealed: bool = False, **status: Any) -> dict[str, Any]:
    """Write one transition into an object's status: fields, conditions and a timeline entry.

    ``only_if(current status)``: write nothing unless it holds on the version the write is
    conditional on (one-way transitions that two handlers may race to make are made once)."""
    def change(current: dict[str, Any]) -> dict[str, Any]:
        if only_if is not None and not only_if(current):
            return {}
        patch: dict[str, Any] = dict(status)
        if conditions:
            patch["conditions"] = merge_conditions(current.get("conditions", []), conditions)
        if event:
            entry = {"time": now(), "event": event, "message": message}
            if plural == names.REPLACEMENTS and "phase" in status:
                entry["phase"] = status["phase"]  # what an incident following this one reads (incident.follow)
            patch["timeline"] = list(current.get("timeline", [])) + [entry]
        return patch
    return update_status(plural, namespace, name, change, unsealed=unsealed)


def is_true(status: dict[str, Any], type_: str) -> bool:
    return any(c.get("type") == type_ and c.get("status") == "True" for c in status.get("conditions") or [])
