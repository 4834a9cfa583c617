"""Signed alarms, the operator's side (docs/design.md §4): check an alarm Event's signature first.

A pod that may create Events must not be able to cordon nodes or suspend jobs, so an alarm counts
only when its ``sdcguard.dev/alarm-signature`` is the HMAC-SHA256, under the named job's key, of
the exact ``sdcguard.dev/alarm`` annotation text. The key is derived from the operator's master
key and the *live* job's namespace, name and uid (:mod:`.master_key`; the Secret
``sdcguard-alarm-key-<job>`` only carries it to the sidecar, see :mod:`.alarm_keys`): no tenant
Secret is read, and a key of an earlier job of the same name (another uid) never verifies.
A rejection raises :class:`validate.Rejected`; nothing is touched.
"""
from __future__ import annotations

import logging
import re
from typing import Any

from sdcguard.contract import events, names

from . import master_key, metrics
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
    if not isinstance(signature, str) or not _WELL_FORMED.fullmatch(signature):
        raise Rejected("BadSignature", f"{names.ALARM_SIGNATURE_ANNOTATION} is not "
                       f"{names.ALARM_SIGNATURE_SCHEME}=<64 hex digits>")
    return signature


def verify(record: dict[str, Any], text: str, signature: str, job_uid: str, settings: Settings) -> None:
    """The signature must match under the key of the live job (name *and* uid); BadSignature otherwise."""
    job = record["job"]
    key = master_key.job_key(settings, job["namespace"], job["name"], job_uid)
    if not events.signature_matches(key, text, signature):
        raise Rejected("BadSignature", f"the signature does not match the alarm under the key of "
                       f"{names.JOB_KIND} {job['namespace']}/{job['name']} (uid {job_uid})")
