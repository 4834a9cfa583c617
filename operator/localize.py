"""Node name -> HyperPod instance id, cluster and instance group (docs/design.md §6.2).

HyperPod EKS nodes are named ``hyperpod-i-<instance id>``; other nodes are found through their
``providerID`` (``aws:///<zone>/i-...``) and, last, by matching the node's addresses against
``ListClusterNodes`` + ``DescribeClusterNode``.
"""
from __future__ import annotations

import dataclasses
import re
from typing import Any

from . import hyperpod, kube
from .settings import Settings

INSTANCE_ID = re.compile(r"i-[a-f0-9]{8}(?:[a-f0-9]{9})?")
HYPERPOD_NODE = re.compile(r"^hyperpod-(i-[a-f0-9]{8}(?:[a-f0-9]{9})?)$")


@dataclasses.dataclass(frozen=True, slots=True)
class Location:
    instance_id: str
    cluster: str
    instance_group: str | None
    source: str  # how the instance id was found: node-name, provider-id, list-cluster-nodes


class NotLocalized(Exception):
    """The node cannot be tied to a HyperPod instance (the message says why)."""


def instance_from_names(node_name: str, provider_id: str | None) -> tuple[str, str] | None:
    """(instance id, source) from the node's name or providerID alone, without AWS calls."""
    match = HYPERPOD_NODE.fullmatch(node_name)
    if match:
        return match.group(1), "node-name"
    tail = (provider_id or "").rsplit("/", 1)[-1]
    if INSTANCE_ID.fullmatch(tail):
        return tail, "provider-id"
    return None


def localize(node: Any, settings: Settings) -> Location:
    """Locate a ``V1Node`` (as read from the API)."""
    labels = node.metadata.labels or {}
    cluster = labels.get(kube.CLUSTER_LABEL) or settings.cluster_name
    if not cluster:
        raise NotLocalized(f"node {node.metadata.name} has no {kube.CLUSTER_LABEL} label and "
                           "SDCGUARD_CLUSTER_NAME is not set")
    group = labels.get(kube.GROUP_LABEL)
    found = instance_from_names(node.metadata.name, node.spec.provider_id if node.spec else None)
    if found is None:
        addresses = {a.address for a in (node.status.addresses or [])} if node.status else set()
        addresses.add(node.metadata.name)
        for instance_id, details in hyperpod.cluster_nodes(settings, cluster):
            if addresses & {details.get("PrivateDnsHostname"), details.get("PrivatePrimaryIp")}:
                return Location(instance_id, cluster, details.get("InstanceGroupName"), "list-cluster-nodes")
        raise NotLocalized(f"node {node.metadata.name} matches no instance of cluster {cluster}")
    instance_id, source = found
    if group is None:
        group = hyperpod.describe_node(settings, cluster, instance_id).get("InstanceGroupName")
    return Location(instance_id, cluster, group, source)
