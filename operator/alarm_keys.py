"""Per-job alarm keys (docs/design.md §4, §9): the Secret ``sdcguard-alarm-key-<job>`` of every enabled PyTorchJob.

Type Opaque, data key ``key``: the job's key derived from the operator's master key and the job's
namespace, name and uid (:mod:`.master_key`), owned by the job (the garbage collector deletes it
with the job). Written on the first watch event of an enabled job — that includes every job listed
when the operator starts — and again by a timer, so that a deleted or altered key is put back.

The operator never reads the Secret: it creates it, and on 409 (it exists) merge-patches the same
content over it. The content is a pure function of the job, so writing it again changes nothing;
a Secret left by an earlier job of the same name (another uid), or a key written by someone else,
is overwritten with the current job's key and owner. One that cannot be overwritten — pre-created
``immutable`` (422), or of a type the admission policy forbids the operator to write — or that the
patch answer shows is not an Opaque, mutable Secret, is deleted and created anew (a Warning Event
``ForeignObjectReplaced`` on the job): an attacker's key never stays in the sidecar.
"""
from __future__ import annotations

import base64
import logging
from collections.abc import Mapping
from typing import Any

import kopf

from sdcguard.contract import names

from . import kube, master_key, metrics
from .settings import Settings
from .signature_check import secret_name


def manifest(job: Mapping[str, Any], settings: Settings) -> dict[str, Any]:
    """The key Secret of ``job`` (a PyTorchJob body with name, namespace and uid)."""
    meta = job["metadata"]
    key = master_key.job_key(settings, meta["namespace"], meta["name"], meta["uid"])
    return {
        "apiVersion": "v1", "kind": "Secret", "type": "Opaque",
        "metadata": {"name": secret_name(meta["name"]), "namespace": meta["namespace"],
                     "labels": {"app.kubernetes.io/managed-by": "sdcguard"},
                     "ownerReferences": [{"apiVersion": names.JOB_API_VERSION, "kind": names.JOB_KIND,
                                          "name": meta["name"], "uid": meta["uid"]}]},
        "data": {names.ALARM_KEY_DATA_KEY: base64.b64encode(key).decode("ascii")},
    }


def foreign(stored: Any) -> str | None:
    """Why the Secret the patch answered with is not the operator's to keep, or None."""
    if stored is None:
        return None
    if getattr(stored, "immutable", None):
        return "it is immutable"
    if getattr(stored, "type", "Opaque") not in (None, "Opaque"):
        return f"its type is {stored.type}"
    return None


def _replace(job: Mapping[str, Any], body: dict[str, Any], why: str,
             logger: logging.Logger | logging.LoggerAdapter) -> str:
    """Delete a key Secret the operator may not keep and create its own; "replaced"."""
    meta = job["metadata"]
    name = body["metadata"]["name"]
    try:
        kube.core().delete_namespaced_secret(name, meta["namespace"])
    except Exception as exc:
        if not kube.not_found(exc):
            raise
    kube.core().create_namespaced_secret(meta["namespace"], body)  # a 409 (re-created meanwhile): retried by kopf
    message = f"alarm key Secret {meta['namespace']}/{name} replaced: {why} (not one the operator may adopt)"
    logger.warning(message)
    kopf.event(dict(job), type="Warning", reason="ForeignObjectReplaced", message=message)
    metrics.ALARM_KEYS.inc()
    return "replaced"


def ensure(job: Mapping[str, Any], settings: Settings, logger: logging.Logger | logging.LoggerAdapter) -> str:
    """Write the job's key Secret; returns "created", "written" (it existed: same content put over it)
    or "replaced" (one the operator may not keep was deleted and created anew)."""
    meta = job["metadata"]
    body = manifest(job, settings)
    for _ in range(kube.CREATE_TRIES):
        try:
            kube.core().create_namespaced_secret(meta["namespace"], body)
            break
        except Exception as exc:
            if not kube.conflict(exc):
                raise
        try:
            stored = kube.core().patch_namespaced_secret(
                body["metadata"]["name"], meta["namespace"],
                {"metadata": {"ownerReferences": body["metadata"]["ownerReferences"],
                              "labels": body["metadata"]["labels"]}, "data": body["data"]})
        except Exception as exc:
            if kube.not_found(exc) or kube.conflict(exc):
                # 404: the create's 409 was not "AlreadyExists" (an overloaded API server's); 409 to
                # an unconditional patch: the same server's answer. Neither says the Secret is foreign.
                kube.pause_before_retry()
                continue
            if kube.transient(exc) or not hasattr(exc, "status"):
                raise
            return _replace(job, body, f"the key could not be written over it (HTTP {exc.status})", logger)
        why = foreign(stored)
        if why:
            return _replace(job, body, why, logger)
        return "written"
    else:
        raise kopf.TemporaryError(f"Secret {meta['namespace']}/{body['metadata']['name']}: create answered 409 "
                                  f"{kube.CREATE_TRIES} times and nothing is there", delay=1)
    metrics.ALARM_KEYS.inc()
    logger.info(f"alarm key Secret {meta['namespace']}/{body['metadata']['name']} created")
    return "created"
