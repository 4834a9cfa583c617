"""Containment: suspend the job, cordon and label suspect nodes, under the storm guard.

The storm guard's slots live in the API, not in memory: a ConfigMap, ``sdcguard-storm-guard`` in
the operator's namespace, maps each node sdcguard holds to the incident (and job) that took it.
Three limits apply: cluster-wide (``maxConcurrentSuspectNodes``), per namespace and per job.  A slot is
taken with a compare-and-swap (a patch conditional on the ConfigMap's resourceVersion), so two
incidents handled at once — by two handlers of one process or by two replicas — cannot both take
the last slot; only then is the node cordoned and labelled ``sdcguard.dev/suspect=true``.  Nodes
carrying the label without a slot (set by hand, or left by an interrupted release) count as taken too.  A slot is
given back when the node is released: denied, replaced, or ``kubectl sdcguard release NODE`` after
a failed replacement; the node condition is cleared before it (:func:`release`).
"""
from __future__ import annotations

from typing import Any

import kopf
import kubernetes

from sdcguard.contract import names

from . import kube, metrics, node_condition, nvsentinel
from .settings import Settings

LEDGER = "sdcguard-storm-guard"
LEDGER_RETRIES = 16


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


SHARED_IGNORED_NAMESPACES = ("kube-system",)


def other_namespaces(node_name: str, namespace: str, settings: Settings) -> set[str]:
    """The namespaces, other than ``namespace``, whose pods run on the node (finished pods, DaemonSet
    pods and kube-system's aside: every node runs those). A suspect node shared with another team
    is not cordoned on one tenant's alarm (docs/design.md §9)."""
    pods = kube.core().list_pod_for_all_namespaces(field_selector=f"spec.nodeName={node_name}").items
    others = set()
    for pod in pods:  # the selector is applied here too (not every API emulator applies it)
        if pod.spec is None or pod.spec.node_name != node_name:
            continue
        if pod.metadata.namespace in (namespace, *SHARED_IGNORED_NAMESPACES, ledger_namespace(settings)):
            continue
        if pod.status is not None and pod.status.phase in ("Succeeded", "Failed"):
            continue
        if any(ref.kind == "DaemonSet" and ref.controller for ref in pod.metadata.owner_references or []):
            continue
        others.add(pod.metadata.namespace)
    return others


def suspect_nodes() -> list[str]:
    """Nodes labelled suspect (the API server applies the label selector)."""
    return [n.metadata.name for n in kube.core().list_node(label_selector=f"{names.SUSPECT_LABEL}=true").items]


def ledger_namespace(settings: Settings) -> str:
    return settings.pod_namespace or "default"


def _ledger(namespace: str) -> Any:
    """The slot ConfigMap, created empty if it does not exist yet."""
    return kube.read_or_create(
        f"ConfigMap {namespace}/{LEDGER}", lambda: kube.core().read_namespaced_config_map(LEDGER, namespace),
        lambda: kube.core().create_namespaced_config_map(namespace, {
            "metadata": {"name": LEDGER, "namespace": namespace,
                         "labels": {"app.kubernetes.io/managed-by": "sdcguard"}}, "data": {}}))


def slots(settings: Settings) -> dict[str, str]:
    """Nodes holding a storm-guard slot -> the incident that took it (labelled nodes included)."""
    taken = dict(_ledger(ledger_namespace(settings)).data or {})
    for node in suspect_nodes():
        taken.setdefault(node, "")
    return taken


def slot_value(incident_ref: str, job: str) -> str:
    """A slot's value: ``<namespace>/<incident> job=<job>``."""
    return f"{incident_ref} job={job}"


def _owner_of(value: str) -> tuple[str, str]:
    """(namespace, job) of a slot value; ("", "") for a labelled node without a slot."""
    ref, _, job = value.partition(" job=")
    return ref.split("/", 1)[0] if "/" in ref else "", job


def full(taken: dict[str, str], namespace: str, job: str, settings: Settings) -> str | None:
    """Which storm-guard limit a new slot of (namespace, job) would exceed, or None (docs/design.md §9: per
    job and per namespace beside the cluster-wide one, so one tenant cannot take every slot)."""
    owners = [_owner_of(v) for v in taken.values()]
    if len(taken) >= settings.max_concurrent_suspect_nodes:
        return "MaxConcurrentSuspectNodes"
    if sum(1 for ns, _ in owners if ns == namespace) >= settings.max_suspect_nodes_per_namespace:
        return "MaxSuspectNodesPerNamespace"
    if sum(1 for ns, j in owners if (ns, j) == (namespace, job)) >= settings.max_suspect_nodes_per_job:
        return "MaxSuspectNodesPerJob"
    return None


