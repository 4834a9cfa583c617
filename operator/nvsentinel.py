"""NVIDIA NVSentinel's ``ExternalFault`` for a suspect node's GPUs (optional: ``SDCGUARD_NVSENTINEL_EXTERNAL_FAULT``).

NVSentinel (NVIDIA's GPU node resilience system) takes faults that an external system detects
through a cluster-scoped ``ExternalFault`` (group ``nvsentinel.dgxc.nvidia.com``, its ADR-049,
docs/designs/049-external-fault.md in NVIDIA/NVSentinel): ``spec.healthEvent`` is one of its
HealthEvents, which its reconciler emits into NVSentinel's pipeline (``recommendedAction``
overridden to ``CUSTOM``, the rest as authored). sdcguard creates one per suspect node when it
cordons it, naming each suspect GPU (``GPU`` index and ``GPU_UUID`` entities, as NVSentinel's own
GPU monitors do).

Told, not asked: ``processingStrategy: STORE_ONLY`` (NVSentinel's ADR-025, "Health Event
Processing Strategy"; the published enum is ``UNSPECIFIED``, ``EXECUTE_REMEDIATION``,
``STORE_ONLY``). A ``STORE_ONLY`` event is stored, counted and exported by NVSentinel's event
exporter, and triggers no node condition, no quarantine (cordon, taint, labels), no drain and no
remediation CR. ``EXECUTE_REMEDIATION`` would have NVSentinel cordon, drain and remediate the node
beside sdcguard's own flow (deep health check, a person's approval, HyperPod's replacement), and a
denial could not undo it: the ExternalFault API has no way for its author to retract a fault
(only NVSentinel's own ``isHealthy`` event after a completed repair clears the quarantine, and
deleting an open ExternalFault is a force-close that leaves it), so there would be nothing for
sdcguard to resolve on Deny. With ``STORE_ONLY`` there is nothing to undo. NVSentinel's webhook
admits one active ExternalFault per node; a second incident on the node finds it there, and it
stays open (no repair of NVSentinel's ever completes it) until someone deletes it: sdcguard
never does (its RBAC has ``create`` only).
Best effort like the node condition: a missing CRD or a refusal is logged, containment goes on.
"""
from __future__ import annotations

import hashlib
import logging
import re
from typing import Any

from sdcguard.contract import names

from . import kube, node_condition

log = logging.getLogger("sdcguard_operator.nvsentinel")

AGENT = "sdcguard"
RECOMMENDED_ACTION = "CONTACT_SUPPORT"
PROCESSING_STRATEGY = "STORE_ONLY"  # record, never act (see the module's docstring)
API_VERSION = f"{names.NVSENTINEL_GROUP}/{names.NVSENTINEL_VERSION}"


def fault_name(incident_ref: str, node: str) -> str:
    """A DNS-1123 name per (incident, node), bounded with a hash: ``sdcguard-<incident>-<node>``."""
    raw = f"sdcguard-{incident_ref.split('/', 1)[-1]}-{node}".lower()
    name = re.sub(r"[^a-z0-9.-]+", "-", raw).strip("-.")
    if len(name) > 253:
        name = f"{name[:240].rstrip('-.')}-{hashlib.sha256(raw.encode()).hexdigest()[:12]}"
    return name


def entities(spec: dict[str, Any], node: str) -> list[dict[str, str]]:
    """The suspect GPUs on the node as NVSentinel's HealthEvent names them (``GPU`` index,
    ``GPU_UUID`` where known), the node itself when the alarm names no GPU (an older library)."""
    found: list[dict[str, str]] = []
    for suspect in node_condition.suspects_on(spec, node):
        gpu = suspect.get("gpu") or {}
        if gpu.get("index") is not None:
            found.append({"entityType": "GPU", "entityValue": str(gpu["index"])})
        if gpu.get("uuid"):
            found.append({"entityType": "GPU_UUID", "entityValue": str(gpu["uuid"])})
    unique = list({(e["entityType"], e["entityValue"]): e for e in found}.values())
    return unique or [{"entityType": "Node", "entityValue": node}]


def external_fault(incident_ref: str, spec: dict[str, Any], node: str, now: str) -> dict[str, Any]:
    """The ExternalFault for a suspect node (pure: tests validate it against NVSentinel's schema)."""
    job = spec.get("job") or {}
    return {
        "apiVersion": API_VERSION, "kind": names.NVSENTINEL_KIND,
        "metadata": {"name": fault_name(incident_ref, node),
                     "labels": {"app.kubernetes.io/managed-by": "sdcguard"},
                     "annotations": {names.INCIDENT_ANNOTATION: incident_ref}},
        "spec": {"healthEvent": {
            "version": 1,
            "agent": AGENT,
            "componentClass": "GPU",
            "checkName": names.EVENT_REASON,
            "isFatal": True,
            "isHealthy": False,
            "message": node_condition.message(incident_ref, spec, node),
            "recommendedAction": RECOMMENDED_ACTION,
            "errorCode": [str(spec.get("check") or "unknown")],
            "entitiesImpacted": entities(spec, node),
            "metadata": {"incident": incident_ref, "job": f"{job.get('namespace')}/{job.get('name')}",
                         "check": str(spec.get("check")), "step": str(spec.get("step")),
                         "alarmId": str(spec.get("alarmId") or "")},
            "generatedTimestamp": now,
            "nodeName": node,
            "processingStrategy": PROCESSING_STRATEGY,
        }},
    }


def raise_fault(node: str, incident_ref: str, spec: dict[str, Any]) -> None:
    """Create the ExternalFault (one per incident and node; an existing one is left as it is)."""
    body = external_fault(incident_ref, spec, node, kube.now())
    try:
        kube.custom().create_cluster_custom_object(names.NVSENTINEL_GROUP, names.NVSENTINEL_VERSION,
                                                   names.NVSENTINEL_PLURAL, body)
    except Exception as exc:  # noqa: BLE001 - best effort (no CRD, NVSentinel's webhook refusing a second one)
        if not kube.conflict(exc):
            log.warning("node %s: NVSentinel ExternalFault %s not created: %s", node, body["metadata"]["name"], exc)
