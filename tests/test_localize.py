"""Node name -> HyperPod instance, cluster and instance group (operator/localize.py), all three paths.

The last path asks the local SageMaker endpoint (ListClusterNodes + DescribeClusterNode); no
Kubernetes API and no operator process.
"""
from __future__ import annotations

import kubernetes
import pytest
from conftest import new_instance
from sdcguard.sandbox.sagemaker import start_aws

from sdcguard_operator import hyperpod, localize
from sdcguard_operator.settings import Settings


def test_instance_id_from_node_name_then_provider_id():
    assert localize.instance_from_names("hyperpod-i-0123456789abcdef0", None) == ("i-0123456789abcdef0", "node-name")
    assert localize.instance_from_names("ip-10-0-0-1.ec2.internal", "aws:///us-west-2a/i-0abcdef0123456789") == \
        ("i-0abcdef0123456789", "provider-id")
    assert localize.instance_from_names("hyperpod-i-XYZ", "gce://p/z/n") is None


def _node(name: str, labels: dict, provider_id: str | None = None, addresses: tuple = ()) -> kubernetes.client.V1Node:
    return kubernetes.client.V1Node(
        metadata=kubernetes.client.V1ObjectMeta(name=name, labels=labels),
        spec=kubernetes.client.V1NodeSpec(provider_id=provider_id),
        status=kubernetes.client.V1NodeStatus(addresses=[kubernetes.client.V1NodeAddress(address=a, type="InternalIP")
                                                         for a in addresses]))


@pytest.fixture
def aws(monkeypatch):
    endpoint = start_aws()
    for key, value in endpoint.env().items():
        monkeypatch.setenv(key, value)
    # The operator builds its boto3 client once per process; this test's is built for this endpoint.
    monkeypatch.setattr(hyperpod, "_client", None)
    yield endpoint
    endpoint.stop()


def test_localize_every_path(aws):
    settings = Settings.from_env({"SDCGUARD_CLUSTER_NAME": "c1", "AWS_REGION": aws.region})
    first, second = new_instance(), new_instance()
    aws.add_cluster("c1", {first: "gpu-a", second: "gpu-b"})
    # 1. the HyperPod node name, labels give cluster and group: no AWS call
    where = localize.localize(_node(f"hyperpod-{first}", {"sagemaker.amazonaws.com/cluster-name": "c1",
                                                          "sagemaker.amazonaws.com/instance-group-name": "gpu-a"}),
                              settings)
    assert (where.instance_id, where.cluster, where.instance_group, where.source) == (first, "c1", "gpu-a", "node-name")
    assert aws.calls() == []
    # 2. providerID; no group label: DescribeClusterNode tells the group; cluster from the setting
    where = localize.localize(_node("ip-10-9-9-9.ec2.internal", {}, f"aws:///us-west-2a/{second}"), settings)
    assert (where.instance_id, where.instance_group, where.source) == (second, "gpu-b", "provider-id")
    # 3. neither: ListClusterNodes + DescribeClusterNode, matched on the private DNS name
    hostname = hyperpod.describe_node(settings, "c1", first)["PrivateDnsHostname"]
    where = localize.localize(_node(hostname, {"sagemaker.amazonaws.com/cluster-name": "c1"}), settings)
    assert (where.instance_id, where.instance_group, where.source) == (first, "gpu-a", "list-cluster-nodes")
    assert {c["action"] for c in aws.calls()} == {"DescribeClusterNode", "ListClusterNodes"}
    with pytest.raises(localize.NotLocalized, match="matches no instance"):
        localize.localize(_node("ip-1-2-3-4.ec2.internal", {}), settings)
    with pytest.raises(localize.NotLocalized, match="SDCGUARD_CLUSTER_NAME"):
        localize.localize(_node(f"hyperpod-{first}", {}), Settings.from_env({}))
