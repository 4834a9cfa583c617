"""``sdcguard sidecar``: publish spooled alarm records as Kubernetes Events; serve metrics.

The training process never talks to the API server (docs/design.md §4): it leaves each alarm record in the
spool (an ``emptyDir`` shared with this container). This loop turns every record into the Event
docs/design.md §4 defines and only then moves the file to ``<spool>/published/``: a record stays in the spool
until an Event exists for it, so nothing is lost while the API server is slow or down. The Event
name is derived from the alarm id, so a retry after a crash is answered 409 ("already there") and
counts as published: no duplicates. A file that is not a valid record (corrupt, or written by
something that does not write atomically and has stopped changing) is moved to
``<spool>/quarantine/`` with one error line, so it can never crash-loop the sidecar; so is a
record whose Event the API server rejects as invalid (400/413/422), so it cannot block the others.
Published records are kept in ``published/`` (not deleted) as an audit trail for the pod's life.

Every Event is signed (docs/design.md §4) with the job's key from the mounted Secret (``--key-file``,
:mod:`.signing`), reread when it changes. Without a usable key the records wait in the spool
(``sdcguard_sidecar_publish_errors_total{reason="no-key"}``) — unless ``--allow-unsigned``, for an
operator that runs with ``SDCGUARD_REQUIRE_SIGNED_ALARMS=false``.

Standard library, ``kubernetes`` and ``prometheus_client`` only: no torch (the image is small).
"""
from __future__ import annotations

import argparse
import json
import logging
import os
import random
import signal
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Mapping, Protocol

from prometheus_client import CollectorRegistry

from ..contract import alarm as _alarm
from ..contract import events
from ..contract import names
from ..contract import resume as _resume
from ..contract import spool
from .metrics import HealthState, PublisherMetrics, RankStatsCollector, serve
from .signing import AlarmKey

log = logging.getLogger("sdcguard.sidecar")

PUBLISHED_DIR = spool.PUBLISHED_DIR  # the confirmation the library waits for (contract/spool.py)
QUARANTINE_DIR = spool.QUARANTINE_DIR
GRACE_MARGIN = 3.0
"""Seconds of the pod's termination grace period left unused, so the sidecar exits on its own
(logging what it could not publish) before the kubelet's SIGKILL."""


class PublishError(Exception):
    """The Event could not be created now; the record stays in the spool for the next try —
    unless ``permanent``: the API server rejected the Event itself (400/413/422, e.g. an
    annotation over the size limit), which no retry can fix."""

    def __init__(self, reason: str, detail: str, permanent: bool = False) -> None:
        super().__init__(f"{reason}: {detail}")
        self.reason = reason
        self.permanent = permanent


REJECTED = (400, 413, 422)


class EventSink(Protocol):
    def create(self, namespace: str, body: dict[str, Any]) -> bool:
        """Create the Event; True if created, False if it already existed; else PublishError."""

    def annotations(self, namespace: str, name: str) -> dict[str, str] | None:
        """The annotations of an existing Event (None: it is gone); else PublishError."""


class KubeEventSink:
    """Events through the official ``kubernetes`` client, with our own timeouts and no client-side
    retries (the loop owns the backoff, so an outage costs one short attempt per round)."""

    def __init__(self, kubeconfig: str | None, timeout: tuple[float, float] = (3.0, 10.0)) -> None:
        from kubernetes import client, config

        configuration = client.Configuration()
        if kubeconfig:
            config.load_kube_config(config_file=kubeconfig, client_configuration=configuration)
        else:
            config.load_incluster_config(client_configuration=configuration)
        configuration.retries = 0
        self._core = client.CoreV1Api(client.ApiClient(configuration))
        self._api_exception = client.exceptions.ApiException
        self._timeout = timeout

    def create(self, namespace: str, body: dict[str, Any]) -> bool:
        import urllib3

        try:
            self._core.create_namespaced_event(
                namespace, body, _request_timeout=self._timeout, _preload_content=False)
            return True
        except self._api_exception as exc:
            if exc.status == 409:
                return False
            raise PublishError(str(exc.status or "unreachable"), f"{exc.reason} {str(exc.body or '')[:300]}",
                               permanent=exc.status in REJECTED) from None
        except (urllib3.exceptions.HTTPError, OSError) as exc:
            raise PublishError("unreachable", str(exc)) from None

    def annotations(self, namespace: str, name: str) -> dict[str, str] | None:
        import urllib3

        try:
            event = self._core.read_namespaced_event(name, namespace, _request_timeout=self._timeout)
        except self._api_exception as exc:
            if exc.status == 404:
                return None
            raise PublishError(str(exc.status or "unreachable"), f"{exc.reason}") from None
        except (urllib3.exceptions.HTTPError, OSError) as exc:
            raise PublishError("unreachable", str(exc)) from None
        return dict(event.metadata.annotations or {})


