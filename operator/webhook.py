"""The pod mutating webhook (docs/design.md §5, §9): wire sdcguard into the pods of an annotated PyTorchJob.

A pod created by the training operator carries the label ``training.kubeflow.org/job-name`` but
not its job's annotations, so the webhook reads the PyTorchJob itself through the API (a GET with a
2-second timeout, cached for 30 s because a job's pods arrive in a burst; a pod naming another uid
than the cached one reads it again). It fails open: when the job cannot be read, the pod is
admitted unchanged with a warning — the webhook never blocks pod creation, and its
``MutatingWebhookConfiguration`` says ``failurePolicy: Ignore`` for when it is down.
``sdcguard.dev/*`` annotations on the pod itself (from the replica's pod template) are honoured
too and win over the job's.

The tenant boundary (docs/design.md §9): only a pod whose controlling ownerReference is the live enabled
PyTorchJob (same name and uid) gets the sidecar — and with it the job's key; a pod with no owner,
another owner or a stale uid gets nothing (and, with ``SDCGUARD_JOB_CONTROLLER_USERS``, only pods
the training operator's user created). Every pod, enabled or not, loses each reference to an
alarm-key Secret outside the sidecar: secret and projected volumes of any name, ``env`` secret
refs, ``envFrom``.

An enabled pod gets: the ``sdcguard-sidecar`` container (a native sidecar: an init container with
``restartPolicy: Always``, so it stops when training ends and the pod can complete), the spool
``emptyDir`` mounted in every container, the downward-API ``POD_NAME`` / ``POD_NAMESPACE`` /
``NODE_NAME`` / ``POD_UID``, the job identity (``SDCGUARD_JOB_NAME`` / ``SDCGUARD_JOB_KIND`` /
``SDCGUARD_JOB_UID``: the library signs the uids into every alarm), and
``SDCGUARD_AUDIT_EVERY`` / ``SDCGUARD_WEIGHT_CHECK_EVERY`` from the annotations, a
``terminationGracePeriodSeconds`` of at least ``SDCGUARD_SIDECAR_GRACE_SECONDS`` (90; passed to
the sidecar as ``--grace-period``, so it keeps publishing while the pod ends), and — in the
sidecar container only — the job's alarm-signing key Secret ``sdcguard-alarm-key-<job>`` (docs/design.md §4;
``optional``, so a pod whose key the operator has not written yet still starts, and the sidecar
holds its records until the kubelet has put the key there). A bad value is a
warning in the admission response and the library's default applies; never a rejection. The
mutation is idempotent: mutating its own output changes nothing.

What the pod becomes is decided by the pure functions of :mod:`.pod_mutation` (tested directly);
this module only looks the job up and hands the result to kopf's patch (:class:`PodAdmission`).
The kopf handler is registered by :mod:`.main`; the server is :mod:`.webhook_server`.
"""
from __future__ import annotations

import asyncio
import copy
import functools
import logging
import os
import time
from dataclasses import dataclass, field
from typing import Any, Awaitable, Callable, Mapping

import kopf

from sdcguard.contract import names

from .pod_mutation import SidecarSettings, mutated, owned_by

log = logging.getLogger("sdcguard_operator.webhook")

HANDLER_ID = names.POD_WEBHOOK_ID  # also the URL path: kopf serves POST /<handler id>


# --- reading the job: through the API, short timeout, fail open -----------------------------

Fetch = Callable[[str, str], Awaitable[Mapping[str, Any] | None]]


class JobAnnotations:
    """The PyTorchJob's annotations, cached for ``ttl`` seconds per job."""

    def __init__(self, fetch: Fetch, ttl: float = 30.0, clock: Callable[[], float] = time.monotonic) -> None:
        self._fetch = fetch
        self._ttl = ttl
        self._clock = clock
        self._cache: dict[tuple[str, str], tuple[float, dict[str, str], str | None]] = {}

    async def get(self, namespace: str, name: str) -> tuple[dict[str, str] | None, str | None]:
        """(annotations, None), or (None, why not) when the job cannot be read."""
        annotations, _, problem = await self.lookup(namespace, name)
        return annotations, problem

    async def lookup(self, namespace: str, name: str) -> tuple[dict[str, str] | None, str | None, str | None]:
        """(annotations, uid, None), or (None, None, why not) when the job cannot be read. A uid is
        the job instance: a job recreated under the same name within the cache's lifetime has
        another, so the cache entry is only used for pods that name the cached uid."""
        key = (namespace, name)
        hit = self._cache.get(key)
        if hit and self._clock() - hit[0] < self._ttl:
            return hit[1], hit[2], None
        try:
            job = await self._fetch(namespace, name)
        except Exception as exc:  # noqa: BLE001 — any failure means: admit the pod as it is
            return None, None, f"could not read {names.JOB_KIND} {namespace}/{name} ({type(exc).__name__}: {exc})"
        if job is None:
            return None, None, f"{names.JOB_KIND} {namespace}/{name} not found"
        annotations = dict((job.get("metadata") or {}).get("annotations") or {})
        uid = (job.get("metadata") or {}).get("uid")
        now = self._clock()
        if len(self._cache) > 1024:  # forget finished jobs
            self._cache = {k: v for k, v in self._cache.items() if now - v[0] < self._ttl}
        self._cache[key] = (now, annotations, uid)
        return annotations, uid, None

    def forget(self, namespace: str, name: str) -> None:
        self._cache.pop((namespace, name), None)


