"""The operator's entry point: the one module that registers sdcguard's kopf handlers and webhooks.

``kopf run -m sdcguard_operator.main`` imports it, and importing it adds exactly one thing to
kopf's default registry: the startup hook :func:`start`. That hook reads the settings (a bad one is
a single line on stderr and exit status 2, never a traceback), configures kopf, and registers
everything else (:func:`register`). ``sdcguard operator`` (:mod:`.cli`) reads the settings itself,
flags over the environment, and calls :func:`register` on registries of its own (the handlers only
while it leads, :mod:`.leader`).

Every handler below is thin: it delegates in one line to a plain function of the module named for
its job (:mod:`.intake`, :mod:`.incident`, :mod:`.replacement`, :mod:`.alarm_keys`,
:mod:`.webhook`, :mod:`.admission`, :mod:`.telemetry`), with explicit arguments so that function is
tested directly.
No other module of the package registers anything or reads a setting when it is imported.
"""
from __future__ import annotations

import concurrent.futures
import logging
import os
import sys
import threading
from typing import Any, Mapping

import kopf

from sdcguard.contract import names

from . import (admission, alarm_keys, incident, intake, kube, metrics, pod_mutation, replacement, resume_intake,
               retention, telemetry, validate, webhook)
from .settings import Settings
from .webhook_server import server_from_env

ENTRY = "sdcguard_operator.main"
"""What ``kopf run -m`` is given (``sdcguard operator --no-leader-election`` runs kopf with it too)."""


class BadSettings(SystemExit):
    """A setting that cannot be used: said on one line, exit status 2."""


def load_settings(env: Mapping[str, str] | None = None, *, prog: str = "sdcguard operator") -> Settings:
    """The operator's settings and the pod webhook's, checked; exit 2 on a bad one."""
    env = os.environ if env is None else env
    try:
        settings = Settings.from_env(env)
        pod_mutation.SidecarSettings.from_env(env)
        webhook.lookup_timeout(env)
    except ValueError as exc:
        print(f"{prog}: error: {exc}", file=sys.stderr, flush=True)
        raise BadSettings(2) from None
    return settings


# --- the handler threads: built on first use ----------------------------------------------------

_executor: concurrent.futures.ThreadPoolExecutor | None = None
_executor_lock = threading.Lock()


def executor() -> concurrent.futures.ThreadPoolExecutor:
    """The threads the (synchronous) handlers run in, ours so that a stopping replica can wait for
    the ones still running (an AWS call in flight) before it hands the Lease over (:mod:`.cli`)."""
    global _executor
    with _executor_lock:
        if _executor is None:
            _executor = concurrent.futures.ThreadPoolExecutor(max_workers=16, thread_name_prefix="sdcguard-handler")
        return _executor


def drain() -> None:
    """Wait for the handler threads still running (none if no handler ever ran)."""
    with _executor_lock:
        pool = _executor
    if pool is not None:
        pool.shutdown(wait=True, cancel_futures=True)


# --- start-up ---------------------------------------------------------------------------------

def configure(kopf_settings: kopf.OperatorSettings, logger: logging.Logger | logging.LoggerAdapter,
              settings: Settings, *, handlers_too: bool = True, webhooks_too: bool = True) -> None:
    """kopf's settings for what this registry runs. Handlers: a server-side field selector for
    alarm Events (the cluster's other Events cost nothing), quiet kopf Events, our handler threads,
    progress kept in annotations, the API client and the metrics endpoint. Webhooks: the admission
    server (kopf refuses to start with admission handlers and none); the webhook configuration is
    the chart's, not kopf's (``managed`` stays None: no RBAC on webhook configurations)."""
    if handlers_too:
        kopf_settings.watching.field_selectors["v1", "events"] = f"reason={names.EVENT_REASON}"
        kopf_settings.posting.level = logging.WARNING
        kopf_settings.execution.executor = executor()
        kopf_settings.persistence.progress_storage = kopf.AnnotationsProgressStorage(prefix=names.GROUP)
        kopf_settings.persistence.diffbase_storage = kopf.AnnotationsDiffBaseStorage(
            prefix=names.GROUP, key="last-handled-configuration")
        kube.api_client()
        metrics.serve(settings.metrics_port)
        logger.info(f"sdcguard operator settings: {settings}")
    if webhooks_too:
        kopf_settings.admission.server = server_from_env(os.environ)


async def start(settings: kopf.OperatorSettings, logger: logging.Logger, **_: Any) -> None:
    """``kopf run -m sdcguard_operator.main``: read the settings, configure, register the rest.

    A bad setting ends the process here with its one line and status 2: nothing has started yet
    (kopf runs its startup hooks before any watch, webhook or handler), so there is nothing to
    stop, and unwinding kopf's half-built tasks would only add warnings to that line."""
    try:
        operator_settings = load_settings(prog=f"kopf run -m {ENTRY}")
    except BadSettings as exc:
        logging.shutdown()
        os._exit(int(exc.code or 2))
    configure(settings, logger, operator_settings)
    register(kopf.get_default_registry(), operator_settings, at_startup=False)


