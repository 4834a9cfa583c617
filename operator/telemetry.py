"""Layer 5: the suspect GPUs' DCGM telemetry around an alarm, as evidence on the incident.

After containment has acted (a suspect node cordoned, or held back), a kopf timer of its own
(:func:`due`, :func:`reconcile`; registered in :mod:`.main`) asks Prometheus — the HyperPod
observability add-on's Amazon Managed Prometheus workspace, :mod:`.prometheus` — for the DCGM
series of each suspect node over the window around the alarm, picks the suspect GPU's (by
``UUID``, else by index), and judges each series (:func:`judge_series`, pure): what was seen, and
whether it corroborates a hardware fault. The summary goes to ``status.telemetry``.

It never delays containment: its own handler, after the cordon, run in threads of its own
(:data:`THREADS`, :func:`run`), never in the executor that intake and containment use. It is
bounded: at most :data:`MAX_TARGETS` suspects, a time limit per request and per lookup
(:data:`DEADLINE_REQUESTS`), ``SDCGUARD_TELEMETRY_ATTEMPTS`` failed attempts (an answer it cannot
read is one), then "unavailable" for good. It looks only at incidents the operator created (their
seal, :func:`.incident.verify`, checked at every lookup: status is not sealed, so ``due`` alone
proves nothing), and only ever adds evidence: clean telemetry clears nothing — silent data
corruption often leaves no trace in any counter, so the alarm stands whatever DCGM says.

The window: the alarm carries its suspect window as steps, and (from this release's library on)
the wall seconds of a checked step, ``step_seconds``; the window's first step is then put at the
alarm's ``time`` minus (steps since it) x ``step_seconds``. The query runs from there minus
``SDCGUARD_TELEMETRY_MARGIN_SECONDS`` to the alarm plus that margin (scrape and remote-write
delay). A record without ``step_seconds`` (an older library) is looked at from its ``time`` minus
``SDCGUARD_TELEMETRY_LOOKBACK_SECONDS``. A lookup made before the end is recorded as ``final:
false`` and made again once the window has closed.
"""
from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import datetime
import math
import threading
import time
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from sdcguard.contract import names
from sdcguard.contract.alarm import rfc3339_seconds
from sdcguard.contract.phases import IncidentPhase
from sdcguard.contract.text import (TELEMETRY_CLEAN, TELEMETRY_CORROBORATES, TELEMETRY_NO_DATA,
                                    TELEMETRY_UNAVAILABLE, telemetry_line)

from . import incident, kube, metrics, prometheus
from .settings import Settings

SDC_XIDS = {
    48: "double-bit ECC error", 63: "ECC page retirement / row remap", 64: "row remap failure",
    74: "NVLink error", 79: "GPU fallen off the bus", 92: "high single-bit ECC rate",
    94: "contained ECC error", 95: "uncontained ECC error",
}
"""XIDs that point at the GPU's memory, links or bus (NVIDIA's XID catalogue); others (13, 31, 43 ...)
are mostly the application's own faults: noted, not corroborating."""
HOT_CELSIUS = 85.0
"""GPU temperature noted as hot (H100/H200 slow down from about 87 °C)."""
HW_SLOWDOWN_BITS = {0x8: "HW slowdown", 0x40: "HW thermal slowdown", 0x80: "HW power brake"}
"""Clock-event reasons (DCGM_FI_DEV_CLOCKS_EVENT_REASONS bits) set by the hardware, not by policy."""
MAX_SERIES = 64
"""Series entries kept per target in the status (the rest are counted)."""
MAX_POINTS = 600
"""Points per series asked for (Prometheus allows 11000): the step grows with the window."""
MAX_WINDOW_SECONDS = 86400.0
"""The longest suspect window looked at (a window of many slow steps is cut to the last day)."""
MAX_TARGETS = 8
"""Suspects (node, GPU) looked up per incident, in the alarm's order; the rest are counted in the
message. Suspects on one node share one query, so at most this many queries per lookup."""
DEADLINE_REQUESTS = 3
"""One lookup (every query of an incident) ends within this many SDCGUARD_TELEMETRY_TIMEOUT_SECONDS:
each request gets what is left, and a lookup past it is a failed attempt."""
THREADS = 2
"""Threads that run lookups, apart from the handlers' executor: a slow Prometheus holds at most
these, never a thread that intake or containment needs; due incidents wait their turn."""


