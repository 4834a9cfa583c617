"""The job's inventory when its incident opens: every pod, node and instance (docs/operator.md).

Taken once, when the incident opens and before the job is suspended: a suspended job's pods are
deleted, and a replaced node leaves the cluster, so the evidence report could not find them later.
Instance ids come from the node's name or providerID (no AWS call: containment must not wait for
SageMaker). A failure to list is recorded as such (``error``), never a reason to hold containment.
"""
from __future__ import annotations

from typing import Any, Mapping

from sdcguard.contract import names

from . import kube, localize, validate


def _identities(spec: Mapping[str, Any]) -> list[Mapping[str, Any]]:
    alarm = spec.get("alarm") if isinstance(spec.get("alarm"), Mapping) else {}
    named = [*(alarm.get("suspects") or spec.get("suspects") or []), alarm.get("reporter") or spec.get("reporter")]
    return [s for s in named if isinstance(s, Mapping)]


def take(spec: Mapping[str, Any]) -> dict[str, Any]:
    """``{recordedAt, pods: [{pod, uid, node, phase, replicaType, replicaIndex}], nodes: {name:
    {instanceId, cluster, instanceGroup} | {missing: true}}}`` for the incident's job."""
    job = spec.get("job") or {}
    taken: dict[str, Any] = {"recordedAt": kube.now()}
    try:
        listed = kube.core().list_namespaced_pod(job["namespace"],
                                                 label_selector=f"{names.JOB_NAME_LABEL}={job['name']}").items
        pods = [p for p in listed  # the selector is applied here too (not every API emulator applies it)
                if (p.metadata.labels or {}).get(names.JOB_NAME_LABEL) == job["name"]
                and (not spec.get("jobUid") or validate.controller_uid(p) == spec["jobUid"])]
        taken["pods"] = sorted(({
            "pod": p.metadata.name, "uid": p.metadata.uid, "node": p.spec.node_name if p.spec else None,
            "phase": p.status.phase if p.status else None,
            "replicaType": (p.metadata.labels or {}).get("training.kubeflow.org/replica-type"),
            "replicaIndex": (p.metadata.labels or {}).get("training.kubeflow.org/replica-index")} for p in pods),
            key=lambda p: p["pod"])
        wanted = {p["node"] for p in taken["pods"] if p["node"]}
        wanted |= {s["node"] for s in _identities(spec) if s.get("node")}
        found = {n.metadata.name: n for n in kube.core().list_node().items if n.metadata.name in wanted}
        taken["nodes"] = {name: _node(found.get(name)) for name in sorted(wanted)}
    except Exception as exc:  # noqa: BLE001 - evidence, never a reason to delay containment
        taken["error"] = f"{type(exc).__name__}: {str(exc)[:300]}"
    return {k: ({i: {f: v for f, v in p.items() if v is not None} for i, p in v.items()} if k == "nodes" else
                [{f: x for f, x in p.items() if x is not None} for p in v] if k == "pods" else v)
            for k, v in taken.items()}


def instance_id(node: Any) -> str | None:
    """A node object's EC2 instance id, from its name or providerID (None off AWS)."""
    found = localize.instance_from_names(node.metadata.name, node.spec.provider_id if node.spec else None)
    return found[0] if found else None


def _node(node: Any) -> dict[str, Any]:
    if node is None:
        return {"missing": True}
    labels = node.metadata.labels or {}
    return {"instanceId": instance_id(node), "cluster": labels.get(kube.CLUSTER_LABEL),
            "instanceGroup": labels.get(kube.GROUP_LABEL)}
