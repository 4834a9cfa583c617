"""NodeReplacement: one cluster-scoped object per suspect node, and its flow (docs/design.md §6.5-6.7).

Phases: HealthCheck -> PendingApproval -> Replacing -> Replaced, or Denied / Failed.  Each AWS
call writes an intent into the status before it is made and its outcome right after; a restarted
operator that finds an intent without an outcome asks DescribeClusterNode whether the call took
effect instead of calling again.  Nothing sleeps: "not yet" is a kopf.TemporaryError with a delay
(or the next timer tick), and the attempt count lives in the status.

The target — node, instance, cluster, instance group — is written into ``status.target`` from the
operator's own localization right after the object is created, and every action uses that record,
never the spec: the spec is only compared with it. A spec whose target differs fails the
replacement (``TargetChanged``) before anything is replaced (the webhook and the CRD's CEL rules
forbid the change; this holds even where neither runs). An object without a recorded target (not
created by the operator, or created just before a crash) is left alone until :func:`ensure`
records one.
"""
from __future__ import annotations

import datetime
import functools
import hashlib
import itertools
from typing import Any

import kopf

from sdcguard.contract import names
from sdcguard.contract.phases import Decision
from sdcguard.contract.phases import ReplacementPhase as Phase

from . import approval, contain, hyperpod, kube, master_key, metrics, node_condition
from .localize import Location
from .settings import Settings

TERMINAL, TARGET_FIELDS = approval.TERMINAL, approval.TARGET_FIELDS
WAIT_CODES = {"InstanceIdInUse", "InvalidInstanceStatus"}
REPLACING_STATUSES = {"ShuttingDown", "Pending", "NotFound"}
OUTCOME_WRITES = 4  # tries to write an AWS call's outcome before kopf's retry takes over (:func:`_outcome`)


def is_open(status: dict[str, Any], **_: Any) -> bool:
    """The timer runs until a terminal phase (level-triggered: it also catches a decision made at
    any time; the spec.decision handler only makes that faster), never for an object the operator
    did not create."""
    foreign = any(c.get("type") == "CreatedByOperator" and c.get("status") == "False"
                  for c in status.get("conditions") or [])
    return status.get("phase") not in TERMINAL and not foreign


def install_seal(settings: Settings) -> None:
    """Every write of a NodeReplacement's status carries the operator's seal (``status.seal``, see
    :class:`kube.StatusSeal`), and a status without a valid one is neither acted on nor written over:
    a ``/status`` write can no longer fake the health check's result and message (what the approver
    reads), skip the check by writing ``PendingApproval``, or reach ``release`` with a forged
    ``Failed``."""
    if names.REPLACEMENTS not in kube.SEALS:
        kube.SEALS[names.REPLACEMENTS] = kube.StatusSeal(
            lambda name, text: master_key.seal(settings, "NodeReplacementStatus", name,
                                               hashlib.sha256(text.encode()).hexdigest()))


def status_sealed(body: dict[str, Any]) -> bool:
    return kube.sealed_status(names.REPLACEMENTS, body["metadata"]["name"], body.get("status") or {})


def _refuse_unsealed(body: dict[str, Any]) -> None:
    """A status the operator did not seal: marked (condition ``StatusSealed=False``, conditions only,
    so the seal stays broken), counted, never acted on."""
    status = body.get("status") or {}
    if any(c.get("type") == "StatusSealed" and c.get("status") == "False" for c in status.get("conditions") or []):
        return
    metrics.REPLACEMENTS_REFUSED.labels("StatusNotSealed").inc()
    message = ("the status does not carry the operator's seal: someone else wrote it (phase, health check, "
               "decision); nothing is acted on and what it shows is not the operator's record")
    kube.record(names.REPLACEMENTS, None, body["metadata"]["name"], unsealed=True,
                conditions=[kube.condition("StatusSealed", False, "StatusNotSealed", message)])


def check_seal(body: dict[str, Any], settings: Settings) -> None:
    """On every change of a NodeReplacement (the timer stops at a terminal phase, also a forged one):
    a status the operator did not seal is marked at once."""
    install_seal(settings)
    if ours(body, settings) and not status_sealed(body):
        _refuse_unsealed(body)


def seal(settings: Settings, name: str, target: dict[str, Any]) -> str:
    """The operator's mark on a NodeReplacement it created: over its name and target."""
    return master_key.seal(settings, "NodeReplacement", name, *(str(target.get(f) or "") for f in TARGET_FIELDS))