def _take_slot(node_name: str, incident_ref: str, job: str, settings: Settings) -> str | None:
    """Compare-and-swap a slot for the node into the ledger; None when taken, else the limit that is full."""
    namespace = ledger_namespace(settings)
    for _ in range(LEDGER_RETRIES):
        ledger = _ledger(namespace)
        data = dict(ledger.data or {})
        if node_name in data:
            return None  # taken before (by us before a crash, or by another incident of the node)
        taken = dict(data)
        for node in suspect_nodes():
            taken.setdefault(node, "")
        metrics.SUSPECT_NODES.set(len(taken))
        limit = full(taken, incident_ref.split("/", 1)[0], job, settings) if node_name not in taken else None
        if limit:
            return limit
        try:
            kube.core().patch_namespaced_config_map(LEDGER, namespace, {
                "metadata": {"resourceVersion": ledger.metadata.resource_version},
                "data": {node_name: slot_value(incident_ref, job)}})
            return None
        except kubernetes.client.ApiException as exc:
            if not kube.conflict(exc):
                raise  # another slot changed meanwhile: count again
    raise RuntimeError(f"storm-guard ledger {namespace}/{LEDGER}: still conflicting after {LEDGER_RETRIES} reads")


def slot_holder(node_name: str, settings: Settings) -> str | None:
    """The incident (``<namespace>/<name>``) on whose behalf sdcguard holds the node's storm-guard
    slot, or None without a slot. The ledger is written by the operator alone, in its own namespace,
    and a slot is taken only for a verified incident's suspect right before the cordon: this, never
    an incident's free-form status, says which nodes sdcguard cordoned and for which incident."""
    value = (_ledger(ledger_namespace(settings)).data or {}).get(node_name)
    return None if value is None else value.partition(" job=")[0]


def give_back_uncordoned(node_name: str, incident_ref: str, settings: Settings) -> bool:
    """Give back the slot ``incident_ref`` took for a node it did not cordon: the cordon's write
    failed after the slot was taken, and by the next pass the node is gone or refused (its job
    suspended, another tenant's pod landed on it). Held, it would count against the storm guard
    for good, with no NodeReplacement to release it by. Whether a slot was given back; a node
    that carries the suspect label keeps its slot (it is cordoned: :func:`release` frees it)."""
    if slot_holder(node_name, settings) != incident_ref or held_cordoned(node_name, incident_ref, settings):
        return False
    _give_slot(node_name, settings)
    return True


def held_cordoned(node_name: str, incident_ref: str, settings: Settings) -> bool:
    """Whether sdcguard holds the node cordoned for ``incident_ref``: its slot, and the suspect
    label (a node that is gone is not)."""
    if slot_holder(node_name, settings) != incident_ref:
        return False
    try:
        node = kube.core().read_node(node_name)
    except Exception as exc:
        if kube.not_found(exc):
            return False
        raise
    return (node.metadata.labels or {}).get(names.SUSPECT_LABEL) == "true"


def _give_slot(node_name: str, settings: Settings) -> None:
    """Remove the node's slot (a merge patch deleting one key: no precondition needed)."""
    namespace = ledger_namespace(settings)
    if node_name in (_ledger(namespace).data or {}):
        kube.core().patch_namespaced_config_map(LEDGER, namespace, {"data": {node_name: None}})


def cordon(node_name: str, incident_ref: str, job: str, settings: Settings) -> str:
    """Cordon + label one node: "cordoned", "already" (labelled before), "missing", or the name of
    the storm-guard limit that holds it back (``MaxConcurrentSuspectNodes``, ``...PerNamespace``,
    ``...PerJob``)."""
    try:
        node = kube.core().read_node(node_name)
    except Exception as exc:
        if kube.not_found(exc):
            return "missing"
        raise
    if (node.metadata.labels or {}).get(names.SUSPECT_LABEL) == "true":
        if not node_condition.announced(node, incident_ref) and slot_holder(node_name, settings) == incident_ref:
            # cordoned for it before a restart (or an API error) took this write; a False left by an
            # earlier incident of the node is set back to True
            announce(node_name, incident_ref, settings)
        return "already"
    limit = _take_slot(node_name, incident_ref, job, settings)
    if limit:
        metrics.STORM_GUARD_HOLDS.inc()
        return limit
    annotations = {names.INCIDENT_ANNOTATION: incident_ref}
    if node.spec is not None and node.spec.unschedulable:
        annotations[names.WAS_UNSCHEDULABLE_ANNOTATION] = "true"
    kube.core().patch_node(node_name, {"spec": {"unschedulable": True},
                                       "metadata": {"labels": {names.SUSPECT_LABEL: "true"},
                                                    "annotations": annotations}})
    metrics.NODES_CORDONED.inc()
    announce(node_name, incident_ref, settings)
    return "cordoned"


