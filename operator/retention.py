"""How long an SDCIncident is kept (docs/operator.md, Evidence report).

Incidents carry no ownerReference to their job: they are the evidence of what happened to it and
must outlive it (the job is often deleted and created again to resume). Instead each incident
with nothing in flight is deleted by the operator once it is older than
``SDCGUARD_INCIDENT_RETENTION`` (default 90 days; 0 keeps them forever). The hardware record
behind repeat offenders (:mod:`.offenders`) is kept apart and is not shortened by this.

An incident's status is not sealed (anyone with ``sdcincidents/status`` may write its phase and
timeline), so it only selects candidates. What decides is what the operator alone writes: no
storm-guard slot may name the incident (deleting it would orphan a cordoned node, its slot and its
node condition; ``Contained`` also covers a node cordoned but not localized), no sealed
NodeReplacement serving it may still be open, and its age counts from its creation (set by the API
server) or the newest entry of a sealed NodeReplacement's timeline, whichever is later.
"""
from __future__ import annotations

import time
from typing import Any, Iterable, Mapping

from sdcguard.contract import names
from sdcguard.contract.phases import IncidentPhase

from . import contain, history, kube, metrics, replacement
from .approval import TERMINAL
from .settings import Settings

SETTLED = (IncidentPhase.CONTAINED, IncidentPhase.RESOLVED)


def check_interval(settings: Settings) -> float:
    """How often each incident's age is looked at: a tenth of the retention, at most hourly."""
    return max(1.0, min(3600.0, settings.incident_retention_seconds / 10))


def settled(status: Mapping[str, Any]) -> bool:
    """A candidate (the kopf filter; unsealed): Contained, Resolved, or not the operator's
    (condition Verified=False). :func:`expired` decides."""
    refused = any(c.get("type") == "Verified" and c.get("status") == "False" for c in status.get("conditions") or [])
    return refused or status.get("phase") in SETTLED


def last_change(body: Mapping[str, Any], replacements: Iterable[Mapping[str, Any]] = ()) -> float | None:
    """The incident's last change the operator can vouch for (epoch seconds): its creation, or the
    newest timeline entry of a sealed NodeReplacement serving it. Its own timeline is left out: a
    status write could date it back."""
    stamps = [history.seconds((body.get("metadata") or {}).get("creationTimestamp"))]
    for served in replacements:
        stamps += [history.seconds(e.get("time")) for e in (served.get("status") or {}).get("timeline") or []]
    known = [s for s in stamps if s is not None]
    return max(known) if known else None


def expired(body: Mapping[str, Any], retention: float, now: float, *, holds_slot: bool = False,
            replacements: Iterable[Mapping[str, Any]] = ()) -> bool:
    """Whether the incident is past its retention (pure): a candidate (:func:`settled`) holding no
    storm-guard slot, whose sealed ``replacements`` are all done, unchanged for longer than ``retention``."""
    replacements = list(replacements)
    if retention <= 0 or holds_slot or not settled(body.get("status") or {}):
        return False
    if any((r.get("status") or {}).get("phase") not in TERMINAL for r in replacements):
        return False
    changed = last_change(body, replacements)
    return changed is not None and now - changed > retention


def _serving(ref: str, settings: Settings) -> list[dict[str, Any]]:
    """The sealed NodeReplacements that name the incident (a status the operator did not seal says nothing)."""
    listed = kube.custom().list_cluster_custom_object(names.GROUP, names.VERSION, names.REPLACEMENTS)["items"]
    naming = [r for r in listed if ref in ((r.get("spec") or {}).get("incidents") or [])]
    if naming:
        replacement.install_seal(settings)
    return [r for r in naming if replacement.status_sealed(r)]


def collect(body: Mapping[str, Any], settings: Settings, now: float | None = None) -> bool:
    """Delete the incident if it is past its retention; True if deleted (or already gone)."""
    meta = body["metadata"]
    ref = f"{meta['namespace']}/{meta['name']}"
    fresh = kube.get_incident(meta["namespace"], meta["name"])
    if not settled(fresh.get("status") or {}):
        return False
    holds_slot = any(value.partition(" job=")[0] == ref for value in contain.slots(settings).values())
    if not expired(fresh, settings.incident_retention_seconds, time.time() if now is None else now,
                   holds_slot=holds_slot, replacements=_serving(ref, settings)):
        return False
    try:
        kube.custom().delete_namespaced_custom_object(names.GROUP, names.VERSION, meta["namespace"], names.INCIDENTS,
                                                      meta["name"])
    except Exception as exc:
        if not kube.not_found(exc):
            raise
    metrics.forget_incident(ref)
    return True