def ours(body: dict[str, Any], settings: Settings) -> bool:
    """Created by this operator (docs/design.md §9: a NodeReplacement it did not create is never adopted)."""
    annotations = (body.get("metadata") or {}).get("annotations") or {}
    target = (body.get("status") or {}).get("target") or body.get("spec") or {}  # the recorded one, once there
    return master_key.sealed(settings, annotations.get(names.SEAL_ANNOTATION), "NodeReplacement",
                             body["metadata"]["name"], *(str(target.get(f) or "") for f in TARGET_FIELDS))


def target_of(node: str, where: Location) -> dict[str, str]:
    """The target as the operator localized it (no instanceGroup key when the group is unknown)."""
    target = {"nodeName": node, "instanceId": where.instance_id, "clusterName": where.cluster}
    if where.instance_group:
        target["instanceGroup"] = where.instance_group
    return target


def spec_target(spec: dict[str, Any]) -> dict[str, Any]:
    return {f: spec[f] for f in TARGET_FIELDS if spec.get(f) is not None}


def ensure(node: str, where: Location, incident_ref: str, settings: Settings) -> str:
    """The open NodeReplacement of this node and instance, created (sealed) if needed (never two at
    once), with its target recorded in the status. An object of that name the operator did not
    create (pre-created, perhaps with a decision set) is passed over, never adopted: the next name
    is tried. A 409 to the create with nothing there to read is created again
    (:func:`kube.read_or_create`), not taken for a replacement that exists."""
    install_seal(settings)
    target = target_of(node, where)
    for n in itertools.count(1):
        name = node if n == 1 else f"{node}-{n}"
        body = {"apiVersion": names.API_VERSION, "kind": "NodeReplacement",
                "metadata": {"name": name, "annotations": {names.SEAL_ANNOTATION: seal(settings, name, target)}},
                "spec": {**target, "incidents": [incident_ref]}}
        existing = kube.read_or_create(
            f"NodeReplacement {name}", functools.partial(kube.get_replacement, name),
            functools.partial(kube.custom().create_cluster_custom_object, names.GROUP, names.VERSION,
                              names.REPLACEMENTS, body))
        status = existing.get("status") or {}
        if not ours(existing, settings):
            metrics.REPLACEMENTS_REFUSED.labels("NotCreatedByOperator").inc()
            continue
        if not status_sealed(existing):
            continue  # its status was forged: not joined (the next name is tried)
        if spec_target(existing["spec"]) == target and status.get("phase") not in TERMINAL \
                and status.get("target", target) == target:
            if not status.get("target"):  # created just now, or just before a crash
                _record_target(name, target)
            incidents = list(existing["spec"].get("incidents") or [])
            if incident_ref not in incidents:
                kube.custom().patch_cluster_custom_object(names.GROUP, names.VERSION, names.REPLACEMENTS, name,
                                                          {"spec": {"incidents": incidents + [incident_ref]}})
            return name
    raise AssertionError("unreachable")


def _record_target(name: str, target: dict[str, str]) -> None:
    kube.update_status(names.REPLACEMENTS, None, name, lambda status: {} if status.get("target") else {"target": target})


def changed_fields(spec: dict[str, Any], target: dict[str, Any]) -> list[str]:
    """The target fields in which the spec differs from the recorded target."""
    return [f for f in TARGET_FIELDS if spec.get(f) != target.get(f)]


