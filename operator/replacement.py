"""NodeReplacement: one cluster-scoped object per suspect node, and its flow (SPEC §6.5-6.7).

Phases: HealthCheck -> PendingApproval -> Replacing -> Replaced, or Denied / Failed.  Each AWS
call writes an intent into the status before it is made and its outcome right after; a restarted
operator that finds an intent without an outcome asks DescribeClusterNode whether the call took
effect instead of calling again.  Nothing sleeps: "not yet" is a kopf.TemporaryError with a delay
(or the next timer tick), and the attempt count lives in the status.
"""
from __future__ import annotations

import itertools
from typing import Any

import kopf

from sdcguard.contract import names

from . import approval, contain, hyperpod, kube, metrics
from .localize import Location
from .settings import Settings

TERMINAL = ("Replaced", "Failed", "Denied")
WAIT_CODES = {"InstanceIdInUse", "InvalidInstanceStatus"}
REPLACING_STATUSES = {"ShuttingDown", "Pending", "NotFound"}


def is_open(status: dict[str, Any], **_: Any) -> bool:
    """The timer runs until a terminal phase (level-triggered: it also catches a decision made at
    any time; the spec.decision handler only makes that faster)."""
    return status.get("phase") not in TERMINAL


def ensure(node: str, where: Location, incident_ref: str) -> str:
    """The open NodeReplacement of this node and instance, created if needed (never two at once)."""
    for n in itertools.count(1):
        name = node if n == 1 else f"{node}-{n}"
        body = {"apiVersion": names.API_VERSION, "kind": "NodeReplacement", "metadata": {"name": name},
                "spec": {"nodeName": node, "instanceId": where.instance_id, "clusterName": where.cluster,
                         "instanceGroup": where.instance_group, "incidents": [incident_ref]}}
        try:
            kube.custom().create_cluster_custom_object(names.GROUP, names.VERSION, names.REPLACEMENTS, body)
            return name
        except Exception as exc:
            if not kube.conflict(exc):
                raise
        existing = kube.get_replacement(name)
        same = existing["spec"].get("instanceId") == where.instance_id
        if same and (existing.get("status") or {}).get("phase") not in TERMINAL:
            incidents = list(existing["spec"].get("incidents") or [])
            if incident_ref not in incidents:
                kube.custom().patch_cluster_custom_object(names.GROUP, names.VERSION, names.REPLACEMENTS, name,
                                                          {"spec": {"incidents": incidents + [incident_ref]}})
            return name
    raise AssertionError("unreachable")


def reconcile(body: dict[str, Any], settings: Settings) -> None:
    """Advance one NodeReplacement as far as it can go now."""
    name = body["metadata"]["name"]
    with kube.object_lock("reconcile-replacement", None, name):
        body = kube.get_replacement(name)
        status = body.get("status") or {}
        if not status.get("phase"):
            status = _phase(body, "HealthCheck", "Opened", f"node {body['spec']['nodeName']}, instance "
                            f"{body['spec']['instanceId']}, cluster {body['spec']['clusterName']}")
        if status.get("phase") in TERMINAL:
            return
        decision = approval.recorded(status)
        wanted = approval.requested(body.get("spec") or {})
        if decision is None and wanted == "Denied":
            status = approval.record(name, body, "Denied")
            decision = "Denied"
        if decision == "Denied":
            _deny(body, status)
            return
        if status["phase"] == "HealthCheck":
            status = _health_check(body, status, settings)
        if status["phase"] == "PendingApproval":
            if decision is None and wanted == "Approved":
                status = approval.record(name, body, "Approved")
                decision = "Approved"
            if decision == "Approved":
                status = _replace(body, status, settings)
        if status["phase"] == "Replacing":
            _follow(body, status, settings)


