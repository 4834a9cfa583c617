"""The kopf handlers: registration only; each delegates in one line to the module that does the work."""
from __future__ import annotations

import logging
from typing import Any

import kopf

from sdcguard.contract import names

from . import alarm_keys, incident, intake, kube, metrics, replacement
from .settings import Settings

SETTINGS = Settings.from_env()
ALARM_FILTER = dict(field="reason", value=names.EVENT_REASON)


@kopf.on.startup()
def configure(settings: kopf.OperatorSettings, logger: logging.Logger, **_: Any) -> None:
    """Server-side field selector for alarm Events (client-side filter below too); quiet kopf Events."""
    settings.watching.field_selectors["v1", "events"] = f"reason={names.EVENT_REASON}"
    settings.posting.level = logging.WARNING
    settings.persistence.progress_storage = kopf.AnnotationsProgressStorage(prefix=names.GROUP)
    settings.persistence.diffbase_storage = kopf.AnnotationsDiffBaseStorage(prefix=names.GROUP,
                                                                            key="last-handled-configuration")
    kube.api_client()
    metrics.serve(SETTINGS.metrics_port)
    logger.info(f"sdcguard operator settings: {SETTINGS}")


@kopf.on.login()
def login(**kwargs: Any) -> kopf.ConnectionInfo | None:
    return kopf.login_with_service_account(**kwargs) or kopf.login_with_kubeconfig(**kwargs)


def _wants_key(annotations: kopf.Annotations, namespace: str | None, **_: Any) -> bool:
    return alarm_keys.job_enabled(annotations) and (not SETTINGS.namespaces or namespace in SETTINGS.namespaces)


@kopf.on.event(names.JOB_GROUP, names.JOB_VERSION, names.JOB_PLURAL, when=_wants_key)
def job_alarm_key(body: kopf.Body, type: str | None, logger: logging.Logger, **_: Any) -> None:
    """Every enabled PyTorchJob, also those listed at start-up (type None), gets its alarm key."""
    if type != "DELETED":
        alarm_keys.ensure(dict(body), logger)


@kopf.on.create("v1", "events", **ALARM_FILTER, backoff=SETTINGS.retry_seconds, retries=20)
def alarm_event(body: kopf.Body, patch: kopf.Patch, logger: logging.Logger, **_: Any) -> None:
    patch.metadata.annotations[names.INTAKE_ANNOTATION] = intake.handle(dict(body), SETTINGS, logger)


@kopf.on.resume(names.GROUP, names.VERSION, names.INCIDENTS, backoff=SETTINGS.retry_seconds)
@kopf.on.create(names.GROUP, names.VERSION, names.INCIDENTS, backoff=SETTINGS.retry_seconds)
def incident_contain(body: kopf.Body, **_: Any) -> None:
    incident.reconcile(dict(body), SETTINGS)


@kopf.timer(names.GROUP, names.VERSION, names.REPLACEMENTS, interval=SETTINGS.poll_seconds,
            backoff=SETTINGS.retry_seconds, when=replacement.is_open)
def replacement_tick(body: kopf.Body, **_: Any) -> None:
    replacement.reconcile(dict(body), SETTINGS)


@kopf.on.field(names.GROUP, names.VERSION, names.REPLACEMENTS, field="spec.decision", backoff=SETTINGS.retry_seconds)
def replacement_decided(body: kopf.Body, **_: Any) -> None:
    replacement.reconcile(dict(body), SETTINGS)