def reconcile(body: dict[str, Any], settings: Settings) -> None:
    """Advance one NodeReplacement as far as it can go now.

    No lock: kopf may run the timer and the decision handler of one object at once, and a second
    replica may be finishing its last call.  Every write reads first and is conditional on what it
    read, and every AWS call is preceded by a claim (:func:`_claim_attempt`) that only one caller
    can win.
    """
    install_seal(settings)
    name = body["metadata"]["name"]
    body = kube.get_replacement(name)
    status = body.get("status") or {}
    if not ours(body, settings):
        _refuse_foreign(body)
        return
    if not status_sealed(body):
        _refuse_unsealed(body)
        return
    _export_pending(name, body)
    target = status.get("target")
    if not target or status.get("phase") in TERMINAL:
        return
    status = {**status, "target": target}
    changed = changed_fields(body.get("spec") or {}, target)
    if changed and not (status.get("replace") or {}).get("requestedAt"):
        # Once BatchReplaceClusterNodes was requested (for the recorded target), it is followed to its end.
        shown = ", ".join(f"spec.{f}={(body.get('spec') or {}).get(f)!r} (recorded {target.get(f)!r})"
                          for f in changed)
        _phase(body, Phase.FAILED, "TargetChanged", f"the target changed after creation: {shown}; nothing is replaced",
               conditions=[kube.condition("Failed", True, "TargetChanged", shown)])
        return
    if not status.get("phase"):
        status = _phase(body, Phase.HEALTH_CHECK, "Opened", f"node {target['nodeName']}, instance "
                        f"{target['instanceId']}, cluster {target['clusterName']}")
    decision, status = _decision(body, status, settings)
    if decision == Decision.DENIED:
        _deny(body, status, settings)
        return
    if status["phase"] in (Phase.HEALTH_CHECK, Phase.PENDING_APPROVAL):
        _reannounce(body, status, settings)
        status = _observe_hyperpod(body, status)
    if status["phase"] == Phase.HEALTH_CHECK:
        status = _health_check(body, status, settings)
    if status["phase"] == Phase.PENDING_APPROVAL:
        if decision is None and approval.requested(body.get("spec") or {}) == Decision.APPROVED:
            decision, status = _decision(body, status, settings)
        if decision == Decision.APPROVED:
            status = _replace(body, status, settings)
    if status["phase"] == Phase.REPLACING:
        _follow(body, status, settings)


def _decision(body: dict[str, Any], status: dict[str, Any], settings: Settings) -> tuple[str | None, dict[str, Any]]:
    """The decision to act on, and the status: only one that ``spec.decision`` holds, that admission
    attributed (``spec.decidedBy``), and that the status agrees with (recorded here on first sight).
    A decision only in the status (a ``/status`` write passes no admission) or one nobody is
    recorded for is never acted on (docs/design.md §9)."""
    name = body["metadata"]["name"]
    spec = body.get("spec") or {}
    recorded, wanted = approval.recorded(status), approval.requested(spec)
    attributed = bool(spec.get("decidedBy")) or not settings.require_admission_decisions
    if recorded is not None and recorded != wanted:
        _refuse_once(body, "DecisionMismatch", f"status.decision {recorded!r} is not spec.decision {wanted!r}: "
                     "a decision written to the status alone is not acted on")
        return None, status
    if wanted is None:
        return None, status
    if not attributed:
        _refuse_once(body, "DecisionNotAttributed", f"spec.decision {wanted} was not recorded by admission "
                     "(no spec.decidedBy): is the sdcguard NodeReplacement webhook installed?")
        return None, status
    if recorded is None:
        if wanted == Decision.APPROVED and status.get("phase") != Phase.PENDING_APPROVAL:
            return None, status  # recorded once the health check is done
        status = approval.record(name, body, wanted)
    return wanted, status


def _refuse_once(body: dict[str, Any], reason: str, message: str) -> None:
    status = body.get("status") or {}
    if any(c.get("type") == "DecisionRefused" and c.get("reason") == reason for c in status.get("conditions") or []):
        return
    metrics.REPLACEMENTS_REFUSED.labels(reason).inc()
    kube.record(names.REPLACEMENTS, None, body["metadata"]["name"], "DecisionRefused", message,
                conditions=[kube.condition("DecisionRefused", True, reason, message)])


def _refuse_foreign(body: dict[str, Any]) -> None:
    """A NodeReplacement the operator did not create: marked once, never acted on."""
    status = body.get("status") or {}
    if any(c.get("type") == "CreatedByOperator" for c in status.get("conditions") or []):
        return
    metrics.REPLACEMENTS_REFUSED.labels("NotCreatedByOperator").inc()
    message = "not created by the sdcguard operator (no valid operator seal): never acted on"
    kube.record(names.REPLACEMENTS, None, body["metadata"]["name"], unsealed=True,
                conditions=[kube.condition("CreatedByOperator", False, "NotCreatedByOperator", message)])


# The timeline events that move a NodeReplacement into PendingApproval (see _health_check).
_PENDING_EVENTS = ("HealthCheckPassed", "HealthCheckFailed", "HealthCheckSkipped", "HealthCheckNotRun")


def _export_pending(name: str, body: dict[str, Any]) -> None:
    """The pending-approval gauge, from the object itself (the timer runs this every poll)."""
    status = body.get("status") or {}
    node = (status.get("target") or {}).get("nodeName") or (body.get("spec") or {}).get("nodeName") or ""
    since = next((entry.get("time") for entry in status.get("timeline") or [] if entry.get("event") in _PENDING_EVENTS), None)
    if status.get("phase") == Phase.PENDING_APPROVAL and not approval.recorded(status) and since:
        metrics.PENDING_APPROVAL.labels(name, node).set(
            datetime.datetime.fromisoformat(since.replace("Z", "+00:00")).timestamp())
    else:
        try:
            metrics.PENDING_APPROVAL.remove(name, node)
        except KeyError:
            pass