@dataclasses.dataclass(frozen=True, slots=True)
class Field:
    """A DCGM field as dcgm-exporter names it, and how a window of it is judged."""

    metric: str
    short: str
    """What a finding calls it (``DBE +2``)."""
    kind: str
    """``xid``: last XID value; ``fault``: a counter whose increase corroborates; ``count``: a
    counter whose increase is noted; ``violation``: throttled microseconds (noted); ``flag``: a gauge
    whose non-zero value corroborates; ``clocks``: clock-event reason bits; ``temperature``."""


FIELDS = (
    Field("DCGM_FI_DEV_XID_ERRORS", "XID", "xid"),
    Field("DCGM_FI_DEV_ECC_DBE_VOL_TOTAL", "DBE", "fault"),
    Field("DCGM_FI_DEV_ECC_SBE_VOL_TOTAL", "SBE", "count"),
    Field("DCGM_FI_DEV_UNCORRECTABLE_REMAPPED_ROWS", "uncorrectable remapped rows", "fault"),
    Field("DCGM_FI_DEV_CORRECTABLE_REMAPPED_ROWS", "correctable remapped rows", "count"),
    Field("DCGM_FI_DEV_ROW_REMAP_FAILURE", "row remap failure", "flag"),
    Field("DCGM_FI_DEV_NVLINK_CRC_FLIT_ERROR_COUNT_TOTAL", "NVLink CRC flit", "fault"),
    Field("DCGM_FI_DEV_NVLINK_CRC_DATA_ERROR_COUNT_TOTAL", "NVLink CRC data", "fault"),
    Field("DCGM_FI_DEV_NVLINK_REPLAY_ERROR_COUNT_TOTAL", "NVLink replay", "fault"),
    Field("DCGM_FI_DEV_NVLINK_RECOVERY_ERROR_COUNT_TOTAL", "NVLink recovery", "fault"),
    Field("DCGM_FI_DEV_PCIE_REPLAY_COUNTER", "PCIe replay", "count"),
    Field("DCGM_FI_DEV_POWER_VIOLATION", "power violation", "violation"),
    Field("DCGM_FI_DEV_THERMAL_VIOLATION", "thermal violation", "violation"),
    Field("DCGM_FI_DEV_CLOCK_THROTTLE_REASONS", "clock throttle", "clocks"),
    Field("DCGM_FI_DEV_CLOCKS_EVENT_REASONS", "clock events", "clocks"),
    Field("DCGM_FI_DEV_GPU_TEMP", "temperature", "temperature"),
)
BY_METRIC = {f.metric: f for f in FIELDS}
METRIC_PREFIX = "DCGM_FI_DEV_"


# --- what to ask -------------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True, slots=True)
class Target:
    """A suspect: its node, and its GPU where the alarm names it (index local to the pod, UUID on CUDA)."""

    node: str
    gpu: int | None = None
    uuid: str | None = None


def targets(spec: Mapping[str, Any]) -> list[Target]:
    """The suspects to look up, from the signed alarm the incident holds (``spec.alarm``), else
    ``spec.suspects``; one per (node, GPU), ranks without a node left out."""
    alarm = spec.get("alarm") if isinstance(spec.get("alarm"), Mapping) else {}
    found: dict[Target, None] = {}
    for suspect in alarm.get("suspects") or spec.get("suspects") or []:
        if not isinstance(suspect, Mapping) or not suspect.get("node"):
            continue
        gpu = suspect.get("gpu") if isinstance(suspect.get("gpu"), Mapping) else {}
        index = gpu.get("index") if isinstance(gpu.get("index"), int) and not isinstance(gpu.get("index"), bool) \
            else None
        uuid = gpu.get("uuid") if isinstance(gpu.get("uuid"), str) and gpu.get("uuid") else None
        found[Target(str(suspect["node"]), index, uuid)] = None
    return list(found)


@dataclasses.dataclass(frozen=True, slots=True)
class Window:
    start: float
    end: float
    basis: str


