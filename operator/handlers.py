"""The kopf handlers: each delegates in one line to the module that does the work.

``register(registry, settings)`` puts them into a registry; :mod:`.main` calls it (kopf's default
registry for ``kopf run -m sdcguard_operator``; a registry of their own for ``sdcguard operator``,
which runs them only while this replica is the leader, :mod:`.leader`). Nothing happens at import.
"""
from __future__ import annotations

import concurrent.futures
import logging
from typing import Any

import kopf

from sdcguard.contract import names

from . import alarm_keys, incident, intake, kube, metrics, replacement, validate
from .settings import Settings

SETTINGS: Settings = Settings()
"""The settings the handlers act on: set once at start by :func:`register` (see :mod:`.main`)."""
#: The threads the (synchronous) handlers run in, ours so that a stopping replica can wait for the
#: ones still running (an AWS call in flight) before it hands the Lease over (:mod:`.cli`).
EXECUTOR = concurrent.futures.ThreadPoolExecutor(max_workers=16, thread_name_prefix="sdcguard-handler")


def configure(settings: kopf.OperatorSettings, logger: logging.Logger, **_: Any) -> None:
    """A server-side field selector for alarm Events (the cluster's other Events cost nothing);
    quiet kopf Events; the handler threads; progress kept in annotations."""
    settings.watching.field_selectors["v1", "events"] = f"reason={names.EVENT_REASON}"
    settings.posting.level = logging.WARNING
    settings.execution.executor = EXECUTOR
    settings.persistence.progress_storage = kopf.AnnotationsProgressStorage(prefix=names.GROUP)
    settings.persistence.diffbase_storage = kopf.AnnotationsDiffBaseStorage(prefix=names.GROUP,
                                                                            key="last-handled-configuration")
    kube.api_client()
    metrics.serve(SETTINGS.metrics_port)
    logger.info(f"sdcguard operator settings: {SETTINGS}")


def login(**kwargs: Any) -> kopf.ConnectionInfo | None:
    return kopf.login_with_service_account(**kwargs) or kopf.login_with_kubeconfig(**kwargs)


def _wants_key(annotations: kopf.Annotations, namespace: str | None, **_: Any) -> bool:
    return validate.job_enabled(annotations) and (not SETTINGS.namespaces or namespace in SETTINGS.namespaces)


def job_alarm_key(body: kopf.Body, type: str | None, logger: logging.Logger, **_: Any) -> None:
    """Every enabled PyTorchJob, also those listed at start-up (type None), gets its alarm key."""
    if type != "DELETED":
        alarm_keys.ensure(dict(body), SETTINGS, logger)


def job_alarm_key_recheck(body: kopf.Body, logger: logging.Logger, **_: Any) -> None:
    """A key Secret deleted while its job lives is recreated (the job itself may never change)."""
    alarm_keys.ensure(dict(body), SETTINGS, logger)


def alarm_event(body: kopf.Body, patch: kopf.Patch, logger: logging.Logger, **_: Any) -> None:
    patch.metadata.annotations[names.INTAKE_ANNOTATION] = intake.record(dict(body), intake.handle(
        dict(body), SETTINGS, logger))


def incident_contain(body: kopf.Body, **_: Any) -> None:
    incident.reconcile(dict(body), SETTINGS)


def replacement_tick(body: kopf.Body, **_: Any) -> None:
    replacement.reconcile(dict(body), SETTINGS)


def replacement_decided(body: kopf.Body, **_: Any) -> None:
    replacement.reconcile(dict(body), SETTINGS)


def replacement_released(body: kopf.Body, **_: Any) -> None:
    replacement.release(dict(body), SETTINGS)


def replacement_changed(body: kopf.Body, type: str | None, **_: Any) -> None:
    """The incidents a NodeReplacement serves read its phase (the replacement never writes them)."""
    if type != "DELETED":
        incident.replacement_changed(dict(body))


def register(registry: kopf.OperatorRegistry, settings: Settings, *, with_login: bool = True) -> None:
    global SETTINGS
    SETTINGS = settings
    on = kopf.on
    on.startup(registry=registry, id="sdcguard-configure")(configure)
    if with_login:
        on.login(registry=registry, id="sdcguard-login")(login)
    on.event(names.JOB_GROUP, names.JOB_VERSION, names.JOB_PLURAL, registry=registry, id="job_alarm_key",
             when=_wants_key)(job_alarm_key)
    kopf.timer(names.JOB_GROUP, names.JOB_VERSION, names.JOB_PLURAL, registry=registry, id="job_alarm_key_recheck",
               interval=SETTINGS.key_recheck_seconds, when=_wants_key)(job_alarm_key_recheck)
    on.create("v1", "events", registry=registry, id="alarm_event", backoff=SETTINGS.retry_seconds,
              retries=20)(alarm_event)
    for decorator in (on.resume, on.create):
        decorator(names.GROUP, names.VERSION, names.INCIDENTS, registry=registry, id="incident_contain",
                  backoff=SETTINGS.retry_seconds)(incident_contain)
    kopf.timer(names.GROUP, names.VERSION, names.INCIDENTS, registry=registry, id="incident_tick",
               interval=SETTINGS.storm_guard_recheck_seconds, initial_delay=SETTINGS.storm_guard_recheck_seconds,
               backoff=SETTINGS.retry_seconds, when=incident.needs_work)(incident_contain)
    kopf.timer(names.GROUP, names.VERSION, names.REPLACEMENTS, registry=registry, id="replacement_tick",
               interval=SETTINGS.poll_seconds, backoff=SETTINGS.retry_seconds,
               when=replacement.is_open)(replacement_tick)
    on.field(names.GROUP, names.VERSION, names.REPLACEMENTS, field="spec.decision", registry=registry,
             id="replacement_decided", backoff=SETTINGS.retry_seconds)(replacement_decided)
    on.field(names.GROUP, names.VERSION, names.REPLACEMENTS, field="spec.release", registry=registry,
             id="replacement_released", backoff=SETTINGS.retry_seconds)(replacement_released)
    on.event(names.GROUP, names.VERSION, names.REPLACEMENTS, registry=registry, id="replacement_changed")(
        replacement_changed)