def release(body: dict[str, Any], settings: Settings) -> None:
    """``kubectl sdcguard release NODE``: a person gives a Failed replacement's storm-guard slot back.

    The request is ``spec.release`` (who asked is recorded by admission in ``spec.releasedBy``,
    as for decisions); the node stays cordoned (its hardware is still suspect: uncordon it
    yourself once you trust it), loses the suspect label, and the slot is free for the next
    incident.  Recorded once in ``status.released`` and the timeline.
    """
    install_seal(settings)
    name = body["metadata"]["name"]
    body = kube.get_replacement(name)
    spec, status = body.get("spec") or {}, body.get("status") or {}
    if not spec.get("release") or status.get("released") or status.get("phase") != Phase.FAILED \
            or not ours(body, settings) or (settings.require_admission_decisions and not spec.get("releasedBy")):
        return
    if not status_sealed(body):  # a Failed the operator did not write: the slot stays where it is
        _refuse_unsealed(body)
        return
    node = (status.get("target") or {}).get("nodeName") or spec.get("nodeName")
    by = spec.get("releasedBy") or approval.UNATTRIBUTED
    reason = spec.get("releaseReason") or ""
    message = f"{node}: storm-guard slot released by {by}" + (f": {reason}" if reason else "") + \
        "; the node stays cordoned until you uncordon it"
    contain.release(node, settings, keep_cordoned=True, why=node_condition.RELEASED,
                    text=f"{message} (NodeReplacement {name})")
    kube.record(names.REPLACEMENTS, None, name, "Released", message,
                released={"by": by, "groups": list(spec.get("releasedByGroups") or []), "reason": reason,
                          "time": kube.now()})
    metrics.RELEASES.inc()


def _phase(body: dict[str, Any], phase: str, event: str, message: str, **fields: Any) -> dict[str, Any]:
    """Move to ``phase`` once: if a concurrent handler got there first, nothing is written twice."""
    name = body["metadata"]["name"]
    moved: list[bool] = []

    def only_if(current: dict[str, Any]) -> bool:
        moved[:] = [current.get("phase") != phase and current.get("phase") not in TERMINAL]
        return moved[0]
    status = kube.record(names.REPLACEMENTS, None, name, event, message, only_if=only_if, phase=phase,
                         **fields).get("status") or {}
    if moved and moved[0]:
        metrics.REPLACEMENTS.labels(phase).inc()
    _export_pending(name, {**body, "status": status})  # a terminal phase gets no more timer ticks to do it
    return status  # the incidents read the new phase themselves (incident.follow)


def _note(body: dict[str, Any], event: str | None, message: str, **fields: Any) -> dict[str, Any]:
    return kube.record(names.REPLACEMENTS, None, body["metadata"]["name"], event, message, **fields).get("status") or {}


def _outcome(body: dict[str, Any], key: str, event: str, message: str, **fields: Any) -> dict[str, Any]:
    """Write that an AWS call took effect (``<key>.requestedAt``), once, retried at once on a
    transient API error. Why not leave it to kopf's retry: a lost outcome sends the next try to
    DescribeClusterNode, and a deep health check that has ended by then reads ``Running``, exactly
    like one that never started, so it would be started a second time (seen in the chaos soak: an
    API 500 right after the only describe that showed the check in progress). What remains is a
    crash between that answer and this write, with a check shorter than the fail-over."""
    name = body["metadata"]["name"]
    for left in reversed(range(OUTCOME_WRITES)):
        try:
            return kube.record(names.REPLACEMENTS, None, name, event, message,
                               only_if=lambda current: not (current.get(key) or {}).get("requestedAt"),
                               **fields).get("status") or {}
        except Exception as exc:  # noqa: BLE001 - only the API's transient answers are retried
            if left == 0 or not kube.transient(exc):
                raise
    raise AssertionError("unreachable")


