"""Validation of an alarm against the cluster (operator/validate.py): fresh, and within the life of its pod.

Pure functions on kubernetes client objects, in-process. The same checks through the operator's
intake: tests/test_intake.py (each rejection touches nothing) and tests/test_tenant_boundary.py.
"""
from __future__ import annotations

import datetime
import time

import kubernetes
import pytest

from sdcguard_operator import validate
from sdcguard_operator.settings import Settings


def test_alarm_freshness():
    s = Settings.from_env({"SDCGUARD_MAX_ALARM_AGE_SECONDS": "60", "SDCGUARD_CLOCK_SKEW_SECONDS": "5"})
    now = 2_000_000_000.0
    stamp = lambda t: time.strftime("%Y-%m-%dT%H:%M:%S.000Z", time.gmtime(t))  # noqa: E731
    assert validate.check_fresh({"time": stamp(now - 30)}, s, now) == now - 30
    for t in (now - 61, now + 6):
        with pytest.raises(validate.Rejected) as refused:
            validate.check_fresh({"time": stamp(t)}, s, now)
        assert refused.value.reason == "StaleAlarm"


def test_an_alarm_counts_only_within_its_pods_lifetime():
    """Issue 20, 1/2: the alarm's time must fall within the life of the pod it names: not before
    its creation, not after its deletion time (the end of its grace period)."""
    s = Settings.from_env({"SDCGUARD_CLOCK_SKEW_SECONDS": "5"})
    born = datetime.datetime(2026, 1, 1, 12, 0, tzinfo=datetime.timezone.utc)
    pod = kubernetes.client.V1Pod(
        metadata=kubernetes.client.V1ObjectMeta(
            name="llm-worker-0", uid="p1", labels={"training.kubeflow.org/job-name": "llm"}, creation_timestamp=born,
            owner_references=[kubernetes.client.V1OwnerReference(api_version="kubeflow.org/v1", kind="PyTorchJob",
                                                                 name="llm", uid="j1", controller=True)]),
        spec=kubernetes.client.V1PodSpec(node_name="n1", containers=[]))
    who, job = {"rank": 0, "pod": "llm-worker-0", "node": "n1", "pod_uid": "p1"}, {"name": "llm", "namespace": "ml"}
    at = born.timestamp()
    validate.check_pod(pod, who, job, "j1", at + 60, s)
    for moment, why in ((at - 60, "older than pod"), (at + 3600, "newer than the end")):
        pod.metadata.deletion_timestamp = born + datetime.timedelta(minutes=30)
        with pytest.raises(validate.Rejected) as refused:
            validate.check_pod(pod, who, job, "j1", moment, s)
        assert refused.value.reason == "StaleAlarm" and why in refused.value.message
    for changed, reason in (({"pod_uid": "p2"}, "PodUidMismatch"), ({"node": "n2"}, "NodeMismatch")):
        with pytest.raises(validate.Rejected) as refused:
            validate.check_pod(pod, {**who, **changed}, job, "j1", at + 60, s)
        assert refused.value.reason == reason
    with pytest.raises(validate.Rejected) as refused:
        validate.check_pod(pod, who, job, "j-other", at + 60, s)
    assert refused.value.reason == "PodNotInJob"