def window(spec: Mapping[str, Any], settings: Settings) -> Window:
    """The time range to look at, around the alarm's ``time`` (see the module's docstring)."""
    alarm = spec.get("alarm") if isinstance(spec.get("alarm"), Mapping) else {}
    at, margin = rfc3339_seconds(alarm["time"]), settings.telemetry_margin_seconds
    seconds, step = alarm.get("step_seconds"), alarm.get("step")
    first = (alarm.get("suspect_window") or {}).get("first_step")
    if all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in (seconds, step, first)) and seconds > 0:
        back = min(MAX_WINDOW_SECONDS, (step - first + 1) * seconds)
        return Window(at - back - margin, at + margin,
                      f"the suspect window's first step ({first}) about {back:.0f} s before the alarm "
                      f"(steps x the alarm's step_seconds) - {margin:g} s, to the alarm + {margin:g} s")
    return Window(at - settings.telemetry_lookback_seconds, at + margin,
                  f"alarm time - {settings.telemetry_lookback_seconds:g} s to alarm time + {margin:g} s (the alarm "
                  "carries the suspect window's steps but no step time)")


def selector(node: str, node_labels: Sequence[str]) -> str:
    """PromQL for every DCGM field of :data:`FIELDS` on ``node``, whichever label carries its name."""
    metrics_re = METRIC_PREFIX + "(" + "|".join(f.metric.removeprefix(METRIC_PREFIX) for f in FIELDS) + ")"
    value = node.replace("\\", "\\\\").replace('"', '\\"')
    return " or ".join(f'{{__name__=~"{metrics_re}", {label}="{value}"}}' for label in node_labels)


def step_seconds(start: float, end: float) -> float:
    return float(max(1, math.ceil((end - start) / MAX_POINTS)))


# --- how to judge it (pure) ----------------------------------------------------------------------

@dataclasses.dataclass(frozen=True, slots=True)
class Judged:
    """One series over the window: what was seen, whether it corroborates a hardware fault or is
    worth noting, and the short finding (``XID 79``, ``DBE +2``) when it does either."""

    metric: str
    gpu: str | None
    uuid: str | None
    seen: str
    corroborates: bool = False
    noted: bool = False
    finding: str | None = None

    def as_status(self) -> dict[str, Any]:
        """Clipped to the CRD's limits: labels and values come from Prometheus, not from us."""
        return {"metric": self.metric[:128], "gpu": None if self.gpu is None else str(self.gpu)[:16],
                "uuid": None if self.uuid is None else str(self.uuid)[:64], "seen": self.seen[:256],
                "corroborates": self.corroborates, "noted": self.noted}


def increase(values: Sequence[float]) -> float:
    """How much a counter grew over the samples; a drop is a reset (the exporter or driver
    restarted), after which the counter's new value is growth, as Prometheus' ``increase`` counts it."""
    total = 0.0
    for before, after in zip(values, values[1:]):
        total += after - before if after >= before else after
    return total


