"""Leader election for two (or more) replicas: a ``coordination.k8s.io/v1`` Lease, as client-go does it.

Why a Lease and not kopf peering: kopf's peering is built to pause deployed operators while a
developer runs one by hand; peers of the same priority *all* pause, a dead peer is noticed only
when its keep-alive expires, and kopf itself warns that it takes no locks.  A Lease is the API
server's own mutual exclusion: taking or renewing it is a write conditional on its
``resourceVersion``, so of two replicas exactly one wins, and every cluster tool understands it
(``kubectl get lease``).

Rules (client-go's ``leaderelection``):

- a follower takes the Lease only when its holder has not renewed it for ``lease_seconds``,
  measured on the follower's own clock from when it last saw the record change (no clock skew
  between pods matters);
- the leader renews every ``retry`` seconds and, if it has not managed to for ``renew_seconds``
  (shorter than the lease), or finds another holder, it exits at once (``os._exit``): by the time a
  follower may take over, the old leader no longer acts.  The pod restarts as a follower;
- on a clean shutdown (SIGTERM, a rolling upgrade) the leader empties ``holderIdentity`` so the
  other replica takes over within one retry period.

What only the leader does: every kopf handler (alarm intake, incidents, replacements, keys).  The
webhooks are served by every replica (see :mod:`.cli`).  Leadership is a liveness device, not the
only safety: every write is conditional on the ``resourceVersion`` it read, and every AWS call is
preceded by a claim in the object's status (:mod:`.replacement`), so a leader that was paused past
its lease still cannot make a second call for the same step.
"""
from __future__ import annotations

import datetime
import logging
import os
import threading
import time
from collections.abc import Callable
from typing import Any

import kubernetes

from . import kube, metrics
from .settings import Settings

log = logging.getLogger("sdcguard_operator.leader")


def _micro(now: datetime.datetime | None = None) -> str:
    now = now or datetime.datetime.now(datetime.timezone.utc)
    return now.strftime("%Y-%m-%dT%H:%M:%S.%fZ")


