"""Repeat offenders (layer 7): which instances and GPUs had alarms, and which did so more than once.

Pure functions over plain data, shared by the operator (which keeps the record, :mod:`.offenders`)
and the kubectl plugin (which ranks it): standard library only.

The record maps a piece of hardware to the incidents that named it. Keys are ``instance.<EC2
instance id>``, ``gpu.<instance id or node name>.<GPU UUID>`` (a UUID is the tenant's word, so it
counts only on the machine it was reported from: an alarm cannot reach another machine's GPU by
naming its UUID) and, for a suspect node whose instance id is unknown (not an AWS node),
``node.<node name>``. Each entry is one incident: ``{incident: "<ns>/<name>", jobUid, job:
"<ns>/<name>", check, step, time (the alarm's), node}``. A key whose entries hold more than one
incident of at least :data:`MIN_JOBS` distinct jobs within the window (ending now) is a repeat
offender: one job's own repeated alarms never are. Drills (synthetic faults) are never recorded.
"""
from __future__ import annotations

import datetime
import json
import re
from typing import Any, Iterable, Mapping

KINDS = ("instance", "gpu", "node")
WINDOW_ANNOTATION = "sdcguard.dev/repeat-offender-window-seconds"
"""On the history ConfigMap: the operator's window, so that ``kubectl sdcguard history`` judges alike."""
MAX_BYTES = 768 * 1024
"""The record is cut to this size, oldest entries first (the API server refuses a ConfigMap over 1 MiB)."""
_UNSAFE = re.compile(r"[^-._a-zA-Z0-9]+")
_DURATION = re.compile(r"^\s*([0-9]+(?:\.[0-9]+)?)\s*([smhd]?)\s*$")
_UNITS = {"": 1, "s": 1, "m": 60, "h": 3600, "d": 86400}
MIN_JOBS = 2
"""Distinct jobs (by uid) a piece of hardware's incidents must come from to make it a repeat offender."""


def parse_duration(text: str) -> float:
    """``30d``, ``12h``, ``90m``, ``45s`` or plain seconds -> seconds; ValueError otherwise."""
    match = _DURATION.match(str(text))
    if not match:
        raise ValueError(f"{text!r} is not a duration (e.g. 30d, 12h, 90m, 45s)")
    return float(match.group(1)) * _UNITS[match.group(2)]


def show_duration(seconds: float) -> str:
    for unit, size in (("d", 86400), ("h", 3600), ("m", 60)):
        if seconds >= size and seconds % size == 0:
            return f"{int(seconds // size)}{unit}"
    return f"{seconds:g}s"


def seconds(stamp: Any) -> float | None:
    """Epoch seconds of an RFC 3339 time, or None."""
    try:
        return datetime.datetime.fromisoformat(str(stamp).replace("Z", "+00:00")).timestamp()
    except ValueError:
        return None


def key(kind: str, ident: str) -> str:
    """The record's key for one piece of hardware (a valid ConfigMap key)."""
    return f"{kind}.{_UNSAFE.sub('_', ident)}"[:253]


def gpu_key(machine: str, uuid: str) -> str:
    """A GPU's key: its UUID under the machine (instance id, else node name) it was reported on."""
    return key("gpu", f"{machine}.{uuid}")


def split(record_key: str) -> tuple[str, str]:
    kind, _, ident = record_key.partition(".")
    return kind, ident


def shown(record_key: str) -> tuple[str, str]:
    """(kind, id) as people read them: a GPU by its UUID alone (its node is shown beside it)."""
    kind, ident = split(record_key)
    return (kind, ident.rpartition(".")[2]) if kind == "gpu" else (kind, ident)


def gpu_uuid(suspect: Mapping[str, Any]) -> str | None:
    """The GPU UUID of an alarm's suspect (``suspects[].gpu.uuid``; None on CPU or from an older library)."""
    gpu = suspect.get("gpu")
    uuid = gpu.get("uuid") if isinstance(gpu, Mapping) else suspect.get("gpu_uuid")
    return uuid if isinstance(uuid, str) and uuid else None