SIGNED = (names.ALARM_ANNOTATION, names.RESUME_ANNOTATION, names.ALARM_SIGNATURE_ANNOTATION)
FRESH_NAME_TRIES = 3


def fresh_name(body: dict[str, Any], attempt: int) -> str:
    """Another name for an alarm's Event when its own is taken by an Event that is not this alarm:
    the usual name plus a digest of the signature (or text), which nobody without the key can
    foresee, so the name cannot be taken in advance; later attempts add a random part."""
    import hashlib

    annotations = body["metadata"]["annotations"]
    digest = hashlib.sha256((annotations.get(names.ALARM_SIGNATURE_ANNOTATION) or annotations.get(names.ALARM_ANNOTATION)
                             or annotations.get(names.RESUME_ANNOTATION) or "").encode()).hexdigest()[:12]
    suffix = digest if attempt == 1 else f"{digest[:6]}{random.getrandbits(32):08x}"
    return f"{body['metadata']['name'][:253 - len(suffix) - 1]}-{suffix}"


@dataclass(slots=True)
class Identity:
    """Where this sidecar runs (downward API); used when a record names no pod or no job."""

    namespace: str
    pod: str | None
    node: str | None

    @classmethod
    def from_env(cls, env: Mapping[str, str]) -> "Identity":
        return cls(env.get(names.ENV_POD_NAMESPACE) or "default", env.get(names.ENV_POD_NAME) or None,
                   env.get(names.ENV_NODE_NAME) or None)


class Publisher:
    """One pass at a time over the spool, oldest record first."""

    def __init__(
        self, spool_dir: Path, sink: EventSink, identity: Identity, metrics: PublisherMetrics,
        key: AlarmKey, allow_unsigned: bool = False, settle: float = 2.0, clock: Callable[[], float] = time.time,
    ) -> None:
        self.spool = spool_dir
        self.sink = sink
        self.identity = identity
        self.metrics = metrics
        self.key = key
        self.allow_unsigned = allow_unsigned
        self.settle = settle
        self._clock = clock

    def run_once(self) -> bool:
        """Publish what the spool holds; False when the API server failed us or there is no key
        to sign with (back off)."""
        paths = spool.list_records(self.spool)
        self.metrics.backlog.set(len(paths))
        if not paths:
            return True
        key = self.key.current()
        if key is None and not self.allow_unsigned:
            self.metrics.errors.labels("no-key").inc()
            return False
        for path in paths:
            body = self._event_for(path, key)
            if body is None:
                continue
            try:
                created = self._publish(body)
            except PublishError as exc:
                self.metrics.errors.labels(exc.reason).inc()
                if exc.permanent:
                    target = self._move(path, QUARANTINE_DIR)
                    self.metrics.quarantined.inc()
                    self.metrics.backlog.dec()
                    log.error("sdcguard sidecar: the API server rejected the Event for %s; quarantined -> %s: %s",
                              path.name, target, exc)
                    continue
                log.warning("sdcguard sidecar: cannot publish %s yet (%s); it stays in the spool", path.name, exc)
                return False
            if created:
                self.metrics.published.labels((body["metadata"].get("labels") or {}).get(names.CHECK_LABEL)
                                              or "resume").inc()
                self.metrics.last_success.set(time.time())
                log.info("sdcguard sidecar: published %s as Event %s/%s", path.name,
                         body["metadata"]["namespace"], body["metadata"]["name"])
            else:
                self.metrics.already_published.inc()
                log.info("sdcguard sidecar: Event %s/%s already exists (published before a restart)",
                         body["metadata"]["namespace"], body["metadata"]["name"])
            self._move(path, PUBLISHED_DIR)
            self.metrics.backlog.dec()
        return True

    def backlog(self) -> int:
        return len(spool.list_records(self.spool))

    def _publish(self, body: dict[str, Any]) -> bool:
        """Create the Event; on 409 read the one of that name: if it carries this very alarm and
        signature, it was published before (False); if not, someone took the name (a pre-created
        Event would otherwise suppress the alarm without a trace): publish under a fresh name,
        count it and say so (True)."""
        namespace, original = body["metadata"]["namespace"], body["metadata"]["name"]
        for attempt in range(FRESH_NAME_TRIES + 1):
            if self.sink.create(namespace, body):
                return True
            existing = self.sink.annotations(namespace, body["metadata"]["name"])
            wanted = {k: body["metadata"]["annotations"].get(k) for k in SIGNED}
            if existing is not None and {k: existing.get(k) for k in SIGNED} == wanted:
                return False
            self.metrics.name_taken.inc()
            log.error("sdcguard sidecar: Event %s/%s exists but is not this alarm (%s): someone took its name; "
                      "publishing under another", namespace, body["metadata"]["name"],
                      "gone since" if existing is None else "other annotation or signature")
            body = {**body, "metadata": {**body["metadata"], "name": fresh_name(
                {**body, "metadata": {**body["metadata"], "name": original}}, attempt + 1)}}
        raise PublishError("name-taken", f"every name tried for the Event of {original} is taken")

    def _event_for(self, path: Path, key: bytes | None) -> dict[str, Any] | None:
        """The Event body for a spool file; None (after quarantining it if need be) otherwise."""
        try:
            raw = path.read_bytes()
            mtime = path.stat().st_mtime
        except FileNotFoundError:
            return None  # moved away meanwhile (another pass, or the user)
        except OSError as exc:
            log.warning("sdcguard sidecar: cannot read %s (%s); skipping it this pass", path.name, exc)
            return None
        try:
            if path.name.endswith(spool.RESUME_SUFFIX):  # a run started from a checkpoint (contract/resume.py)
                return events.build_resume_event(_resume.loads(raw), fallback_pod=self.identity.pod,
                                                 host=self.identity.node, key=key)
            record = _alarm.loads(raw)
            return events.build_event(record, fallback_namespace=self.identity.namespace,
                                      fallback_pod=self.identity.pod, host=self.identity.node, key=key)
        except (_alarm.AlarmError, ValueError) as exc:
            if self._clock() - mtime < self.settle:
                return None  # maybe still being written by a non-atomic writer: look again later
            target = self._move(path, QUARANTINE_DIR)
            self.metrics.quarantined.inc()
            self.metrics.backlog.dec()
            log.error("sdcguard sidecar: quarantined corrupt spool file %s -> %s: %s", path.name, target, exc)
            return None

    def _move(self, path: Path, subdir: str) -> Path:
        target_dir = self.spool / subdir
        target_dir.mkdir(exist_ok=True)
        target = target_dir / path.name
        if target.exists():
            target = target_dir / f"{path.name}.{time.time_ns()}"
        os.replace(path, target)
        return target