class Elector:
    """Take, hold and hand back the Lease ``settings.leader_lease`` in the operator's namespace."""

    def __init__(self, settings: Settings, identity: str | None = None,
                 clock: Callable[[], float] = time.monotonic, exit: Callable[[int], Any] = os._exit) -> None:
        self.name = settings.leader_lease
        self.namespace = settings.pod_namespace or "default"
        self.identity = identity or kube.identity()
        self.lease_seconds = settings.lease_seconds
        self.renew_seconds = settings.renew_seconds
        self.retry = min(2.0, settings.renew_seconds / 4)
        self._clock = clock
        self._exit = exit
        self._observed: tuple[Any, float] | None = None  # (holder, renewTime) and when we saw it change
        self._renewed = 0.0
        self._leading = False
        self._stopping = False

    def _api(self) -> kubernetes.client.CoordinationV1Api:
        return kubernetes.client.CoordinationV1Api(kube.api_client())

    def _spec(self, transitions: int, acquired: str | None = None) -> dict[str, Any]:
        now = _micro()
        return {"holderIdentity": self.identity, "leaseDurationSeconds": max(1, round(self.lease_seconds)),
                "acquireTime": acquired or now, "renewTime": now, "leaseTransitions": transitions}

    def try_acquire(self) -> bool | None:
        """One attempt to take or renew the Lease: True while we hold it, False while another
        does, None when our write conflicted (read again next round)."""
        sent = self._clock()  # a renewal counts from when it was asked for, not from its answer
        api = self._api()
        try:
            lease = api.read_namespaced_lease(self.name, self.namespace, _request_timeout=5)
        except kubernetes.client.ApiException as exc:
            if exc.status != 404:
                raise
            try:
                api.create_namespaced_lease(self.namespace, {
                    "apiVersion": "coordination.k8s.io/v1", "kind": "Lease",
                    "metadata": {"name": self.name, "namespace": self.namespace}, "spec": self._spec(0)},
                    _request_timeout=5)
            except kubernetes.client.ApiException as exc2:
                if exc2.status == 409:
                    return None
                raise
            return self._won(sent)
        spec = lease.spec
        holder = spec.holder_identity or ""
        record = (holder, str(spec.renew_time))
        now = self._clock()
        if self._observed is None or self._observed[0] != record:
            self._observed = (record, now)
        if holder and holder != self.identity and now - self._observed[1] < self.lease_seconds:
            return False  # held, and renewed recently enough as we see it
        transitions = int(spec.lease_transitions or 0) + (0 if holder == self.identity else 1)
        acquired = _micro(spec.acquire_time) if holder == self.identity and spec.acquire_time else None
        try:
            api.patch_namespaced_lease(self.name, self.namespace, {
                "metadata": {"resourceVersion": lease.metadata.resource_version},
                "spec": self._spec(transitions, acquired)}, _request_timeout=5)
        except kubernetes.client.ApiException as exc:
            if exc.status == 409:
                return None  # somebody else wrote first: read again next round
            raise
        return self._won(sent)

    def _won(self, sent: float) -> bool:
        if self._stopping:
            return True  # handing over: do not announce leadership again
        self._renewed = sent
        if not self._leading:
            log.info(f"sdcguard leader: {self.identity} holds Lease {self.namespace}/{self.name}")
            metrics.LEADER.set(1)
        self._leading = True
        return True

    def acquire(self, stop: threading.Event | None = None) -> bool:
        """Block until we hold the Lease (True), or ``stop`` is set (False)."""
        while stop is None or not stop.is_set():
            try:
                if self.try_acquire():
                    return True
            except Exception as exc:  # noqa: BLE001 — an unreachable API server: try again
                log.warning(f"sdcguard leader: cannot read Lease {self.namespace}/{self.name}: {exc}")
            if stop is not None:
                stop.wait(self.retry)
            else:
                time.sleep(self.retry)
        return False

    def hold(self, stop: threading.Event) -> None:
        """Renew until ``stop``; exit the process the moment leadership cannot be vouched for
        (a watchdog checks the deadline even while a renewal hangs)."""
        threading.Thread(target=self._watchdog, args=(stop,), name="sdcguard-lease-watchdog", daemon=True).start()
        while not stop.wait(self.retry):
            try:
                if self.try_acquire() is False:
                    self._lost("another replica holds the Lease")
                    return
            except Exception as exc:  # noqa: BLE001
                log.warning(f"sdcguard leader: renewing Lease {self.namespace}/{self.name} failed: {exc}")
            if self._clock() - self._renewed > self.renew_seconds:
                self._lost(f"not renewed for {self.renew_seconds:g}s")
                return

    def _watchdog(self, stop: threading.Event) -> None:
        while not stop.wait(min(0.1, self.retry)):
            if self._clock() - self._renewed > self.renew_seconds:
                self._lost(f"not renewed for {self.renew_seconds:g}s")
                return

    def start_holding(self) -> threading.Event:
        stop = threading.Event()
        threading.Thread(target=self.hold, args=(stop,), name="sdcguard-lease", daemon=True).start()
        return stop

    def _lost(self, why: str) -> None:
        log.error(f"sdcguard leader: {self.identity} lost Lease {self.namespace}/{self.name} ({why}); exiting "
                  "so that only one replica acts")
        metrics.LEADER.set(0)
        self._exit(1)

    def release(self) -> None:
        """Hand the Lease back (clean shutdown): the other replica need not wait for it to expire."""
        if not self._leading:
            return
        self._stopping = True
        self._leading = False
        metrics.LEADER.set(0)
        api = self._api()
        try:
            for _ in range(3):  # a renewal still in flight may win the race once
                lease = api.read_namespaced_lease(self.name, self.namespace, _request_timeout=5)
                if lease.spec.holder_identity != self.identity:
                    return
                try:
                    api.patch_namespaced_lease(self.name, self.namespace, {
                        "metadata": {"resourceVersion": lease.metadata.resource_version},
                        "spec": {"holderIdentity": "", "renewTime": _micro()}}, _request_timeout=5)
                except kubernetes.client.ApiException as exc:
                    if exc.status == 409:
                        continue
                    raise
                log.info(f"sdcguard leader: {self.identity} released Lease {self.namespace}/{self.name}")
                return
        except Exception as exc:  # noqa: BLE001 — it expires anyway
            log.warning(f"sdcguard leader: could not release Lease {self.namespace}/{self.name}: {exc}")