def login(**kwargs: Any) -> kopf.ConnectionInfo | None:
    return kopf.login_with_service_account(**kwargs) or kopf.login_with_kubeconfig(**kwargs)


# --- registration -------------------------------------------------------------------------------

def register(registry: kopf.OperatorRegistry, settings: Settings, *, handlers_too: bool = True,
             webhooks_too: bool = True, with_login: bool = True, at_startup: bool = True) -> None:
    """Every kopf handler sdcguard has, into ``registry``: the handlers (alarm intake, incidents,
    replacements, keys) and the webhooks (pod mutation, NodeReplacement admission), acting on
    ``settings``. ``at_startup``: also the startup hook that configures kopf (False when called
    from one, :func:`start`)."""
    if at_startup:
        operator_settings = settings

        def configure_kopf(settings: kopf.OperatorSettings, logger: logging.Logger, **_: Any) -> None:
            configure(settings, logger, operator_settings, handlers_too=handlers_too, webhooks_too=webhooks_too)
        kopf.on.startup(registry=registry, id="sdcguard-configure")(configure_kopf)
    if with_login:
        kopf.on.login(registry=registry, id="sdcguard-login")(login)
    if handlers_too:
        _register_handlers(registry, settings)
    if webhooks_too:
        _register_webhooks(registry, settings)


def _register_handlers(registry: kopf.OperatorRegistry, settings: Settings) -> None:
    on = kopf.on
    replacement.install_seal(settings)  # every NodeReplacement status write is sealed, every read checked

    def wants_key(annotations: kopf.Annotations, namespace: str | None, **_: Any) -> bool:
        return validate.job_enabled(annotations) and (not settings.namespaces or namespace in settings.namespaces)

    @on.event(names.JOB_GROUP, names.JOB_VERSION, names.JOB_PLURAL, registry=registry, id="job_alarm_key",
              when=wants_key)
    def job_alarm_key(body: kopf.Body, type: str | None, logger: logging.Logger, **_: Any) -> None:
        """Every enabled PyTorchJob, also those listed at start-up (type None), gets its alarm key."""
        if type != "DELETED":
            alarm_keys.ensure(dict(body), settings, logger)

    @kopf.timer(names.JOB_GROUP, names.JOB_VERSION, names.JOB_PLURAL, registry=registry, id="job_alarm_key_recheck",
                interval=settings.key_recheck_seconds, when=wants_key)
    def job_alarm_key_recheck(body: kopf.Body, logger: logging.Logger, **_: Any) -> None:
        """A key Secret deleted while its job lives is recreated (the job itself may never change)."""
        alarm_keys.ensure(dict(body), settings, logger)

    @on.create("v1", "events", registry=registry, id="alarm_event", backoff=settings.retry_seconds,
               retries=settings.intake_retries)
    def alarm_event(body: kopf.Body, patch: kopf.Patch, logger: logging.Logger, retry: int = 0, **_: Any) -> None:
        """The last try turns a still-failing Event into a counted rejection (never a silent drop).
        A resumed run's Event (same reason, type Normal) goes to :mod:`.resume_intake`."""
        receive = resume_intake.receive if resume_intake.is_resume(dict(body)) else intake.receive
        patch.metadata.annotations[names.INTAKE_ANNOTATION] = receive(
            dict(body), settings, logger, final=retry >= settings.intake_retries - 1)

    def incident_contain(body: kopf.Body, **_: Any) -> None:
        incident.reconcile(dict(body), settings)

    for decorator in (on.resume, on.create):
        decorator(names.GROUP, names.VERSION, names.INCIDENTS, registry=registry, id="incident_contain",
                  backoff=settings.retry_seconds)(incident_contain)
    kopf.timer(names.GROUP, names.VERSION, names.INCIDENTS, registry=registry, id="incident_tick",
               interval=settings.storm_guard_recheck_seconds, initial_delay=settings.storm_guard_recheck_seconds,
               backoff=settings.retry_seconds, when=incident.needs_work)(incident_contain)
    kopf.timer(names.GROUP, names.VERSION, names.INCIDENTS, registry=registry, id="incident_history",
               interval=settings.storm_guard_recheck_seconds, initial_delay=settings.storm_guard_recheck_seconds,
               backoff=settings.retry_seconds, when=incident.needs_history)(
                   lambda body, **_: incident.judge(dict(body), settings))  # layer 7 retried on its own

    # A safety net, not the path: each incident waiting for approval re-reads its replacements
    # every SDCGUARD_RESYNC_SECONDS (10 min), for a phase whose watch event was lost.
    kopf.timer(names.GROUP, names.VERSION, names.INCIDENTS, registry=registry, id="incident_follow",
               interval=settings.resync_seconds, initial_delay=settings.resync_seconds, backoff=settings.retry_seconds,
               when=incident.awaits_replacements)(
                   lambda body, **_: incident.follow_replacements(dict(body), settings))  # on.event is not retried
    kopf.timer(names.GROUP, names.VERSION, names.INCIDENTS, registry=registry, id="incident_condition",
               interval=settings.storm_guard_recheck_seconds, initial_delay=settings.storm_guard_recheck_seconds,
               backoff=settings.retry_seconds, when=incident.needs_announcing)(
                   lambda body, retry, **_: incident.announce_held(dict(body), settings, retry))  # nodes with no replacement

    if settings.incident_retention_seconds > 0:
        @kopf.timer(names.GROUP, names.VERSION, names.INCIDENTS, registry=registry, id="incident_retention",
                    interval=retention.check_interval(settings), backoff=settings.retry_seconds,
                    when=lambda status, **_: retention.settled(status))
        def incident_retention(body: kopf.Body, **_: Any) -> None:
            """An incident with nothing in flight is deleted once past SDCGUARD_INCIDENT_RETENTION."""
            retention.collect(dict(body), settings)

    if settings.prometheus_url:
        @kopf.timer(names.GROUP, names.VERSION, names.INCIDENTS, registry=registry, id="incident_telemetry",
                    interval=settings.poll_seconds, backoff=settings.retry_seconds, when=telemetry.due)
        async def incident_telemetry(body: kopf.Body, **_: Any) -> None:
            """The suspect GPUs' DCGM telemetry, in its own handler once containment has acted and in
            threads of its own (async: it holds none of the executor's): a slow or absent
            Prometheus never delays intake or the cordon (docs/telemetry.md)."""
            await telemetry.run(dict(body), settings)

    @kopf.timer(names.GROUP, names.VERSION, names.REPLACEMENTS, registry=registry, id="replacement_tick",
                interval=settings.poll_seconds, backoff=settings.retry_seconds, when=replacement.is_open)
    def replacement_tick(body: kopf.Body, **_: Any) -> None:
        replacement.reconcile(dict(body), settings)

    @on.field(names.GROUP, names.VERSION, names.REPLACEMENTS, field="spec.decision", registry=registry,
              id="replacement_decided", backoff=settings.retry_seconds)
    def replacement_decided(body: kopf.Body, **_: Any) -> None:
        replacement.reconcile(dict(body), settings)

    @on.field(names.GROUP, names.VERSION, names.REPLACEMENTS, field="spec.release", registry=registry,
              id="replacement_released", backoff=settings.retry_seconds)
    def replacement_released(body: kopf.Body, **_: Any) -> None:
        replacement.release(dict(body), settings)

    @on.event(names.GROUP, names.VERSION, names.REPLACEMENTS, registry=registry, id="replacement_changed")
    def replacement_changed(body: kopf.Body, type: str | None, **_: Any) -> None:
        """The incidents a NodeReplacement serves read its phase (the replacement never writes them)."""
        if type != "DELETED":
            replacement.check_seal(dict(body), settings)
            incident.replacement_changed(dict(body))


