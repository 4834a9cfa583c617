"""Repeat offenders, the operator's side: keep the hardware record and flag the nodes (docs/operator.md).

The record (:mod:`.history`) is the ConfigMap ``sdcguard-hardware-history`` in the operator's own
namespace, written by the operator alone (a compare-and-swap on its resourceVersion, as the storm
guard's slots are). Why there and not only in the incidents: it must outlive what a tenant can
delete (its incidents, its namespace) and what the cluster replaces (the node object, the job),
and only the operator should be able to write what makes a node a repeat offender. Entries are
dropped once older than both the repeat-offender window and the incidents' retention.

When an incident opens, its hardware is added, and the pieces with another incident of another
job within the window are the incident's repeat offenders: recorded in its status
(:func:`sdcguard_operator.incident.reconcile`), and the suspect node labelled
``sdcguard.dev/repeat-offender=true`` with the annotation of the same name saying why. Only nodes
whose storm-guard slot the incident holds count (:func:`held`): sdcguard cordoned them for it after
checking that the job's pod the signed alarm names runs there and shares the node with no other
tenant, so an alarm naming another team's node (or GPU) records nothing against it. Their instance
ids come from the node objects, never from the incident's (unsealed) status.
"""
from __future__ import annotations

import time
from typing import Any, Mapping

from sdcguard.contract import names

from . import contain, history, inventory, kube
from .settings import Settings

RETRIES = 16


def _window(settings: Settings) -> str:
    """The window, on the record for ``kubectl sdcguard history`` (seconds)."""
    return f"{settings.repeat_offender_window_seconds:g}"


def _read_or_create(namespace: str, settings: Settings) -> Any:
    return kube.read_or_create(
        f"ConfigMap {namespace}/{names.HARDWARE_HISTORY_CONFIGMAP}",
        lambda: kube.core().read_namespaced_config_map(names.HARDWARE_HISTORY_CONFIGMAP, namespace),
        lambda: kube.core().create_namespaced_config_map(namespace, {
            "metadata": {"name": names.HARDWARE_HISTORY_CONFIGMAP, "namespace": namespace,
                         "labels": {"app.kubernetes.io/managed-by": "sdcguard"},
                         "annotations": {history.WINDOW_ANNOTATION: _window(settings)}},
            "data": {}}))


def horizon(settings: Settings, now: float) -> float:
    """Entries with an alarm before this (epoch seconds) are no longer kept."""
    return now - max(settings.repeat_offender_window_seconds, settings.incident_retention_seconds)


def held(ref: str, spec: Mapping[str, Any], settings: Settings) -> dict[str, str | None]:
    """The suspect nodes whose storm-guard slot sdcguard holds for ``ref`` (it cordoned them for this
    incident) -> each one's instance id from its node object (None off AWS, or the node gone)."""
    found: dict[str, str | None] = {}
    for node in dict.fromkeys(s.get("node") for s in history.suspects(spec) if s.get("node")):
        if contain.slot_holder(node, settings) != ref:
            continue  # refused (shared, pod not there), held back, or another incident's
        try:
            found[node] = inventory.instance_id(kube.core().read_node(node))
        except Exception as exc:
            if not kube.not_found(exc):
                raise
            found[node] = None
    return found


def record(ref: str, spec: Mapping[str, Any], settings: Settings, now: float | None = None) -> list[dict[str, Any]]:
    """Add the incident ``ref`` under each piece of hardware it names on the nodes it holds
    (:func:`held`); return its repeat offenders."""
    if spec.get("drill"):
        return []  # synthetic faults say nothing about the hardware
    now = time.time() if now is None else now
    keys = history.hardware(spec, held(ref, spec, settings))
    if not keys:
        return []
    namespace = contain.ledger_namespace(settings)
    for _ in range(RETRIES):
        stored = _read_or_create(namespace, settings)
        data = dict(stored.data or {})
        current = history.parse(data)
        for record_key, node in keys:
            history.add(current, record_key, history.entry(ref, spec, node))
        current = history.prune(current, horizon(settings, now))
        wanted = history.dump(current)
        patch: dict[str, Any] = {k: None for k in data if k not in wanted}
        patch.update({k: v for k, v in wanted.items() if data.get(k) != v})
        if not patch:
            return history.offenders(current, keys, settings.repeat_offender_window_seconds, now)
        try:
            kube.core().patch_namespaced_config_map(names.HARDWARE_HISTORY_CONFIGMAP, namespace, {
                "metadata": {"resourceVersion": stored.metadata.resource_version,
                             "annotations": {history.WINDOW_ANNOTATION: _window(settings)}}, "data": patch})
        except Exception as exc:
            if not kube.conflict(exc):
                raise
            continue
        return history.offenders(current, keys, settings.repeat_offender_window_seconds, now)
    raise RuntimeError(f"hardware history {namespace}/{names.HARDWARE_HISTORY_CONFIGMAP}: still conflicting")


def describe(offender: Mapping[str, Any], settings: Settings) -> str:
    """One line: ``gpu GPU-1234: 2 incidents (2 jobs) within 30d: ml/a, ml/b``."""
    refs = offender["incidents"]
    shown = ", ".join(refs[-5:]) + (f" and {len(refs) - 5} more" if len(refs) > 5 else "")
    return (f"{offender['kind']} {offender['id']}: {len(refs)} incidents ({offender['jobs']} jobs) within "
            f"{history.show_duration(settings.repeat_offender_window_seconds)}: {shown}")


def flag_nodes(offenders: list[dict[str, Any]], settings: Settings) -> list[str]:
    """Label each repeat offender's node (one annotation line per node); the nodes flagged. A node
    already gone (replaced) is passed over: the record keeps its instance and GPUs."""
    lines: dict[str, list[str]] = {}
    for offender in offenders:
        lines.setdefault(offender["node"], []).append(describe(offender, settings))
    flagged = []
    for node, text in lines.items():
        try:
            kube.core().patch_node(node, {"metadata": {
                "labels": {names.REPEAT_OFFENDER_LABEL: "true"},
                "annotations": {names.REPEAT_OFFENDER_ANNOTATION: "; ".join(text)[:4096]}}})
        except Exception as exc:
            if not kube.not_found(exc):
                raise
            continue
        flagged.append(node)
    return flagged
