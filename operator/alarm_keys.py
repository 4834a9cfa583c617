"""Per-job alarm keys (SPEC §4): the Secret ``sdcguard-alarm-key-<job>`` of every enabled PyTorchJob.

Type Opaque, data key ``key``: 32 bytes from :mod:`secrets`, owned by the job (the garbage
collector deletes it with the job). Created on the first watch event of an enabled job — that
includes every job listed when the operator starts — and never overwritten: 409 means the key
exists and stays (a sidecar may already sign with it). A Secret of that name owned by another
object (e.g. an earlier job of the same name, not yet garbage-collected) is left alone and tried
again on the job's next event, so the new job gets its own key once the old one is gone.

The Secret itself is the only record: every event of the job (and a timer, so that a deleted
key is recreated without waiting for the job to change) reads it first and creates it when it
is missing. Nothing is remembered in the process.
"""
from __future__ import annotations

import base64
import logging
import secrets
from collections.abc import Mapping
from typing import Any

from sdcguard.contract import names

from . import kube, metrics
from .signing import secret_name

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
    """Make sure the job has its key; returns "created", "exists" or "foreign" (a Secret of that
    name belongs to something else; retried on the next event)."""
    meta = job["metadata"]
    name = secret_name(meta["name"])
    try:
        existing = kube.core().read_namespaced_secret(name, meta["namespace"])
    except Exception as exc:
        if not kube.not_found(exc):
            raise
        existing = None
    if existing is None:
        try:
            kube.core().create_namespaced_secret(meta["namespace"], manifest(job))
        except Exception as exc:
            if not kube.conflict(exc):
                raise
            existing = kube.core().read_namespaced_secret(name, meta["namespace"])  # created meanwhile
        else:
            metrics.ALARM_KEYS.inc()
            logger.info(f"alarm key Secret {meta['namespace']}/{name} created")
            return "created"
    owners = {ref.uid for ref in existing.metadata.owner_references or []}
    if meta.get("uid") and meta["uid"] not in owners:
        logger.warning(f"Secret {meta['namespace']}/{name} exists but is not owned by "
                       f"{names.JOB_KIND} {meta['name']} (uid {meta['uid']}); leaving it, retrying later")
        return "foreign"
    return "exists"
