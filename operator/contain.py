"""Containment: suspend the job, cordon and label suspect nodes, under the storm guard.

The storm guard counts nodes carrying ``sdcguard.dev/suspect=true`` in the API (not in memory), so
its limit holds across restarts; the count and the cordon run under one process-wide lock so two
incidents handled at once cannot both take the last slot.
"""
from __future__ import annotations

import threading
from typing import Any

from sdcguard.contract import names

from . import kube, metrics
from .settings import Settings

_cordon_lock = threading.Lock()


def suspend_job(job: dict[str, str]) -> bool:
    """Set spec.runPolicy.suspend on the PyTorchJob; False if the job no longer exists."""
    try:
        kube.custom().patch_namespaced_custom_object(names.JOB_GROUP, names.JOB_VERSION, job["namespace"],
                                                     names.JOB_PLURAL, job["name"],
                                                     {"spec": {"runPolicy": {"suspend": True}}})
    except Exception as exc:
        if kube.not_found(exc):
            return False
        raise
    return True


def suspect_nodes() -> list[str]:
    """Nodes labelled suspect (server-side selector, and filtered here too: not every server applies it)."""
    nodes = kube.core().list_node(label_selector=f"{names.SUSPECT_LABEL}=true").items
    return [n.metadata.name for n in nodes if (n.metadata.labels or {}).get(names.SUSPECT_LABEL) == "true"]


def cordon(node_name: str, incident_ref: str, settings: Settings) -> str:
    """Cordon + label one node: "cordoned", "already" (labelled before), "storm-guard" or "missing"."""
    with _cordon_lock:
        try:
            node = kube.core().read_node(node_name)
        except Exception as exc:
            if kube.not_found(exc):
                return "missing"
            raise
        if (node.metadata.labels or {}).get(names.SUSPECT_LABEL) == "true":
            return "already"
        suspects = suspect_nodes()
        metrics.SUSPECT_NODES.set(len(suspects))
        if len(suspects) >= settings.max_concurrent_suspect_nodes:
            metrics.STORM_GUARD_HOLDS.inc()
            return "storm-guard"
        annotations = {names.INCIDENT_ANNOTATION: incident_ref}
        if node.spec is not None and node.spec.unschedulable:
            annotations[names.WAS_UNSCHEDULABLE_ANNOTATION] = "true"
        kube.core().patch_node(node_name, {"spec": {"unschedulable": True},
                                           "metadata": {"labels": {names.SUSPECT_LABEL: "true"},
                                                        "annotations": annotations}})
        metrics.NODES_CORDONED.inc()
        metrics.SUSPECT_NODES.set(len(suspects) + 1)
        return "cordoned"


def release(node_name: str, keep_cordoned: bool = False) -> bool:
    """Remove the suspect label (and uncordon, unless the node was cordoned before us); False if gone."""
    with _cordon_lock:
        try:
            node = kube.core().read_node(node_name)
        except Exception as exc:
            if kube.not_found(exc):
                return False
            raise
        annotations = node.metadata.annotations or {}
        patch: dict[str, Any] = {"metadata": {"labels": {names.SUSPECT_LABEL: None},
                                              "annotations": {names.INCIDENT_ANNOTATION: None, names.WAS_UNSCHEDULABLE_ANNOTATION: None}}}
        if not keep_cordoned and annotations.get(names.WAS_UNSCHEDULABLE_ANNOTATION) != "true":
            patch["spec"] = {"unschedulable": None}
        kube.core().patch_node(node_name, patch)
        return True
