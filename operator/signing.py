"""Signed alarms, the operator's side (SPEC §4): check an alarm Event's signature first.

A pod that may create Events must not be able to cordon nodes or suspend jobs, so an alarm counts
only when its ``sdcguard.dev/alarm-signature`` is the HMAC-SHA256, under the named job's key (the
Secret ``sdcguard-alarm-key-<job>``, see :mod:`.alarm_keys`), of the exact ``sdcguard.dev/alarm``
annotation text. The key Secret is read on every alarm, so a replaced key counts from the next
alarm on (alarms are rare; there is no cache to go stale). Nothing here touches the cluster
beyond that one read: a rejection raises :class:`validate.Rejected` before any other step runs.
"""
from __future__ import annotations

import base64
import binascii
import logging
import re
from typing import Any

from sdcguard.contract import events, names

from . import kube, metrics
from .settings import Settings
from .validate import Rejected

_WELL_FORMED = re.compile(rf"^{names.ALARM_SIGNATURE_SCHEME}=[0-9a-f]{{64}}$")


def secret_name(job_name: str) -> str:
    return f"{names.ALARM_KEY_SECRET_PREFIX}{job_name}"


def presented(event: dict[str, Any], settings: Settings, logger: logging.Logger | logging.LoggerAdapter) -> str | None:
    """The Event's signature; None for an unsigned Event let through (counted, logged) when
    SDCGUARD_REQUIRE_SIGNED_ALARMS=false. Raises UnsignedAlarm / BadSignature (malformed)."""
    annotations = (event.get("metadata") or {}).get("annotations") or {}
    signature = annotations.get(names.ALARM_SIGNATURE_ANNOTATION)
    name = (event.get("metadata") or {}).get("name")
    if signature is None:
        if settings.require_signed_alarms:
            raise Rejected("UnsignedAlarm", f"the Event has no {names.ALARM_SIGNATURE_ANNOTATION} annotation "
                           "(SDCGUARD_REQUIRE_SIGNED_ALARMS is true)")
        metrics.ALARMS_UNSIGNED.inc()
        logger.warning(f"alarm Event {name} is unsigned; accepted because SDCGUARD_REQUIRE_SIGNED_ALARMS=false")
        return None
    if not _WELL_FORMED.match(signature):
        raise Rejected("BadSignature", f"{names.ALARM_SIGNATURE_ANNOTATION} is not "
                       f"{names.ALARM_SIGNATURE_SCHEME}=<64 hex digits>")
    return signature


def verify(record: dict[str, Any], text: str, signature: str) -> None:
    """The signature must match under the named job's key; raises BadSignature otherwise."""
    job = record["job"]
    key = job_key(job["namespace"], job["name"])
    if not events.signature_matches(key, text, signature):
        raise Rejected("BadSignature", f"the signature does not match the alarm under the key of "
                       f"{names.JOB_KIND} {job['namespace']}/{job['name']}")


def job_key(namespace: str, job_name: str) -> bytes:
    """The job's key bytes from its Secret; a missing or unusable Secret is a BadSignature."""
    name = secret_name(job_name)
    try:
        secret = kube.core().read_namespaced_secret(name, namespace)
    except Exception as exc:
        if kube.not_found(exc):
            raise Rejected("BadSignature", f"no alarm key Secret {namespace}/{name}: the job is not enabled, "
                           "or its key was deleted") from None
        raise
    encoded = (secret.data or {}).get(names.ALARM_KEY_DATA_KEY)
    try:
        key = base64.b64decode(encoded or "", validate=True)
    except (binascii.Error, ValueError):
        key = b""
    if len(key) < names.ALARM_KEY_MIN_BYTES:
        raise Rejected("BadSignature", f"Secret {namespace}/{name} holds no usable key "
                       f"(data.{names.ALARM_KEY_DATA_KEY} must have at least {names.ALARM_KEY_MIN_BYTES} bytes)")
    return key