def judge_series(metric: str, values: Sequence[float], gpu: str | None = None, uuid: str | None = None) -> Judged:
    """Judge one DCGM series over the window (samples in time order, NaN already dropped)."""
    field = BY_METRIC.get(metric)
    if field is None or not values:
        return Judged(metric, gpu, uuid, "no samples" if not values else "not judged")
    if field.kind == "xid":
        xids = list(dict.fromkeys(int(v) for v in values if v))
        relevant = [x for x in xids if x in SDC_XIDS]
        seen = "no XID" if not xids else "XID " + ", ".join(
            f"{x} ({SDC_XIDS[x]})" if x in SDC_XIDS else str(x) for x in xids)
        if relevant:
            return Judged(metric, gpu, uuid, seen, corroborates=True, finding="XID " + ", ".join(map(str, relevant)))
        if xids:
            return Judged(metric, gpu, uuid, seen, noted=True, finding="XID " + ", ".join(map(str, xids)))
        return Judged(metric, gpu, uuid, seen)
    if field.kind in ("fault", "count"):
        grown = increase(values)
        seen = f"+{grown:g} (now {values[-1]:g})"
        if grown > 0:
            return Judged(metric, gpu, uuid, seen, corroborates=field.kind == "fault", noted=field.kind == "count",
                          finding=f"{field.short} +{grown:g}")
        return Judged(metric, gpu, uuid, seen)
    if field.kind == "violation":
        seconds = increase(values) / 1e6
        seen = f"throttled {seconds:.3g} s"
        if seconds > 0:
            return Judged(metric, gpu, uuid, seen, noted=True, finding=f"{field.short} {seconds:.3g} s")
        return Judged(metric, gpu, uuid, seen)
    if field.kind == "flag":
        if max(values) > 0:
            return Judged(metric, gpu, uuid, f"set ({max(values):g})", corroborates=True, finding=field.short)
        return Judged(metric, gpu, uuid, "not set")
    if field.kind == "clocks":
        bits = 0
        for value in values:
            bits |= int(value)
        hardware = [name for bit, name in HW_SLOWDOWN_BITS.items() if bits & bit]
        seen = f"reasons 0x{bits:x}" + (f" ({', '.join(hardware)})" if hardware else "")
        if hardware:
            return Judged(metric, gpu, uuid, seen, noted=True, finding=", ".join(hardware))
        return Judged(metric, gpu, uuid, seen)
    hottest = max(values)
    seen = f"max {hottest:g} °C"
    if hottest >= HOT_CELSIUS:
        return Judged(metric, gpu, uuid, seen, noted=True, finding=f"{hottest:g} °C")
    return Judged(metric, gpu, uuid, seen)


def pick(matrix: Iterable[Mapping[str, Any]], target: Target) -> tuple[list[Mapping[str, Any]], str]:
    """The suspect GPU's series among the node's, and how they were matched: by ``UUID`` (exact);
    by ``gpu`` index only when no series carries a UUID label (the pod's index can differ from the
    node's when the pod sees a subset of the GPUs); every GPU when the alarm names none."""
    matrix = list(matrix)
    if target.uuid:
        chosen = [s for s in matrix if (s.get("metric") or {}).get("UUID") == target.uuid]
        if chosen or any("UUID" in (s.get("metric") or {}) for s in matrix):
            return chosen, f"UUID {target.uuid}"
    if target.gpu is not None:
        return [s for s in matrix if (s.get("metric") or {}).get("gpu") == str(target.gpu)], f"gpu {target.gpu}"
    return matrix, "every GPU of the node (the alarm names no GPU)"


def judge_target(target: Target, matrix: Iterable[Mapping[str, Any]]) -> dict[str, Any]:
    """A target's judgement from the node's query_range matrix: its verdict, findings, series."""
    chosen, matched = pick(matrix, target)
    judged = []
    for series in chosen:
        labels = series.get("metric") or {}
        values = [float(v) for _, v in series.get("values") or [] if not math.isnan(float(v))]
        judged.append(judge_series(str(labels.get("__name__")), values, labels.get("gpu"), labels.get("UUID")))
    judged.sort(key=lambda j: (not j.corroborates, not j.noted, j.gpu or "", j.metric))
    every_gpu = target.gpu is None and target.uuid is None
    label = (lambda j: f"{j.finding} (GPU {j.gpu})") if every_gpu else (lambda j: j.finding)
    findings = list(dict.fromkeys(label(j)[:200] for j in judged if j.corroborates))
    noted = list(dict.fromkeys(label(j)[:200] for j in judged if j.noted))
    kept = [j for j in judged if not every_gpu or j.corroborates or j.noted][:MAX_SERIES]
    verdict = TELEMETRY_NO_DATA if not judged else TELEMETRY_CORROBORATES if findings else TELEMETRY_CLEAN
    return {"node": target.node, "gpu": target.gpu, "uuid": target.uuid, "matched": matched, "verdict": verdict,
            "findings": findings, "noted": noted, "series": [j.as_status() for j in kept],
            "clean": len(judged) - len(kept)}


