"""Per-job alarm keys (SPEC §4): the Secret ``sdcguard-alarm-key-<job>`` of every enabled PyTorchJob.

Type Opaque, data key ``key``: 32 bytes from :mod:`secrets`, owned by the job (the garbage
collector deletes it with the job). Created on the first watch event of an enabled job — that
includes every job listed when the operator starts — and never overwritten: 409 means the key
exists and stays (a sidecar may already sign with it). A Secret of that name owned by another
object (e.g. an earlier job of the same name, not yet garbage-collected) is left alone and tried
again on the job's next event, so the new job gets its own key once the old one is gone.

Which jobs already have their key is remembered per process only to spare the API server a 409
on every status change of a job; the Secret itself is the record.
"""
from __future__ import annotations

import base64
import collections
import logging
import secrets
import threading
from collections.abc import Mapping
from typing import Any

from sdcguard.contract import names

from . import kube, metrics
from .signing import secret_name
from .validate import job_enabled

_ready: collections.OrderedDict[str, None] = collections.OrderedDict()
_ready_lock = threading.Lock()
_READY_LIMIT = 10_000


def manifest(job: Mapping[str, Any]) -> dict[str, Any]:
    """A fresh key Secret for ``job`` (a PyTorchJob body with name, namespace and uid)."""
    meta = job["metadata"]
    key = secrets.token_bytes(names.ALARM_KEY_MIN_BYTES)
    return {
        "apiVersion": "v1", "kind": "Secret", "type": "Opaque",
        "metadata": {"name": secret_name(meta["name"]), "namespace": meta["namespace"],
                     "ownerReferences": [{"apiVersion": names.JOB_API_VERSION, "kind": names.JOB_KIND,
                                          "name": meta["name"], "uid": meta["uid"]}]},
        "data": {names.ALARM_KEY_DATA_KEY: base64.b64encode(key).decode("ascii")},
    }


def ensure(job: Mapping[str, Any], logger: logging.Logger | logging.LoggerAdapter) -> str:
    """Make sure the job has its key; returns "created", "exists", "known" (seen before) or
    "foreign" (a Secret of that name belongs to something else; retried on the next event)."""
    meta = job["metadata"]
    uid = meta.get("uid") or f"{meta['namespace']}/{meta['name']}"
    with _ready_lock:
        if uid in _ready:
            return "known"
    body = manifest(job)
    try:
        kube.core().create_namespaced_secret(meta["namespace"], body)
        outcome = "created"
        metrics.ALARM_KEYS.inc()
        logger.info(f"alarm key Secret {meta['namespace']}/{body['metadata']['name']} created")
    except Exception as exc:
        if not kube.conflict(exc):
            raise
        existing = kube.core().read_namespaced_secret(body["metadata"]["name"], meta["namespace"])
        owners = {ref.uid for ref in existing.metadata.owner_references or []}
        if meta.get("uid") and meta["uid"] not in owners:
            logger.warning(f"Secret {meta['namespace']}/{body['metadata']['name']} exists but is not owned by "
                           f"{names.JOB_KIND} {meta['name']} (uid {meta['uid']}); leaving it, retrying later")
            return "foreign"
        outcome = "exists"
    with _ready_lock:
        _ready[uid] = None
        while len(_ready) > _READY_LIMIT:
            _ready.popitem(last=False)
    return outcome
