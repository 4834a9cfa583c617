"""The SageMaker HyperPod calls, with their errors sorted into kinds the flow can act on.

botocore's own retries are off (one attempt per call): the operator retries throttling itself,
with a backoff recorded in the object's status, so that every attempt is visible and a restart
never turns one action into two.
"""
from __future__ import annotations

import threading
from collections.abc import Iterator
from typing import Any

import boto3
import botocore.config
import botocore.exceptions

from sdcguard.contract import names

from . import metrics
from .settings import Settings

THROTTLING_CODES = {"ThrottlingException", "Throttling", "TooManyRequestsException", "RequestLimitExceeded",
                    "ProvisionedThroughputExceededException", "SlowDown"}

#: Failed entries of BatchReplaceClusterNodes worth retrying (after DescribeClusterNode shows that
#: the attempt did not take effect).
TRANSIENT_CODES = {"InternalServerError", "InternalFailure", "ServiceUnavailable"}

_client: Any = None
_lock = threading.Lock()


class AwsError(Exception):
    """A SageMaker call failed; ``code`` is the AWS error code (or a botocore exception name)."""

    def __init__(self, operation: str, code: str, message: str) -> None:
        super().__init__(f"{operation}: {code}: {message}")
        self.operation, self.code, self.message = operation, code, message


class Transient(AwsError):
    """Not yet: the same call may succeed later; it may also have taken effect (ask first)."""


class Throttled(Transient):
    """SageMaker asked us to slow down (a throttling code): retried within the throttle budget."""


class Unavailable(Transient):
    """SageMaker could not answer (5xx, an internal error, a connection failure or timeout):
    retried within its own budget, so an outage does not use up the throttle budget."""


class NodeNotFound(AwsError):
    """The instance is not (or no longer) part of the cluster."""


def client(settings: Settings) -> Any:
    global _client
    with _lock:
        if _client is None:
            config = botocore.config.Config(retries={"total_max_attempts": 1}, connect_timeout=settings.aws_connect_timeout,
                                            read_timeout=settings.aws_read_timeout)
            _client = boto3.client("sagemaker", region_name=settings.region, config=config)
        return _client


def _call(settings: Settings, operation: str, **params: Any) -> dict[str, Any]:
    metrics.AWS_CALLS.labels(operation).inc()
    method = getattr(client(settings), _snake(operation))
    try:
        return method(**params)
    except botocore.exceptions.ClientError as exc:
        error = exc.response.get("Error", {})
        code, message = error.get("Code", "Unknown"), error.get("Message", str(exc))
        status = exc.response.get("ResponseMetadata", {}).get("HTTPStatusCode", 0)
        metrics.AWS_ERRORS.labels(operation, code).inc()
        if code in THROTTLING_CODES:
            raise Throttled(operation, code, message) from None
        if code in TRANSIENT_CODES or status >= 500:
            raise Unavailable(operation, code, message) from None
        if code == "ResourceNotFound" or "could not find node" in message.lower():
            raise NodeNotFound(operation, code, message) from None
        raise AwsError(operation, code, message) from None
    except (botocore.exceptions.ConnectionError, botocore.exceptions.HTTPClientError) as exc:
        metrics.AWS_ERRORS.labels(operation, type(exc).__name__).inc()
        raise Unavailable(operation, type(exc).__name__, str(exc)) from None


def _snake(operation: str) -> str:
    return "".join("_" + c.lower() if c.isupper() else c for c in operation).lstrip("_")


PENDING_REPLACEMENT, PENDING_REBOOT = names.HYPERPOD_PENDING_HEALTH


def pending_mark(labels: dict[str, str] | None) -> str | None:
    """HyperPod's own pending action on a node (label ``sagemaker.amazonaws.com/node-health-status``:
    ``UnschedulablePendingReplacement`` or ``UnschedulablePendingReboot``), or None."""
    value = (labels or {}).get(names.HYPERPOD_HEALTH_LABEL)
    return value if value in names.HYPERPOD_PENDING_HEALTH else None


def start_health_check(settings: Settings, cluster: str, group: str, instance_id: str) -> None:
    _call(settings, "StartClusterHealthCheck", ClusterName=cluster, DeepHealthCheckConfigurations=[
        {"InstanceGroupName": group, "InstanceIds": [instance_id], "DeepHealthChecks": list(settings.deep_health_checks)},
    ])


def describe_node(settings: Settings, cluster: str, instance_id: str) -> dict[str, Any]:
    return _call(settings, "DescribeClusterNode", ClusterName=cluster, NodeId=instance_id)["NodeDetails"]


def replace(settings: Settings, cluster: str, instance_id: str) -> tuple[bool, str, str]:
    """(succeeded, error code, message) of BatchReplaceClusterNodes for one instance."""
    answer = _call(settings, "BatchReplaceClusterNodes", ClusterName=cluster, NodeIds=[instance_id])
    if instance_id in answer.get("Successful", []):
        return True, "", ""
    for failure in answer.get("Failed", []):
        if failure.get("NodeId") == instance_id:
            metrics.AWS_ERRORS.labels("BatchReplaceClusterNodes", failure.get("ErrorCode", "Unknown")).inc()
            return False, failure.get("ErrorCode", "Unknown"), failure.get("Message", "")
    return False, "Unknown", f"the answer does not mention {instance_id}"


def cluster_nodes(settings: Settings, cluster: str) -> Iterator[tuple[str, dict[str, Any]]]:
    """Every instance of the cluster with its details (the slow path of localization)."""
    token = None
    while True:
        page = _call(settings, "ListClusterNodes", ClusterName=cluster, **({"NextToken": token} if token else {}))
        for summary in page.get("ClusterNodeSummaries", []):
            yield summary["InstanceId"], describe_node(settings, cluster, summary["InstanceId"])
        token = page.get("NextToken")
        if not token:
            return