def _deny(body: dict[str, Any], status: dict[str, Any], settings: Settings) -> None:
    node = status["target"]["nodeName"]
    if (status.get("replace") or {}).get("requestedAt") or (status.get("replace") or {}).get("attemptedAt"):
        if not any(e.get("event") == "DenyTooLate" for e in status.get("timeline") or []):
            _note(body, "DenyTooLate", "BatchReplaceClusterNodes was already requested; the denial cannot undo it")
        return
    holder = contain.slot_holder(node, settings)
    incidents = list((body.get("spec") or {}).get("incidents") or [])
    decided = status.get("decision") or {}
    why = f"denied by {decided.get('by') or 'unknown'}" + (f": {decided['reason']}" if decided.get("reason") else "") \
        + f" (NodeReplacement {body['metadata']['name']})"
    if holder is None or holder not in incidents:
        # sdcguard did not cordon this node for any incident this replacement serves (an admin's
        # cordon, or another incident's slot): the denial changes nothing on it. Without any slot,
        # a condition still True for one of its incidents is stale (given back by an earlier
        # version that released before clearing, or by hand): it is cleared.
        if holder is None:
            try:
                node_condition.clear(node, node_condition.DENIED, why, incidents=incidents)
            except Exception as exc:  # noqa: BLE001 - retried: Denied is terminal, no later pass would
                raise kopf.TemporaryError(f"node {node}: condition not cleared: {exc}",
                                          delay=settings.retry_seconds) from None
        _phase(body, Phase.DENIED, "Denied", f"{node} left as it is: sdcguard holds no storm-guard slot for it on "
               f"behalf of this replacement's incidents (slot: {holder or 'none'})")
        return
    released = contain.release(node, settings, why=node_condition.DENIED, text=why)  # condition first, then the slot
    _phase(body, Phase.DENIED, "Denied",
           f"{node} uncordoned and unlabelled" if released else f"{node} no longer exists")


def _attempt(status: dict[str, Any], key: str, settings: Settings) -> str:
    """Where the last attempt of an AWS action stands: "none" (never tried), "in-flight" (this
    process is making it now, in another handler), or "unknown" (made by a process that is gone, or
    that failed transiently: ask DescribeClusterNode whether it took effect before trying again)."""
    state = status.get(key) or {}
    if not state.get("attemptedAt"):
        return "none"
    if state.get("attemptedBy") == kube.identity() and _age(state["attemptedAt"]) < settings.aws_call_seconds:
        return "in-flight"
    return "unknown"


def _age(stamp: str) -> float:
    then = datetime.datetime.fromisoformat(stamp.replace("Z", "+00:00"))
    return (datetime.datetime.now(datetime.timezone.utc) - then).total_seconds()


def _claim_attempt(body: dict[str, Any], key: str, seen: dict[str, Any]) -> None:
    """Write the intent of a new attempt, conditional on the object being as last seen: of two
    callers only one wins; the other gets a TemporaryError and reads again.  The attempt count is
    compared too: timestamps have whole seconds, so two attempts within one second look alike."""
    previous = seen.get("attemptedAt")
    attempts = int(seen.get("attempts", 0)) + 1
    claimed = kube.claim(names.REPLACEMENTS, None, body["metadata"]["name"],
                         lambda st: (st.get(key) or {}).get("attemptedAt") == previous
                         and int((st.get(key) or {}).get("attempts", 0)) == attempts - 1
                         and not (st.get(key) or {}).get("requestedAt"),
                         {key: {"attemptedAt": kube.now(), "attemptedBy": kube.identity(), "attempts": attempts}})
    if claimed is None:
        raise kopf.TemporaryError(f"{key}: the NodeReplacement changed meanwhile; reading it again", delay=0.5)


def _transient(body: dict[str, Any], status: dict[str, Any], key: str, exc: hyperpod.Transient,
               settings: Settings) -> None:
    """A transient failure (throttled, or SageMaker unavailable: 5xx, InternalServerError, a
    timeout): the attempt is no longer in flight, but may have taken effect; the next try asks
    DescribeClusterNode first. Each kind is counted against its own budget."""
    state = status.get(key) or {}
    attempts = int(state.get("attempts", 0)) + 1
    kind, budget = (("throttled", settings.max_throttle_retries) if isinstance(exc, hyperpod.Throttled)
                    else ("unavailable", settings.max_unavailable_retries))
    count = int(state.get(kind, 0)) + 1
    delay = settings.backoff(attempts)
    _note(body, kind.capitalize(), f"{exc}; {kind} {count}/{budget + 1}, checking "
          f"DescribeClusterNode before retrying in {delay:g}s",
          **{key: {"attemptedBy": None, "lastError": exc.code, kind: count}})
    raise kopf.TemporaryError(str(exc), delay=delay)