def gpu_index(suspect: Mapping[str, Any]) -> int | None:
    gpu = suspect.get("gpu")
    index = gpu.get("index") if isinstance(gpu, Mapping) else None
    return index if isinstance(index, int) and not isinstance(index, bool) else None


def suspects(spec: Mapping[str, Any]) -> list[dict[str, Any]]:
    """The alarm's suspects as signed (``spec.alarm``: with their GPUs), else ``spec.suspects``."""
    alarm = spec.get("alarm") if isinstance(spec.get("alarm"), Mapping) else {}
    found = alarm.get("suspects") if isinstance(alarm.get("suspects"), list) else spec.get("suspects")
    return [dict(s) for s in found or [] if isinstance(s, Mapping)]


def instance_of(node: str, status: Mapping[str, Any]) -> str | None:
    """The node's EC2 instance id as the incident's status recorded it (inventory, else
    localization). Unsealed: for the plugin's view of the incidents alone, never the operator's record."""
    inventory = ((status.get("inventory") or {}).get("nodes") or {}).get(node) or {}
    return inventory.get("instanceId") or ((status.get("nodes") or {}).get(node) or {}).get("instanceId") or None


def claimed(spec: Mapping[str, Any], status: Mapping[str, Any]) -> dict[str, str | None]:
    """Every node the suspects name -> its instance id as the incident's status says (the plugin's
    fallback view; the operator records only the nodes it cordoned, :func:`.offenders.held`)."""
    return {s["node"]: instance_of(s["node"], status) for s in suspects(spec) if s.get("node")}


def hardware(spec: Mapping[str, Any], machines: Mapping[str, str | None]) -> list[tuple[str, str]]:
    """(record key, node) for every piece of hardware the incident's suspects name on the nodes of
    ``machines`` (node -> its instance id, None when it has none), each once; other nodes are left out."""
    found: dict[str, str] = {}
    for suspect in suspects(spec):
        node = suspect.get("node")
        if not node or node not in machines:
            continue
        instance = machines[node]
        found.setdefault(key("instance", instance) if instance else key("node", node), node)
        uuid = gpu_uuid(suspect)
        if uuid:
            found.setdefault(gpu_key(instance or node, uuid), node)
    return list(found.items())


def entry(ref: str, spec: Mapping[str, Any], node: str) -> dict[str, Any]:
    """One incident, as the record keeps it under each piece of hardware it names."""
    job = spec.get("job") or {}
    alarm = spec.get("alarm") if isinstance(spec.get("alarm"), Mapping) else {}
    return {"incident": ref, "jobUid": spec.get("jobUid") or job.get("uid") or "",
            "job": f"{job.get('namespace', '')}/{job.get('name', '')}", "check": spec.get("check"),
            "step": spec.get("step"), "time": alarm.get("time") or "", "node": node}


def of_incidents(items: Iterable[Mapping[str, Any]]) -> dict[str, list[dict[str, Any]]]:
    """The record as the incidents themselves hold it (what ``kubectl sdcguard history`` shows when
    it may not read the operator's ConfigMap); drills left out."""
    record: dict[str, list[dict[str, Any]]] = {}
    for item in items:
        spec, status, meta = item.get("spec") or {}, item.get("status") or {}, item.get("metadata") or {}
        if spec.get("drill"):
            continue
        ref = f"{meta.get('namespace')}/{meta.get('name')}"
        for record_key, node in hardware(spec, claimed(spec, status)):
            add(record, record_key, entry(ref, spec, node))
    return record


def add(record: dict[str, list[dict[str, Any]]], record_key: str, new: Mapping[str, Any]) -> bool:
    """Add an incident under a key once (a retry adds nothing); True if added."""
    entries = record.setdefault(record_key, [])
    if any(e.get("incident") == new["incident"] for e in entries):
        return False
    entries.append(dict(new))
    return True