def kubernetes_fetch(timeout: float = 2.0) -> Fetch:
    """A fetch through the official client: in-cluster credentials, else ``$KUBECONFIG``. The
    client is built on first use, so a missing configuration is a failed lookup (the pod is
    admitted unchanged), never a failed operator start-up."""
    from kubernetes import client, config

    apis: list[Any] = []

    def api() -> Any:
        if not apis:
            configuration = client.Configuration()
            if os.environ.get("KUBERNETES_SERVICE_HOST"):
                config.load_incluster_config(client_configuration=configuration)
            else:
                config.load_kube_config(config_file=os.environ.get("KUBECONFIG"),
                                        client_configuration=configuration)
            configuration.retries = 0
            apis.append(client.CustomObjectsApi(client.ApiClient(configuration)))
        return apis[0]

    def get(namespace: str, name: str) -> Mapping[str, Any] | None:
        try:
            return api().get_namespaced_custom_object(names.JOB_GROUP, names.JOB_VERSION, namespace,
                                                      names.JOB_PLURAL, name, _request_timeout=timeout)
        except client.exceptions.ApiException as exc:
            if exc.status == 404:
                return None
            raise

    async def fetch(namespace: str, name: str) -> Mapping[str, Any] | None:
        return await asyncio.wait_for(asyncio.to_thread(get, namespace, name), timeout + 0.5)

    return fetch


def lookup_timeout(env: Mapping[str, str]) -> float:
    """``SDCGUARD_WEBHOOK_LOOKUP_TIMEOUT``: seconds the webhook waits for the job (default 2)."""
    try:
        return float(env.get("SDCGUARD_WEBHOOK_LOOKUP_TIMEOUT") or 2.0)
    except ValueError:
        raise ValueError(f"SDCGUARD_WEBHOOK_LOOKUP_TIMEOUT must be a number, got "
                         f"{env.get('SDCGUARD_WEBHOOK_LOOKUP_TIMEOUT')!r}") from None


# --- the admission of one pod ------------------------------------------------------------------

@dataclass(slots=True)
class PodAdmission:
    """What the pod webhook works with, built when the operator starts (never at import): the
    job reader and the injected sidecar's settings."""

    jobs: JobAnnotations
    sidecar: SidecarSettings = field(default_factory=SidecarSettings)

    @classmethod
    def from_env(cls, env: Mapping[str, str]) -> "PodAdmission":
        """``SDCGUARD_SIDECAR_*`` and ``SDCGUARD_WEBHOOK_LOOKUP_TIMEOUT`` (checked at start by
        :func:`sdcguard_operator.main.load_settings`)."""
        return cls(JobAnnotations(kubernetes_fetch(lookup_timeout(env))), SidecarSettings.from_env(env))

    async def admit(self, pod: dict[str, Any], userinfo: Mapping[str, Any], patch: kopf.Patch,
                    warnings: list[str], logger: logging.Logger | logging.LoggerAdapter) -> None:
        """Admission of a pod of a Kubeflow job: look the job up, let :func:`mutated` decide, and
        hand the result to kopf's ``patch`` (kopf diffs it into a JSONPatch)."""
        meta = pod.get("metadata") or {}
        name = (meta.get("labels") or {}).get(names.JOB_NAME_LABEL, "")
        annotations, uid, problem = None, None, None
        if name:
            namespace = meta.get("namespace") or "default"
            annotations, uid, problem = await self.jobs.lookup(namespace, name)
            if uid and not owned_by(pod, name, uid):  # perhaps recreated since it was cached
                self.jobs.forget(namespace, name)
                annotations, uid, problem = await self.jobs.lookup(namespace, name)
        if problem:
            logger.warning(f"sdcguard: {problem}; no sidecar")
            warnings.append(f"sdcguard: {problem}; no sidecar")
        result, notes = mutated(pod, annotations, self.sidecar, uid, str(userinfo.get("username") or ""))
        warnings.extend(notes)
        if result is not None:
            patch.fns.append(functools.partial(_become, result))


def _become(result: Mapping[str, Any], target: dict[str, Any]) -> None:
    """A kopf patch function: turn kopf's copy of the pod into ``result``."""
    target.clear()
    target.update(copy.deepcopy(dict(result)))