def _gave_up(body: dict[str, Any], status: dict[str, Any], key: str, operation: str, settings: Settings) -> bool:
    state = status.get(key) or {}
    if int(state.get("throttled", 0)) <= settings.max_throttle_retries and \
            int(state.get("unavailable", 0)) <= settings.max_unavailable_retries:
        return False
    error = state.get("lastError") or "Unknown"
    _phase(body, Phase.FAILED, "GaveUp", f"{operation} still failing after {state.get('attempts')} attempts "
           f"(last: {error}); DescribeClusterNode shows none took effect",
           conditions=[kube.condition("Failed", True, str(error), f"{operation} gave up")])
    return True


def _health_check(body: dict[str, Any], status: dict[str, Any], settings: Settings) -> dict[str, Any]:
    spec = status["target"]
    check = status.get("healthCheck") or {}
    if not settings.deep_health_checks:
        return _phase(body, Phase.PENDING_APPROVAL, "HealthCheckSkipped", "no deep health check configured",
                      healthCheck={"result": "Skipped"})
    if not spec.get("instanceGroup"):
        return _phase(body, Phase.PENDING_APPROVAL, "HealthCheckSkipped", "instance group unknown",
                      healthCheck={"result": "NotRun", "message": "instance group unknown"})
    if not check.get("requestedAt"):
        where = _attempt(status, "healthCheck", settings)
        if where == "in-flight":
            raise kopf.TemporaryError("StartClusterHealthCheck in flight", delay=settings.retry_seconds)
        if where == "unknown":
            state = _describe_status(status, settings)
            if state in ("DeepHealthCheckInProgress", "Failure"):
                return _outcome(body, "healthCheck", "HealthCheckRequested", f"the earlier attempt took effect ({state})",
                                healthCheck={"requestedAt": check["attemptedAt"], "attemptedBy": None,
                                             "sawInProgress": state == "DeepHealthCheckInProgress"})
            if _gave_up(body, status, "healthCheck", "StartClusterHealthCheck", settings):
                return {**status, "phase": Phase.FAILED}
        _claim_attempt(body, "healthCheck", check)  # intent, before the call
        try:
            hyperpod.start_health_check(settings, spec["clusterName"], spec["instanceGroup"], spec["instanceId"])
        except hyperpod.Transient as exc:
            _transient(body, status, "healthCheck", exc, settings)
        except hyperpod.AwsError as exc:
            return _phase(body, Phase.PENDING_APPROVAL, "HealthCheckNotRun", str(exc),
                          healthCheck={"result": "NotRun", "message": str(exc), "attemptedBy": None})
        return _outcome(body, "healthCheck", "HealthCheckRequested",
                        f"StartClusterHealthCheck {list(settings.deep_health_checks)} "
                        f"on {spec['instanceId']} (group {spec['instanceGroup']})",
                        healthCheck={"requestedAt": kube.now(), "attemptedBy": None,
                                     "checks": list(settings.deep_health_checks)})
    try:
        details = hyperpod.describe_node(settings, spec["clusterName"], spec["instanceId"])
    except hyperpod.Transient as exc:
        raise kopf.TemporaryError(str(exc), delay=settings.retry_seconds) from None
    state = details.get("InstanceStatus") or {}
    polls = int(check.get("polls", 0)) + 1
    if state.get("Status") == "DeepHealthCheckInProgress":
        return _note(body, None, "", healthCheck={"sawInProgress": True, "polls": polls})
    if state.get("Status") == "Failure":
        return _phase(body, Phase.PENDING_APPROVAL, "HealthCheckFailed",
                      f"deep health check failed: {state.get('Message')}",
                      healthCheck={"result": "Failed", "message": state.get("Message"), "polls": polls},
                      conditions=[kube.condition("HealthCheckPassed", False, "Failed", str(state.get("Message")))])
    if state.get("Status") == "Running" and (check.get("sawInProgress") or polls >= 3):
        return _phase(body, Phase.PENDING_APPROVAL, "HealthCheckPassed",
                      "deep health check passed (SDC can still escape it: decide on the incident's evidence)",
                      healthCheck={"result": "Passed", "message": state.get("Message"), "polls": polls},
                      conditions=[kube.condition("HealthCheckPassed", True, "Passed", "deep health check passed")])
    return _note(body, None, "", healthCheck={"polls": polls})