def summarize(judged: Sequence[dict[str, Any]], node_labels: Sequence[str]) -> dict[str, Any]:
    """The incident's telemetry from its targets' judgements: the verdict (Corroborates when any
    target's does), the findings, and a message that says what that means — never that a clean
    GPU is cleared."""
    several = len(judged) > 1
    findings = [f"{f} on {t['node']}" if several else f for t in judged for f in t["findings"]]
    noted = [f"{f} on {t['node']}" if several else f for t in judged for f in t["noted"]]
    no_data = [t["node"] for t in judged if t["verdict"] == TELEMETRY_NO_DATA]
    if findings:
        verdict = TELEMETRY_CORROBORATES
        message = (f"DCGM shows hardware errors on the suspect GPU in the window ({', '.join(findings)}): "
                   "the telemetry corroborates the alarm.")
    elif len(no_data) == len(judged):
        verdict = TELEMETRY_NO_DATA
        message = (f"Prometheus holds no DCGM series for {', '.join(no_data)} in the window (looked for labels "
                   f"{', '.join(node_labels)}): are the observability add-on's DCGM metrics on, and do they name "
                   "the node this way? Nothing is cleared.")
    else:
        verdict = TELEMETRY_CLEAN
        message = ("No DCGM error counter of the suspect GPU moved in the window. Clean telemetry never clears a "
                   "node: silent data corruption often leaves no trace in any counter, and the alarm stands.")
    if no_data and verdict != TELEMETRY_NO_DATA:
        message += f" No DCGM series for {', '.join(no_data)}."
    if noted:
        message += f" Noted (not evidence of corruption by themselves): {', '.join(noted)}."
    return {"verdict": verdict, "findings": findings[:32], "noted": noted[:32], "message": message[:4000],
            "targets": list(judged)}


def unavailable(reason: str) -> dict[str, Any]:
    return {"verdict": TELEMETRY_UNAVAILABLE, "reason": reason[:1000],
            "message": f"Telemetry unavailable: {reason[:900]}. Containment went ahead without it; nothing is cleared."}


# --- the lookup, and its place in the incident ---------------------------------------------------

def lookup(spec: Mapping[str, Any], settings: Settings, client: prometheus.Client, now: float,
           deadline: float | None = None) -> dict[str, Any]:
    """Ask Prometheus about the incident's first :data:`MAX_TARGETS` targets (one query per node),
    each request within what is left until ``deadline`` (``time.monotonic()``); the telemetry
    summary, ``final`` once the window has closed. Raises :class:`prometheus.Unavailable`, also for
    an answer whose series cannot be read (a value that is not a number ...)."""
    span = window(spec, settings)
    end = min(span.end, now)
    start = min(span.start, end - 1)
    every = targets(spec)
    matrices: dict[str, list[dict[str, Any]]] = {}
    judged = []
    for target in every[:MAX_TARGETS]:
        if target.node not in matrices:
            matrices[target.node] = client.until(deadline).query_range(
                selector(target.node, settings.telemetry_node_labels), start, end, step_seconds(start, end))
        try:
            judged.append(judge_target(target, matrices[target.node]))
        except (ArithmeticError, AttributeError, LookupError, TypeError, ValueError) as exc:
            raise prometheus.Unavailable(f"unreadable series for {target.node} from "
                                         f"{prometheus.where(client.url)}: {type(exc).__name__}: {exc}"[:500]) from None
    result = summarize(judged, settings.telemetry_node_labels)
    if len(every) > MAX_TARGETS:
        result["message"] = (result["message"] + f" {len(every) - MAX_TARGETS} more suspects not looked up (at "
                             f"most {MAX_TARGETS} per incident).")[:4000]
    return {**result, "final": now >= span.end,
            "window": {"start": _iso(span.start), "end": _iso(span.end), "basis": span.basis}}


def deadline_seconds(settings: Settings) -> float:
    """How long one lookup (every query of one incident) may take."""
    return DEADLINE_REQUESTS * settings.telemetry_timeout_seconds


def due(spec: Mapping[str, Any], status: Mapping[str, Any], **_: Any) -> bool:
    """The timer's filter: an incident not refused (no Verified=False), with suspect nodes, whose
    containment has acted (a node cordoned, refused or missing, the storm guard holding, or the
    phase past Containing), and whose telemetry is not final yet. All of it is unsealed status:
    :func:`reconcile` checks the seal before it asks anything."""
    conditions = status.get("conditions") or []
    if any(c.get("type") == "Verified" and c.get("status") == "False" for c in conditions):
        return False
    if (status.get("telemetry") or {}).get("final") or not targets(spec):
        return False
    acted = any((state or {}).get(key) for state in (status.get("nodes") or {}).values()
                for key in ("cordoned", "refused", "missing"))
    return acted or status.get("phase") not in (None, IncidentPhase.CONTAINING) \
        or kube.is_true(dict(status), "StormGuard")