class Backoff:
    """Exponential backoff with jitter (many sidecars must not hit a recovering API server at
    the same instant)."""

    def __init__(self, initial: float, maximum: float, rng: random.Random | None = None) -> None:
        self.initial, self.maximum = initial, maximum
        self._failures = 0
        self._rng = rng or random.Random()

    def next(self) -> float:
        delay = min(self.maximum, self.initial * 2 ** self._failures)
        self._failures += 1
        return delay * self._rng.uniform(0.5, 1.0)

    def reset(self) -> None:
        self._failures = 0


def run(publisher: Publisher, health: HealthState, stop: threading.Event, poll: float,
        backoff: Backoff, drain: float) -> None:
    """Publish until ``stop``; then keep trying for ``drain`` seconds to empty the spool (the
    training container may have written its last alarm just before the pod was stopped, while the
    API server was down): the pod's termination grace period, less a margin, when the webhook
    passed ``--grace-period``. It returns as soon as the spool is empty."""
    while not stop.is_set():
        ok = _guarded_pass(publisher)
        health.tick()
        if ok:
            backoff.reset()
        stop.wait(poll if ok else backoff.next())
    deadline = time.monotonic() + drain
    if publisher.backlog():
        log.warning("sdcguard sidecar: stopping; %d record(s) still to publish, trying for up to %.0fs",
                    publisher.backlog(), drain)
    while True:
        ok = _guarded_pass(publisher)
        left = publisher.backlog()
        if (ok and left == 0) or time.monotonic() >= deadline:
            if left:
                log.error("sdcguard sidecar: stopping with %d unpublished record(s) in the spool", left)
            elif drain:
                log.info("sdcguard sidecar: spool empty; stopping")
            return
        time.sleep(min(1.0, max(0.0, deadline - time.monotonic())))


def _guarded_pass(publisher: Publisher) -> bool:
    """One pass; an unexpected error is logged and retried later, never a crash loop."""
    try:
        return publisher.run_once()
    except Exception:  # noqa: BLE001 — the loop must outlive any one bad pass
        log.exception("sdcguard sidecar: unexpected error in a publishing pass; retrying")
        return False