def _reannounce(body: dict[str, Any], status: dict[str, Any], settings: Settings) -> None:
    """The node condition, set again while the replacement waits if the cordon's write was lost
    (:func:`contain.reannounce`, for the incidents this replacement serves)."""
    node = status["target"]["nodeName"]
    try:
        contain.reannounce(node, (body.get("spec") or {}).get("incidents") or [], settings)
    except Exception as exc:  # noqa: BLE001 - best effort, as the first write was
        node_condition.log.warning("node %s: condition not checked: %s", node, exc)


def _observe_hyperpod(body: dict[str, Any], status: dict[str, Any]) -> dict[str, Any]:
    """Record, once per change, whether HyperPod's own resiliency acts on the node (label
    ``sagemaker.amazonaws.com/node-health-status`` ``UnschedulablePendingReplacement`` /
    ``...PendingReboot``): the approver sees it, and :func:`_replace` asks for no second replacement."""
    node = status["target"]["nodeName"]
    try:
        labels = kube.core().read_node(node).metadata.labels or {}
    except Exception as exc:
        if not kube.not_found(exc):
            raise
        labels = {}
    mark, seen = hyperpod.pending_mark(labels), (status.get("hyperPod") or {}).get("nodeHealthStatus")
    if mark == seen or (mark is None and seen not in names.HYPERPOD_PENDING_HEALTH):
        return status
    value = mark or labels.get(names.HYPERPOD_HEALTH_LABEL) or "unset"
    if mark:
        text = f"HyperPod marks {node} {mark}: sdcguard asks for no replacement of its own while HyperPod acts"
    else:
        text = f"HyperPod no longer marks {node} pending ({seen} over; {names.HYPERPOD_HEALTH_LABEL}={value})"
    return _note(body, "HyperPodActing" if mark else "HyperPodDone", text,
                 hyperPod={"nodeHealthStatus": value, "seenAt": kube.now()},
                 conditions=[kube.condition("HyperPodActing", bool(mark), mark or "Done", text)])


def _describe_status(status: dict[str, Any], settings: Settings) -> str:
    spec = status["target"]
    try:
        return (hyperpod.describe_node(settings, spec["clusterName"], spec["instanceId"]).get("InstanceStatus")
                or {}).get("Status", "")
    except hyperpod.NodeNotFound:
        return "NotFound"
    except hyperpod.Transient as exc:
        raise kopf.TemporaryError(str(exc), delay=settings.retry_seconds) from None


def _replace(body: dict[str, Any], status: dict[str, Any], settings: Settings) -> dict[str, Any]:
    """BatchReplaceClusterNodes at most once: claim, call, outcome.  A transient error or a restart
    asks DescribeClusterNode before calling again; a retry is made only if it shows that the
    earlier attempt did not take effect."""
    spec = status["target"]
    replace = status.get("replace") or {}
    if replace.get("requestedAt"):
        return _phase(body, Phase.REPLACING, "ReplaceRequested", "resuming the follow-up")
    where = _attempt(status, "replace", settings)
    mark = (status.get("hyperPod") or {}).get("nodeHealthStatus")
    if where == "none" and mark == hyperpod.PENDING_REPLACEMENT:
        return _phase(body, Phase.REPLACING, "HyperPodReplacing",
                      f"HyperPod already marked {spec['nodeName']} {mark}: its own replacement is followed, "
                      "BatchReplaceClusterNodes is not called",
                      replace={"requestedAt": kube.now(), "byHyperPod": mark, "attemptedBy": None})
    if where == "none" and mark == hyperpod.PENDING_REBOOT:
        # A reboot does not take the suspect GPU out of the cluster: the approved replacement is
        # asked for once HyperPod's reboot is over, never while it runs.
        raise kopf.TemporaryError(f"HyperPod reboots {spec['nodeName']} ({mark}); replacing after it",
                                  delay=settings.poll_seconds)
    if where == "in-flight":
        raise kopf.TemporaryError("BatchReplaceClusterNodes in flight", delay=settings.retry_seconds)
    if where == "unknown":
        if _describe_status(status, settings) in REPLACING_STATUSES:
            return _replacing(body, status, "ReplaceRequested", "the earlier attempt took effect",
                              replace={"requestedAt": replace["attemptedAt"], "recovered": True, "attemptedBy": None})
        if _gave_up(body, status, "replace", "BatchReplaceClusterNodes", settings):
            return {**status, "phase": Phase.FAILED}
    _claim_attempt(body, "replace", replace)  # intent, before the call
    try:
        ok, code, message = hyperpod.replace(settings, spec["clusterName"], spec["instanceId"])
    except hyperpod.Transient as exc:
        _transient(body, status, "replace", exc, settings)
    except hyperpod.AwsError as exc:
        ok, code, message = False, exc.code, exc.message
    if ok:
        return _replacing(body, status, "ReplaceRequested", f"BatchReplaceClusterNodes accepted {spec['instanceId']}",
                          replace={"requestedAt": kube.now(), "attemptedBy": None})
    if code in hyperpod.TRANSIENT_CODES:
        _transient(body, status, "replace", hyperpod.Unavailable("BatchReplaceClusterNodes", code, message), settings)
    if code in WAIT_CODES:
        waits = int(replace.get("waits", 0)) + 1
        _note(body, "ReplaceWaiting", f"{code}: {message}; waiting",
              replace={"waits": waits, "lastError": code, "attemptedAt": None, "attemptedBy": None, "attempts": 0},
              conditions=[kube.condition("ReplaceBlocked", True, code, message)])
        raise kopf.TemporaryError(f"{code}: {message}", delay=settings.backoff(waits))
    return _phase(body, Phase.FAILED, "ReplaceFailed", f"{code}: {message}",
                  replace={"error": code, "message": message, "attemptedBy": None},
                  conditions=[kube.condition("Failed", True, code, message)])