def announce(node_name: str, incident_ref: str, settings: Settings) -> bool:
    """What the rest of the cluster sees of a cordon (best effort, never holding containment back):
    the node condition, and NVSentinel's ExternalFault where enabled (docs/operator.md). Whether
    the condition was written."""
    try:
        spec = kube.get_incident(*incident_ref.split("/", 1)).get("spec") or {}
    except Exception as exc:  # noqa: BLE001
        node_condition.log.warning("node %s: incident %s not read, nothing announced: %s", node_name, incident_ref, exc)
        return False
    written = node_condition.mark(node_name, incident_ref, spec)
    if settings.nvsentinel_external_fault:
        nvsentinel.raise_fault(node_name, incident_ref, spec)
    return written


def reannounce(node_name: str, incidents: list[str], settings: Settings) -> bool:
    """The node condition set again if the cordon's write was lost (it is best effort, and the
    incident records the cordon whether or not it landed): only for the one of ``incidents`` that
    holds the node's storm-guard slot, never over a ``False`` cleared for it. One node read; the
    ledger is read only when the condition is not ``True``. Whether nothing is left to do (the
    condition is ``True``, or it is not one of ``incidents``' to set); an API error is raised."""
    try:
        found = kube.core().read_node(node_name)
    except Exception as exc:
        if kube.not_found(exc):
            return True  # gone, condition and all
        raise
    if (node_condition.current(found) or {}).get("status") == "True":
        return True
    holder = slot_holder(node_name, settings)
    if holder not in incidents or node_condition.announced(found, holder):
        return True
    if not announce(node_name, holder, settings):
        return False
    if slot_holder(node_name, settings) != holder:
        # given back while this was written (a denial's release cleared before it): not left True.
        # release() looks again once it has given the slot back; between the two, one clears it.
        node_condition.clear(node_name, node_condition.RELEASED, "storm-guard slot given back", incidents=[holder])
    return True


def release(node_name: str, settings: Settings, keep_cordoned: bool = False,
            why: str = node_condition.RELEASED, text: str = "storm-guard slot given back") -> bool:
    """Set the node condition ``False`` (reason ``why``), remove the suspect label (and uncordon,
    unless the node was cordoned before us), then give the storm-guard slot back; False if the node
    is gone (its slot is given back all the same).

    The condition goes first, and a failure to write it stops here (kopf.TemporaryError): once the
    slot is gone no later pass knows the node was sdcguard's, and a ``True`` left behind is a
    remediation trigger (NodeHealthCheck) on a node a person gave back. Once the slot is given
    back it is looked at again: a timer's lost-write pass (:func:`reannounce`) may have set it
    ``True`` meanwhile."""
    holder = slot_holder(node_name, settings)
    try:
        node_condition.clear(node_name, why, text)
    except Exception as exc:  # noqa: BLE001 - any API error: retried, the slot stays until it is written
        raise kopf.TemporaryError(f"node {node_name}: condition {names.NODE_CONDITION} not cleared ({why}): {exc}; "
                                  "the storm-guard slot is kept until it is", delay=settings.retry_seconds) from None
    try:
        node = kube.core().read_node(node_name)
    except Exception as exc:
        if kube.not_found(exc):
            _give_slot(node_name, settings)
            return False
        raise
    annotations = node.metadata.annotations or {}
    patch: dict[str, Any] = {"metadata": {"labels": {names.SUSPECT_LABEL: None},
                                          "annotations": {names.INCIDENT_ANNOTATION: None, names.WAS_UNSCHEDULABLE_ANNOTATION: None}}}
    if not keep_cordoned and annotations.get(names.WAS_UNSCHEDULABLE_ANNOTATION) != "true":
        patch["spec"] = {"unschedulable": None}
    kube.core().patch_node(node_name, patch)
    _give_slot(node_name, settings)
    if holder:
        try:  # a True written for the holder since the clear above (a concurrent reannounce) goes too
            node_condition.clear(node_name, why, text, incidents=[holder])
        except Exception as exc:  # noqa: BLE001 - the slot is given back: reannounce clears what it set then
            node_condition.log.warning("node %s: condition not looked at again after its release: %s", node_name, exc)
    return True
