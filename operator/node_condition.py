"""The node condition ``SilentDataCorruptionSuspected``: what the rest of the cluster sees of a suspect node.

An SDCIncident is sdcguard's own record; other systems read nodes. medik8s NodeHealthCheck acts on
the ``unhealthyConditions`` it is given, EKS node monitoring and node-problem-detector consumers
read node conditions, dashboards list them. So when sdcguard cordons a node for an incident the
node's status gets this condition, ``True`` (reason: the check, CamelCase; message: the job, the
ranks and their GPUs, the step, the incident), and ``False`` when sdcguard gives the node back:
the replacement is done (``Replaced``), a person's denial (``Denied``), or a person's release of a
failed replacement's slot (``Released``). The message always ends with ``; incident <ref>``, so a
later pass can tell which incident a condition speaks for.

Written as kubelet and node-problem-detector write theirs: a strategic-merge patch of the node's
``status`` subresource carrying this one condition, merged into the list by ``type`` on the
server, so the other conditions (Ready, node-problem-detector's) stay as they are and nothing
races the kubelet's own writes. The admission policy lets the operator change this condition and
nothing else in a node's status (charts/sdcguard/templates/admission-policy.yaml).

Setting it is best effort: the cordon is what contains the fault, and it never waits on this
write. Whatever holds the node sets it again when it was lost (:func:`contain.reannounce`): a
restart's cordon pass, the open NodeReplacement's timer, and for a node with no replacement (not
localized) the incident's own timer. Clearing it is not: a
``True`` left on a node sdcguard gave back is a remediation trigger for NodeHealthCheck, so
:func:`clear` raises and the caller gives the storm-guard slot back only once it succeeded
(:func:`contain.release`).
"""
from __future__ import annotations

import logging
import re
from typing import Any

from sdcguard.contract import names
from sdcguard.contract.alarm import gpu_text

from . import kube

log = logging.getLogger("sdcguard_operator.node_condition")

MESSAGE_MAX = 1024
REPLACED, DENIED, RELEASED = "Replaced", "Denied", "Released"
TAIL = re.compile(r"; incident (\S+)$")


def reason(check: str) -> str:
    """A check's name as a condition reason (CamelCase, a letter first, as the API conventions want):
    ``nonfinite-local`` -> ``NonfiniteLocal``, ``replay`` -> ``Replay``."""
    text = "".join(w[:1].upper() + w[1:] for w in re.split(r"[^A-Za-z0-9]+", check) if w)
    return text if text[:1].isalpha() else f"Check{text}"


def suspects_on(spec: dict[str, Any], node: str) -> list[dict[str, Any]]:
    return [s for s in spec.get("suspects") or [] if s.get("node") == node]


def message(incident_ref: str, spec: dict[str, Any], node: str) -> str:
    """What the condition says: the check and step, the job, each rank on this node with its GPU,
    and the incident to read (``kubectl sdcguard report``)."""
    job = spec.get("job") or {}
    ranks = "; ".join(f"rank {s['rank']}" + (f" on {gpu_text(s.get('gpu'))}" if s.get("gpu") else "")
                      for s in suspects_on(spec, node)) or "no rank named on this node"
    head = (f"sdcguard {spec.get('check')} check at step {spec.get('step')}: job {job.get('namespace')}/"
            f"{job.get('name')}, {ranks}")
    return bounded(head, incident_ref)


def bounded(head: str, incident_ref: str | None) -> str:
    """``<head>; incident <ref>`` within MESSAGE_MAX: the head is cut, never the incident."""
    tail = f"; incident {incident_ref}" if incident_ref else ""
    return head[:max(0, MESSAGE_MAX - len(tail))] + tail


def incident_of(condition: dict[str, Any] | None) -> str | None:
    """The incident (``<namespace>/<name>``) a condition sdcguard wrote speaks for, if it names one."""
    found = TAIL.search((condition or {}).get("message") or "")
    return found.group(1) if found else None


def entry(status: bool, why: str, text: str, existing: dict[str, Any] | None, now: str) -> dict[str, str]:
    """The condition as written: ``lastTransitionTime`` moves only when the status flips,
    ``lastHeartbeatTime`` is this write's time (as kubelet and node-problem-detector keep them)."""
    value = "True" if status else "False"
    same = existing is not None and existing.get("status") == value and existing.get("lastTransitionTime")
    return {"type": names.NODE_CONDITION, "status": value, "reason": why, "message": text[:MESSAGE_MAX],
            "lastHeartbeatTime": now, "lastTransitionTime": existing["lastTransitionTime"] if same else now}


def current(node: Any) -> dict[str, Any] | None:
    """The node's ``SilentDataCorruptionSuspected`` condition (a V1Node from the client), if any."""
    for c in (node.status.conditions or []) if node.status is not None else []:
        if c.type == names.NODE_CONDITION:
            return {"status": c.status, "reason": c.reason, "message": c.message,
                    "lastTransitionTime": kube_time(c.last_transition_time)}
    return None


def kube_time(value: Any) -> str | None:
    """A timestamp the client parsed into a datetime, back as the API spells it."""
    if value is None or isinstance(value, str):
        return value
    return value.isoformat(timespec="seconds").replace("+00:00", "Z")


def _patch(node_name: str, status: bool, why: str, text: str, existing: dict[str, Any] | None) -> None:
    # A dict body is sent as a strategic-merge patch: the server merges the list by ``type``.
    kube.core().patch_node_status(node_name, {"status": {"conditions": [entry(status, why, text, existing, kube.now())]}})


def mark(node_name: str, incident_ref: str, spec: dict[str, Any]) -> bool:
    """``True`` on a node sdcguard just cordoned for ``incident_ref`` (``<namespace>/<name>``, whose
    verified ``spec`` names the job, check, step and suspects). Whether it was written: an API
    error is logged, never raised (the callers that hold the node try again)."""
    try:
        existing = current(kube.core().read_node(node_name))
        _patch(node_name, True, reason(str(spec.get("check") or "unknown")), message(incident_ref, spec, node_name),
               existing)
    except Exception as exc:  # noqa: BLE001 - best effort: the cordon contains the fault, not this
        log.warning("node %s: condition %s not set for %s: %s", node_name, names.NODE_CONDITION, incident_ref, exc)
        return False
    return True


def clear(node_name: str, why: str, text: str, incidents: list[str] | None = None) -> bool:
    """``False`` (reason ``Replaced``, ``Denied`` or ``Released``) where sdcguard had set it
    ``True`` (with ``incidents``: only where it speaks for one of them); the message keeps the
    incident. A node that is gone (replaced hardware leaves the cluster) or never had it is left
    alone. Whether it wrote; an API error is raised, never swallowed (see the module's docstring)."""
    try:
        existing = current(kube.core().read_node(node_name))
        named = incident_of(existing)
        if existing is None or existing["status"] != "True" or (incidents is not None and named not in incidents):
            return False
        _patch(node_name, False, why, bounded(text, named), existing)
    except Exception as exc:
        if kube.not_found(exc):
            return False
        raise
    return True


def announced(node: Any, incident_ref: str) -> bool:
    """Whether the node (a V1Node) already shows what sdcguard says of it for ``incident_ref``:
    ``True`` for it, or ``False`` because it was cleared for it (given back, not to be set again).
    A ``False`` left by an earlier incident, or none at all, is not."""
    existing = current(node)
    return existing is not None and (existing["status"] == "True" or incident_of(existing) == incident_ref)