def _replacing(body: dict[str, Any], status: dict[str, Any], event: str, message: str, **fields: Any) -> dict[str, Any]:
    """Record that BatchReplaceClusterNodes took effect: the move to Replacing, or, for a replacement
    already Replacing (HyperPod's hand-off given back, :func:`_hyperpod_handoff`), the outcome alone."""
    if status.get("phase") != Phase.REPLACING:
        return _phase(body, Phase.REPLACING, event, message, **fields)
    return _outcome(body, "replace", event, message, **fields)


def _follow(body: dict[str, Any], status: dict[str, Any], settings: Settings) -> None:
    spec = status["target"]
    if not (status.get("replace") or {}).get("requestedAt"):
        _replace(body, status, settings)  # handed back by HyperPod: asked for until it takes effect
        return
    state = _describe_status(status, settings)
    if state == "NotFound":
        contain.release(spec["nodeName"], settings, keep_cordoned=True, why=node_condition.REPLACED,
                        text=f"instance {spec['instanceId']} replaced (NodeReplacement {body['metadata']['name']})")
        _phase(body, Phase.REPLACED, "Replaced",
               f"instance {spec['instanceId']} terminated and replaced by fresh hardware",
               replace={"completedAt": kube.now()},
               conditions=[kube.condition("Replaced", True, "Replaced", "instance replaced")])
    elif state == "Failure":
        _phase(body, Phase.FAILED, "ReplaceFailed", "the instance went to Failure during replacement",
               conditions=[kube.condition("Failed", True, "InstanceFailure", "instance status Failure")])
    elif state == "Running" and (status.get("replace") or {}).get("byHyperPod"):
        _hyperpod_handoff(body, status, settings)


def _hyperpod_handoff(body: dict[str, Any], status: dict[str, Any], settings: Settings) -> None:
    """A replacement left to HyperPod (``replace.byHyperPod``) whose instance still runs: while
    HyperPod's mark is on the node it is waited for; once the mark is gone and the instance runs,
    HyperPod did not replace it (its own check cleared the node, or it gave up) and nothing else
    would: the approval stands, so BatchReplaceClusterNodes is asked for as for any approved
    replacement (an instance HyperPod is still busy with answers InstanceIdInUse or
    InvalidInstanceStatus, which is waited for)."""
    node = status["target"]["nodeName"]
    try:
        labels = kube.core().read_node(node).metadata.labels or {}
    except Exception as exc:
        if kube.not_found(exc):
            return  # the node left the cluster: HyperPod is replacing it (DescribeClusterNode follows it)
        raise
    if hyperpod.pending_mark(labels):
        return
    value = labels.get(names.HYPERPOD_HEALTH_LABEL) or "unset"
    text = (f"HyperPod no longer marks {node} pending ({names.HYPERPOD_HEALTH_LABEL}={value}) and instance "
            f"{status['target']['instanceId']} still runs: HyperPod did not replace it; asking for the approved "
            "replacement with BatchReplaceClusterNodes")
    status = _note(body, "HyperPodDone", text, replace={"requestedAt": None, "byHyperPod": None},
                   hyperPod={"nodeHealthStatus": value, "seenAt": kube.now()},
                   conditions=[kube.condition("HyperPodActing", False, "Done", text)])
    _replace(body, status, settings)