_pool: concurrent.futures.ThreadPoolExecutor | None = None
_pool_lock = threading.Lock()


def pool() -> concurrent.futures.ThreadPoolExecutor:
    """The lookups' own :data:`THREADS` threads, built on first use."""
    global _pool
    with _pool_lock:
        if _pool is None:
            _pool = concurrent.futures.ThreadPoolExecutor(max_workers=THREADS, thread_name_prefix="sdcguard-telemetry")
        return _pool


async def run(body: Mapping[str, Any], settings: Settings) -> None:
    """The timer's work (:func:`reconcile`) in :func:`pool`: the (async) handler holds no thread of
    kopf's executor while it waits, so intake and containment never wait behind Prometheus."""
    await asyncio.get_running_loop().run_in_executor(pool(), reconcile, body, settings)


def reconcile(body: Mapping[str, Any], settings: Settings, now: float | None = None) -> None:
    """One lookup for the incident, recorded in ``status.telemetry``; the last allowed failure, or a
    lookup after the window closed, makes it final (the timer then stops). An incident without the
    operator's valid seal is left as it is (containment records why, Verified=False): its status
    could say anything, and its suspects are whoever its author named."""
    namespace, name = body["metadata"]["namespace"], body["metadata"]["name"]
    current = kube.get_incident(namespace, name)
    spec, status = current.get("spec") or {}, current.get("status") or {}
    if not due(spec, status):
        return
    try:
        record = incident.verify(current, settings)
    except incident.NotVerified:
        return
    spec = {**spec, "alarm": record}  # the signed alarm's own suspects, time and window
    previous = dict(status.get("telemetry") or {})
    attempts, failures = int(previous.get("attempts") or 0) + 1, int(previous.get("failures") or 0)
    try:
        deadline = time.monotonic() + deadline_seconds(settings)
        client = prometheus.Client.from_settings(settings)
        result = lookup(spec, settings, client, time.time() if now is None else now, deadline)
        result["source"] = prometheus.where(settings.prometheus_url or "")
    except prometheus.Unavailable as exc:
        failures += 1
        final = failures >= settings.telemetry_attempts
        if previous.get("verdict") not in (None, TELEMETRY_UNAVAILABLE):  # an earlier lookup answered: keep it
            result = {**previous, "final": final, "lastError": exc.reason[:1000]}
        else:
            result = {**unavailable(exc.reason), "final": final}
    result.update(attempts=attempts, failures=failures, queriedAt=kube.now())
    result["summary"] = telemetry_line(result)
    write(namespace, name, result)
    if result["final"]:
        metrics.TELEMETRY.labels(result["verdict"]).inc()
    if result["verdict"] != TELEMETRY_UNAVAILABLE:
        metrics.TELEMETRY_CORROBORATED.labels(f"{namespace}/{name}").set(
            1 if result["verdict"] == TELEMETRY_CORROBORATES else 0)


def write(namespace: str, name: str, telemetry: dict[str, Any]) -> None:
    """Replace ``status.telemetry`` (keys it no longer has are removed), unless it became final
    meanwhile; a final one also goes to the timeline."""
    def change(status: dict[str, Any]) -> dict[str, Any]:
        old = status.get("telemetry") or {}
        if old.get("final"):
            return {}
        patch: dict[str, Any] = {"telemetry": {**{k: None for k in old if k not in telemetry}, **telemetry}}
        if telemetry["final"]:
            patch["timeline"] = list(status.get("timeline") or []) + [{
                "time": kube.now(), "event": "Telemetry",
                "message": f"{telemetry['summary']}: {telemetry['message']}"[:4000]}]
        return patch
    kube.update_status(names.INCIDENTS, namespace, name, change)


def _iso(seconds: float) -> str:
    return datetime.datetime.fromtimestamp(seconds, datetime.timezone.utc).isoformat(timespec="seconds").replace(
        "+00:00", "Z")