def _phase(body: dict[str, Any], phase: str, event: str, message: str, **fields: Any) -> dict[str, Any]:
    name = body["metadata"]["name"]
    status = kube.record(names.REPLACEMENTS, None, name, event, message, phase=phase, **fields).get("status") or {}
    metrics.REPLACEMENTS.labels(phase).inc()
    from . import incident  # the incident module imports this one
    for ref in body["spec"].get("incidents") or []:
        incident.note(ref, f"Replacement{event}", f"{name}: {message}", name, phase)
    return status


def _note(body: dict[str, Any], event: str | None, message: str, **fields: Any) -> dict[str, Any]:
    return kube.record(names.REPLACEMENTS, None, body["metadata"]["name"], event, message, **fields).get("status") or {}


def _deny(body: dict[str, Any], status: dict[str, Any]) -> None:
    node = body["spec"]["nodeName"]
    if (status.get("replace") or {}).get("requestedAt"):
        _note(body, "DenyTooLate", "BatchReplaceClusterNodes was already requested; the denial cannot undo it")
        return
    released = contain.release(node)
    _phase(body, "Denied", "Denied", f"{node} uncordoned and unlabelled" if released else f"{node} no longer exists")


def _throttled(body: dict[str, Any], status: dict[str, Any], key: str, exc: hyperpod.AwsError,
               settings: Settings) -> None:
    """Bounded backoff: count the attempt in status, then retry later or give up."""
    attempts = int((status.get(key) or {}).get("throttled", 0)) + 1
    if attempts > settings.max_throttle_retries:
        _phase(body, "Failed", "GaveUp", f"{exc.operation} still failing after {attempts - 1} retries: {exc}",
               conditions=[kube.condition("Failed", True, exc.code, str(exc))])
        raise kopf.PermanentError(str(exc))
    delay = settings.backoff(attempts)
    _note(body, "Throttled", f"{exc}; retry {attempts}/{settings.max_throttle_retries} in {delay:g}s",
          **{key: {"throttled": attempts}})
    raise kopf.TemporaryError(str(exc), delay=delay)


def _health_check(body: dict[str, Any], status: dict[str, Any], settings: Settings) -> dict[str, Any]:
    spec = body["spec"]
    check = status.get("healthCheck") or {}
    if not settings.deep_health_checks:
        return _phase(body, "PendingApproval", "HealthCheckSkipped", "no deep health check configured",
                      healthCheck={"result": "Skipped"})
    if not spec.get("instanceGroup"):
        return _phase(body, "PendingApproval", "HealthCheckSkipped", "instance group unknown",
                      healthCheck={"result": "NotRun", "message": "instance group unknown"})
    if not check.get("requestedAt"):
        if check.get("attemptedAt") and _describe_status(body, settings) == "DeepHealthCheckInProgress":
            return _note(body, "HealthCheckRequested", "found in progress after a restart",
                         healthCheck={"requestedAt": check["attemptedAt"], "sawInProgress": True})
        _note(body, None, "", healthCheck={"attemptedAt": kube.now()})  # intent, before the call
        try:
            hyperpod.start_health_check(settings, spec["clusterName"], spec["instanceGroup"], spec["instanceId"])
        except hyperpod.Throttled as exc:
            _throttled(body, status, "healthCheck", exc, settings)
        except hyperpod.AwsError as exc:
            return _phase(body, "PendingApproval", "HealthCheckNotRun", str(exc),
                          healthCheck={"result": "NotRun", "message": str(exc)})
        return _note(body, "HealthCheckRequested", f"StartClusterHealthCheck {list(settings.deep_health_checks)} "
                     f"on {spec['instanceId']} (group {spec['instanceGroup']})",
                     healthCheck={"requestedAt": kube.now(), "checks": list(settings.deep_health_checks)})
    try:
        details = hyperpod.describe_node(settings, spec["clusterName"], spec["instanceId"])
    except hyperpod.Throttled as exc:
        raise kopf.TemporaryError(str(exc), delay=settings.retry_seconds) from None
    state = details.get("InstanceStatus") or {}
    polls = int(check.get("polls", 0)) + 1
    if state.get("Status") == "DeepHealthCheckInProgress":
        return _note(body, None, "", healthCheck={"sawInProgress": True, "polls": polls})
    if state.get("Status") == "Failure":
        return _phase(body, "PendingApproval", "HealthCheckFailed", f"deep health check failed: {state.get('Message')}",
                      healthCheck={"result": "Failed", "message": state.get("Message"), "polls": polls},
                      conditions=[kube.condition("HealthCheckPassed", False, "Failed", str(state.get("Message")))])
    if state.get("Status") == "Running" and (check.get("sawInProgress") or polls >= 3):
        return _phase(body, "PendingApproval", "HealthCheckPassed",
                      "deep health check passed (SDC can still escape it: decide on the incident's evidence)",
                      healthCheck={"result": "Passed", "message": state.get("Message"), "polls": polls},
                      conditions=[kube.condition("HealthCheckPassed", True, "Passed", "deep health check passed")])
    return _note(body, None, "", healthCheck={"polls": polls})