def _register_webhooks(registry: kopf.OperatorRegistry, settings: Settings) -> None:
    pods = webhook.PodAdmission.from_env(os.environ)

    @kopf.on.mutate("", "v1", "pods", registry=registry, id=webhook.HANDLER_ID, operations=["CREATE"],
                    ignore_failures=True, side_effects=False)
    async def mutate_pod(body: kopf.Body, patch: kopf.Patch, warnings: list[str], logger: logging.Logger,
                         userinfo: Mapping[str, Any] | None = None, **_: Any) -> None:
        """Admission of a pod of a Kubeflow job (never blocks it: ``ignore_failures``)."""
        await pods.admit(dict(body), userinfo or {}, patch, warnings, logger)

    @kopf.on.validate("", "v1", "pods", subresource="ephemeralcontainers", registry=registry,
                      id=names.EPHEMERAL_WEBHOOK_ID, operations=["UPDATE"], side_effects=False)
    async def ephemeral_containers(body: kopf.Body, old: kopf.Body | None, **_: Any) -> None:
        """``kubectl debug``: an ephemeral container may not mount or read an alarm key (the chart
        registers this one fail closed; the key is the sidecar's alone, docs/design.md §9)."""
        problems = pod_mutation.ephemeral_key_references(dict(body), dict(old) if old else None)
        if problems:
            raise kopf.AdmissionError("sdcguard: " + "; ".join(problems) + ": only the sdcguard sidecar may read "
                                      "the job's alarm key", code=403)

    @kopf.on.mutate(names.GROUP, names.VERSION, names.REPLACEMENTS, registry=registry, id=admission.HANDLER_ID,
                    operations=["CREATE", "UPDATE"], side_effects=False)
    async def admit_replacement(body: kopf.Body, old: kopf.Body | None, new: kopf.Body | None, operation: str | None,
                                userinfo: Mapping[str, Any], patch: kopf.Patch, **_: Any) -> None:
        """Who decided a NodeReplacement, whether they may, and its fixed target."""
        await admission.admit(body.metadata.name or "", operation or "", (old or {}).get("spec"),
                              (new or body).get("spec"), userinfo, patch, settings.operator_username)


# ``kopf run -m sdcguard_operator.main``: the one registration made at import; it reads nothing.
kopf.on.startup(id="sdcguard-start")(start)
