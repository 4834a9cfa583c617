"""The sidecar's Prometheus metrics and its small HTTP endpoint (``/metrics``, ``/healthz``).

Two kinds of metrics: the publisher's own (alarms published, errors, quarantined files, spool
backlog), kept in a private registry, and the training ranks' check statistics, read from
``<spool>/stats/rank-<r>.json`` at scrape time (the library writes them; docs/design.md §7). Reading at
scrape time means a restarted sidecar reports the ranks' totals at once, with no state of its own.
"""
from __future__ import annotations

import json
import logging
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any, Callable, Iterator

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from ..contract.stats import STATS_SCHEMA

log = logging.getLogger("sdcguard.sidecar")


class PublisherMetrics:
    """The publisher's counters, in a registry of their own (no process-wide default state)."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self.published = Counter(
            "sdcguard_sidecar_alarms_published", "Alarm records published as Events", ["check"],
            registry=registry)
        self.already_published = Counter(
            "sdcguard_sidecar_alarms_already_published",
            "Records whose Event already existed (HTTP 409: a retry after a crash)", registry=registry)
        self.name_taken = Counter(
            "sdcguard_sidecar_event_name_taken",
            "An alarm's Event name was taken by an Event that is not that alarm (other annotation or "
            "signature): the alarm was published under a fresh name; someone may be trying to suppress alarms",
            registry=registry)
        self.errors = Counter(
            "sdcguard_sidecar_publish_errors",
            "Failed attempts to create an Event, by reason (unreachable or the HTTP status)",
            ["reason"], registry=registry)
        self.quarantined = Counter(
            "sdcguard_sidecar_alarms_quarantined", "Corrupt spool files moved to quarantine/",
            registry=registry)
        self.backlog = Gauge(
            "sdcguard_sidecar_spool_backlog", "Alarm records in the spool waiting to be published",
            registry=registry)
        self.last_success = Gauge(
            "sdcguard_sidecar_last_publish_timestamp_seconds",
            "When an Event was last created (Unix time; 0 = never)", registry=registry)


class RankStatsCollector(Collector):
    """Exports every ``stats/rank-<r>.json`` in the spool, labelled by rank."""

    def __init__(self, spool: Path) -> None:
        self.stats_dir = spool / "stats"
        self._bad: set[str] = set()

    def read(self) -> list[dict[str, Any]]:
        """The parseable stats files (a bad one is logged once and skipped, never fatal)."""
        found = []
        for path in sorted(self.stats_dir.glob("rank-*.json")) if self.stats_dir.is_dir() else []:
            try:
                data = json.loads(path.read_text(encoding="utf-8"))
                if data.get("schema") != STATS_SCHEMA or not isinstance(data.get("rank"), int):
                    raise ValueError(f"not a {STATS_SCHEMA} record")
            except (OSError, ValueError, AttributeError) as exc:
                if path.name not in self._bad:
                    log.warning("sdcguard sidecar: skipping unreadable stats file %s: %s", path, exc)
                    self._bad.add(path.name)
                continue
            self._bad.discard(path.name)
            found.append(data)
        return found

    def collect(self) -> Iterator[Any]:
        runs = CounterMetricFamily("sdcguard_checks", "Check runs per rank", labels=["rank", "check"])
        seconds = CounterMetricFamily(
            "sdcguard_check_seconds", "Seconds spent in each check per rank", labels=["rank", "check"])
        steps = CounterMetricFamily("sdcguard_steps", "Training steps completed per rank", labels=["rank"])
        alarms = CounterMetricFamily("sdcguard_alarms", "Alarms raised, as seen by each rank", labels=["rank"])
        last_step = GaugeMetricFamily("sdcguard_last_step", "Last step a rank ran", labels=["rank"])
        verified = GaugeMetricFamily(
            "sdcguard_last_verified_step", "Last step whose checks all passed", labels=["rank"])
        # The cost of checking, as each rank measured it while training (the statistics' ``cost``).
        premium = GaugeMetricFamily(
            "sdcguard_check_premium_ratio",
            "What each kind of check (ordinary, audit, weights) adds to the run, as a fraction of a step "
            "without sdcguard, measured on each rank", labels=["rank", "kind"])
        premium_seconds = GaugeMetricFamily(
            "sdcguard_check_premium_seconds",
            "Seconds each kind of check has added to the run on each rank so far (one rank is one GPU: "
            "summed over ranks, GPU-seconds)", labels=["rank", "kind"])
        step_time = GaugeMetricFamily(
            "sdcguard_step_time_seconds", "A training step without sdcguard's checks (median, measured)",
            labels=["rank"])
        checked_step = GaugeMetricFamily(
            "sdcguard_checked_step_seconds", "A training step with sdcguard's checks (measured)", labels=["rank"])
        interval = GaugeMetricFamily(
            "sdcguard_audit_interval", "Steps between audits now (fixed, or chosen by the integrity budget; "
            "0: no audits)", labels=["rank"])
        for data in self.read():
            rank = str(data["rank"])
            for check, entry in sorted((data.get("checks") or {}).items()):
                runs.add_metric([rank, check], float(entry.get("runs", 0)))
                seconds.add_metric([rank, check], float(entry.get("seconds", 0.0)))
            steps.add_metric([rank], float(data.get("steps") or 0))
            alarms.add_metric([rank], float(data.get("alarms") or 0))
            if data.get("last_step") is not None:
                last_step.add_metric([rank], float(data["last_step"]))
            if data.get("last_verified_step") is not None:
                verified.add_metric([rank], float(data["last_verified_step"]))
            cost = data.get("cost")
            if isinstance(cost, dict):
                for kind, entry in sorted((cost.get("checks") or {}).items()):
                    premium.add_metric([rank, kind], float(entry.get("premium") or 0.0))
                    premium_seconds.add_metric([rank, kind], float(entry.get("seconds") or 0.0))
                step_time.add_metric([rank], float(cost.get("step_time_s") or 0.0))
                checked_step.add_metric([rank], float(cost.get("checked_step_s") or 0.0))
            schedule = data.get("audit_schedule")
            if isinstance(schedule, dict) and isinstance(schedule.get("interval"), int):
                interval.add_metric([rank], float(schedule["interval"]))
        yield from (runs, seconds, steps, alarms, last_step, verified, premium, premium_seconds, step_time,
                    checked_step, interval)


class HealthState:
    """Liveness of the publishing loop: healthy while it keeps ticking. An unreachable API server
    is *not* unhealthy — restarting the sidecar would not bring it back."""

    def __init__(self, stale_after: float, clock: Callable[[], float] = time.monotonic) -> None:
        self.stale_after = stale_after
        self._clock = clock
        self._last_tick = clock()

    def tick(self) -> None:
        self._last_tick = self._clock()

    def healthy(self) -> bool:
        return self._clock() - self._last_tick <= self.stale_after


def serve(registry: CollectorRegistry, health: HealthState, host: str, port: int) -> ThreadingHTTPServer:
    """Start ``/metrics`` and ``/healthz`` on a daemon thread; return the server (``.server_port``)."""

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802 (http.server's naming)
            path = self.path.split("?", 1)[0]
            if path == "/metrics":
                body, ctype, code = generate_latest(registry), CONTENT_TYPE_LATEST, 200
            elif path == "/healthz":
                ok = health.healthy()
                body, ctype, code = (b"ok\n" if ok else b"publisher loop stalled\n"), "text/plain", 200 if ok else 503
            else:
                body, ctype, code = b"not found\n", "text/plain", 404
            self.send_response(code)
            self.send_header("Content-Type", ctype)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, format: str, *args: Any) -> None:  # scrapes every 15 s: keep logs quiet
            log.debug("http: " + format, *args)

    server = ThreadingHTTPServer((host, port), Handler)
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, name="sdcguard-metrics", daemon=True).start()
    return server