def parse(data: Mapping[str, str] | None) -> dict[str, list[dict[str, Any]]]:
    """The ConfigMap's data as the record (an unreadable value is dropped, never trusted)."""
    record: dict[str, list[dict[str, Any]]] = {}
    for record_key, text in (data or {}).items():
        kind, ident = split(record_key)
        if kind not in KINDS or (kind == "gpu" and "." not in ident):
            continue  # an older operator's cluster-wide GPU key: any tenant could add to it, dropped
        try:
            entries = json.loads(text)
        except (TypeError, ValueError):
            continue
        if isinstance(entries, list):
            record[record_key] = [e for e in entries if isinstance(e, dict) and isinstance(e.get("incident"), str)]
    return record


def dump(record: Mapping[str, list[dict[str, Any]]]) -> dict[str, str]:
    return {k: json.dumps(v, sort_keys=True, separators=(",", ":")) for k, v in record.items() if v}


def prune(record: dict[str, list[dict[str, Any]]], horizon: float) -> dict[str, list[dict[str, Any]]]:
    """Entries whose alarm is older than ``horizon`` (epoch seconds) dropped, then the oldest until
    the record fits :data:`MAX_BYTES`."""
    kept = {k: [e for e in v if (seconds(e.get("time")) or 0.0) >= horizon] for k, v in record.items()}
    kept = {k: v for k, v in kept.items() if v}
    while kept and sum(len(k) + len(v) for k, v in dump(kept).items()) > MAX_BYTES:
        oldest = min(kept, key=lambda k: min(seconds(e.get("time")) or 0.0 for e in kept[k]))
        kept[oldest] = sorted(kept[oldest], key=lambda e: seconds(e.get("time")) or 0.0)[1:]
        kept = {k: v for k, v in kept.items() if v}
    return kept


def within(entries: Iterable[Mapping[str, Any]], window: float, now: float) -> list[Mapping[str, Any]]:
    return [e for e in entries if (seconds(e.get("time")) or 0.0) >= now - window]


def jobs(entries: Iterable[Mapping[str, Any]]) -> int:
    """Distinct jobs behind entries (by uid; by name for an entry without one)."""
    return len({e.get("jobUid") or e.get("job") for e in entries})


def repeated(entries: list[Mapping[str, Any]]) -> bool:
    """More than one incident, of at least :data:`MIN_JOBS` distinct jobs."""
    return len({e["incident"] for e in entries}) > 1 and jobs(entries) >= MIN_JOBS


def offenders(record: Mapping[str, list[dict[str, Any]]], keys: Iterable[tuple[str, str]], window: float,
              now: float) -> list[dict[str, Any]]:
    """Of the hardware ``keys`` ((record key, node)), the repeat offenders within the window ending
    ``now`` (:func:`repeated`): ``{kind, id, node, incidents: [refs, oldest first], jobs: N}``."""
    found = []
    for record_key, node in keys:
        recent = sorted(within(record.get(record_key) or [], window, now), key=lambda e: seconds(e.get("time")) or 0.0)
        if repeated(recent):
            kind, ident = shown(record_key)
            found.append({"kind": kind, "id": ident, "node": node,
                          "incidents": list(dict.fromkeys(e["incident"] for e in recent)), "jobs": jobs(recent)})
    return found


def ranking(record: Mapping[str, list[dict[str, Any]]], window: float, now: float) -> list[dict[str, Any]]:
    """Every piece of hardware in the record, repeat offenders first, then most incidents within the
    window (then the most recent): ``{kind, id, node, recent, total, jobs, repeat, last, incidents}``."""
    rows = []
    for record_key, entries in record.items():
        if not entries:
            continue
        kind, ident = shown(record_key)
        ordered = sorted(entries, key=lambda e: seconds(e.get("time")) or 0.0)
        recent = within(ordered, window, now)
        refs = list(dict.fromkeys(e["incident"] for e in ordered))
        rows.append({"kind": kind, "id": ident, "node": ordered[-1].get("node") or "",
                     "recent": len({e["incident"] for e in recent}), "total": len(refs), "jobs": jobs(ordered),
                     "repeat": repeated(recent), "last": ordered[-1].get("time") or "", "incidents": refs})
    return sorted(rows, key=lambda r: (not r["repeat"], -r["recent"], -r["total"], -(seconds(r["last"]) or 0.0),
                                        KINDS.index(r["kind"]) if r["kind"] in KINDS else len(KINDS), r["id"]))