def build_parser() -> argparse.ArgumentParser:
    env = os.environ
    p = argparse.ArgumentParser(prog="sdcguard sidecar", description=__doc__.split("\n")[0])
    p.add_argument("--spool", default=env.get(names.ENV_SPOOL) or names.SPOOL_PATH,
                   help=f"spool directory shared with the training container (default: ${names.ENV_SPOOL} "
                   "or %(default)s)")
    p.add_argument("--kubeconfig", default=env.get("KUBECONFIG") or None,
                   help="kubeconfig file (default: $KUBECONFIG, else the in-cluster service account)")
    p.add_argument("--key-file", default=env.get(names.ENV_ALARM_KEY_FILE) or names.ALARM_KEY_FILE,
                   help=f"the job's alarm-signing key, mounted from its Secret (default: ${names.ENV_ALARM_KEY_FILE} "
                   "or %(default)s); reread when it changes")
    p.add_argument("--allow-unsigned", action="store_true",
                   help="publish unsigned Events while there is no usable key (only for an operator that runs "
                   "with SDCGUARD_REQUIRE_SIGNED_ALARMS=false); by default records wait for the key")
    p.add_argument("--metrics-host", default="0.0.0.0")
    p.add_argument("--metrics-port", type=int, default=names.SIDECAR_METRICS_PORT, help="0 picks a free port")
    p.add_argument("--poll-interval", type=float, default=1.0, help="seconds between spool scans")
    p.add_argument("--backoff-initial", type=float, default=0.5)
    p.add_argument("--backoff-max", type=float, default=30.0)
    p.add_argument("--settle", type=float, default=2.0,
                   help="seconds a file that does not parse may keep changing before it is quarantined")
    p.add_argument("--drain", type=float, default=20.0,
                   help="on SIGTERM, seconds to keep trying to publish what is left (see --grace-period)")
    p.add_argument("--grace-period", type=float, default=None,
                   help="the pod's terminationGracePeriodSeconds (the webhook passes it): on SIGTERM keep "
                   f"publishing until the spool is empty or this less {GRACE_MARGIN:g}s has passed; wins over --drain")
    p.add_argument("--log-level", default=env.get("SDCGUARD_LOG_LEVEL", "INFO"))
    p.add_argument("--log-format", choices=("json", "plain"), default=env.get("SDCGUARD_LOG_FORMAT", "json"),
                   help="json: one object per line (time, level, logger, message) for log pipelines")
    return p


class JsonFormatter(logging.Formatter):
    """One JSON object per line: what cluster log pipelines parse without configuration."""

    def format(self, record: logging.LogRecord) -> str:
        entry = {"time": self.formatTime(record, "%Y-%m-%dT%H:%M:%S") + f".{int(record.msecs):03d}Z",
                 "level": record.levelname, "logger": record.name, "message": record.getMessage()}
        if record.exc_info:
            entry["exception"] = self.formatException(record.exc_info)
        return json.dumps(entry)


def main(argv: list[str]) -> int:
    args = build_parser().parse_args(argv)
    handler = logging.StreamHandler(sys.stderr)
    if args.log_format == "json":
        formatter: logging.Formatter = JsonFormatter()
        formatter.converter = time.gmtime
    else:
        formatter = logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s")
    handler.setFormatter(formatter)
    logging.basicConfig(level=args.log_level.upper(), handlers=[handler])
    spool_dir = Path(args.spool)
    spool_dir.mkdir(parents=True, exist_ok=True)
    stop = threading.Event()  # before /healthz answers: a SIGTERM from then on is a drain, never a plain kill
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    registry = CollectorRegistry()
    metrics = PublisherMetrics(registry)
    registry.register(RankStatsCollector(spool_dir))
    health = HealthState(stale_after=args.backoff_max + args.poll_interval + 60.0)
    server = serve(registry, health, args.metrics_host, args.metrics_port)
    sink = KubeEventSink(args.kubeconfig)
    publisher = Publisher(spool_dir, sink, Identity.from_env(os.environ), metrics, AlarmKey(args.key_file),
                          allow_unsigned=args.allow_unsigned, settle=args.settle)
    log.info("sdcguard sidecar: watching %s, metrics on %s:%d", spool_dir, args.metrics_host, server.server_port)
    drain = max(1.0, args.grace_period - GRACE_MARGIN) if args.grace_period is not None else args.drain
    run(publisher, health, stop, args.poll_interval, Backoff(args.backoff_initial, args.backoff_max), drain)
    server.shutdown()
    return 0