def _describe_status(body: dict[str, Any], settings: Settings) -> str:
    spec = body["spec"]
    try:
        return (hyperpod.describe_node(settings, spec["clusterName"], spec["instanceId"]).get("InstanceStatus")
                or {}).get("Status", "")
    except hyperpod.NodeNotFound:
        return "NotFound"
    except hyperpod.Throttled as exc:
        raise kopf.TemporaryError(str(exc), delay=settings.retry_seconds) from None


def _replace(body: dict[str, Any], status: dict[str, Any], settings: Settings) -> dict[str, Any]:
    """BatchReplaceClusterNodes exactly once: intent, call, outcome; a restart checks before calling."""
    spec = body["spec"]
    replace = status.get("replace") or {}
    if replace.get("requestedAt"):
        return _phase(body, "Replacing", "ReplaceRequested", "resuming the follow-up")
    if replace.get("attemptedAt") and _describe_status(body, settings) in REPLACING_STATUSES:
        return _phase(body, "Replacing", "ReplaceRequested", "found replacing after a restart",
                      replace={"requestedAt": replace["attemptedAt"], "recovered": True})
    _note(body, None, "", replace={"attemptedAt": kube.now()})  # intent, before the call
    try:
        ok, code, message = hyperpod.replace(settings, spec["clusterName"], spec["instanceId"])
    except hyperpod.Throttled as exc:
        _throttled(body, status, "replace", exc, settings)
    except hyperpod.AwsError as exc:
        ok, code, message = False, exc.code, exc.message
    if ok:
        return _phase(body, "Replacing", "ReplaceRequested", f"BatchReplaceClusterNodes accepted {spec['instanceId']}",
                      replace={"requestedAt": kube.now()})
    if code in WAIT_CODES:
        waits = int(replace.get("waits", 0)) + 1
        _note(body, "ReplaceWaiting", f"{code}: {message}; waiting", replace={"waits": waits, "lastError": code},
              conditions=[kube.condition("ReplaceBlocked", True, code, message)])
        raise kopf.TemporaryError(f"{code}: {message}", delay=settings.backoff(waits))
    return _phase(body, "Failed", "ReplaceFailed", f"{code}: {message}",
                  replace={"error": code, "message": message},
                  conditions=[kube.condition("Failed", True, code, message)])


def _follow(body: dict[str, Any], status: dict[str, Any], settings: Settings) -> None:
    spec = body["spec"]
    state = _describe_status(body, settings)
    if state == "NotFound":
        contain.release(spec["nodeName"], keep_cordoned=True)
        _phase(body, "Replaced", "Replaced", f"instance {spec['instanceId']} terminated and replaced by fresh hardware",
               replace={"completedAt": kube.now()},
               conditions=[kube.condition("Replaced", True, "Replaced", "instance replaced")])
    elif state == "Failure":
        _phase(body, "Failed", "ReplaceFailed", "the instance went to Failure during replacement",
               conditions=[kube.condition("Failed", True, "InstanceFailure", "instance status Failure")])
