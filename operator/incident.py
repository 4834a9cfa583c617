"""SDCIncident: one per fault (job, check, step), and its containment flow (docs/design.md §6.3-6.4, 6.8).

Duplicate alarms of one fault (every rank reporting it, a resent Event) map to the same name, so
the API server's create conflict is what joins them: no in-memory dedup to lose on restart.

The spec is the validated alarm; the status opens with the recovery plan taken from it
(:func:`recovery`): the checkpoint to resume from and its step, the suspect window, and how many
steps are at risk (redone after resuming). Records from older libraries lack some of these
fields; they are then left out of the status (a merge patch drops nulls), never guessed.
"""
from __future__ import annotations

import hashlib
import logging
import re
from typing import Any

import kopf

from sdcguard.contract import names

from sdcguard.contract import alarm as alarm_schema
from sdcguard.contract.phases import IncidentPhase

from . import contain, cost, hyperpod, inventory, kube, localize, master_key, metrics, offenders, replacement
from .approval import TERMINAL
from .settings import Settings


def incident_name(record: dict[str, Any]) -> str:
    """DNS-1123 name from (job, check, step); long job names keep a hash so names stay unique."""
    raw = f"{record['job']['name']}-{record['check']}-{record['step']}".lower()
    name = re.sub(r"[^a-z0-9-]+", "-", raw).strip("-")
    if len(name) > 63:
        digest = hashlib.sha256(raw.encode()).hexdigest()[:8]
        name = f"{name[:54].rstrip('-')}-{digest}"
    return name


def find(namespace: str, name: str) -> dict[str, Any] | None:
    try:
        return kube.get_incident(namespace, name)
    except Exception as exc:
        if kube.not_found(exc):
            return None
        raise


def seal(settings: Settings, namespace: str, name: str, spec: dict[str, Any]) -> str:
    """The operator's mark on an incident it created: over its name and the signed alarm it holds."""
    text = spec.get("alarmText") or ""
    return master_key.seal(settings, "SDCIncident", namespace, name, str(spec.get("jobUid") or ""),
                           hashlib.sha256(text.encode()).hexdigest(), str(spec.get("alarmSignature") or ""))


def manifest(record: dict[str, Any], event_name: str, *, text: str = "", signature: str | None = None,
             job_uid: str = "", settings: Settings | None = None) -> dict[str, Any]:
    job = record["job"]
    typed = alarm_schema.Alarm.parse(record)  # every optional field checked: typed, or None when absent
    window = record.get("suspect_window") or {"first_step": record["step"], "last_step": record["step"]}
    spec = {
        "job": dict(job), "check": record["check"], "step": record["step"], "ambiguous": record["ambiguous"],
        "suspects": [dict(s) for s in record["suspects"]], "reporter": dict(record["reporter"]),
        "suspectWindow": {"firstStep": window.get("first_step"), "lastStep": window.get("last_step")},
        "lastVerifiedStep": record["last_verified_step"], "lastGoodCheckpoint": record["last_good_checkpoint"],
        "lastGoodCheckpointSha256": typed.last_good_checkpoint_sha256,
        "lastGoodCheckpointStep": typed.last_good_checkpoint_step,
        "drill": typed.drill,
        "alarmId": record["id"], "event": event_name, "alarm": record,
        "jobUid": job_uid, "alarmText": text, "alarmSignature": signature,
    }
    spec = {k: v for k, v in spec.items() if v is not None}
    body = {"apiVersion": names.API_VERSION, "kind": "SDCIncident",
            "metadata": {"name": incident_name(record), "namespace": job["namespace"],
                         "labels": {names.INCIDENT_JOB_LABEL: job["name"][:63]}},
            "spec": spec}
    if settings is not None:
        body["metadata"]["annotations"] = {names.SEAL_ANNOTATION: seal(settings, job["namespace"],
                                                                       body["metadata"]["name"], spec)}
    return body


class NotVerified(Exception):
    """An incident the operator does not act on; ``reason`` is a CamelCase word."""

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(f"{reason}: {message}")
        self.reason, self.message = reason, message


def verify(body: dict[str, Any], settings: Settings) -> dict[str, Any]:
    """An incident counts only if the operator created it (its seal) from a signed alarm that still
    verifies, and its spec says what that alarm says (docs/design.md §9); returns the alarm record."""
    from . import signature_check, validate  # signature_check imports validate, which must not import this module
    meta, spec = body["metadata"], body.get("spec") or {}
    namespace, name = meta["namespace"], meta["name"]
    if (spec.get("job") or {}).get("namespace") != namespace:
        raise NotVerified("NamespaceMismatch", f"spec.job.namespace {(spec.get('job') or {}).get('namespace')!r} "
                          f"is not the incident's own namespace {namespace!r}")
    if not master_key.sealed(settings, (meta.get("annotations") or {}).get(names.SEAL_ANNOTATION), "SDCIncident",
                             namespace, name, str(spec.get("jobUid") or ""),
                             hashlib.sha256((spec.get("alarmText") or "").encode()).hexdigest(),
                             str(spec.get("alarmSignature") or "")):
        raise NotVerified("NotCreatedByOperator", "the incident carries no valid operator seal: sdcguard did not "
                          "create it from a signed alarm (or its alarm was edited)")
    try:
        record = alarm_schema.loads(spec["alarmText"])
    except (KeyError, alarm_schema.AlarmError) as exc:
        raise NotVerified("MalformedAlarm", str(exc)) from None
    if spec.get("alarmSignature"):
        try:
            signature_check.verify(record, spec["alarmText"], spec["alarmSignature"], spec["jobUid"], settings)
        except validate.Rejected as exc:
            raise NotVerified(exc.reason, exc.message) from None
    elif settings.require_signed_alarms:
        raise NotVerified("UnsignedAlarm", "the incident's alarm is unsigned (SDCGUARD_REQUIRE_SIGNED_ALARMS is true)")
    expected = manifest(record, spec.get("event") or "", text=spec["alarmText"], signature=spec.get("alarmSignature"),
                        job_uid=spec.get("jobUid") or "")
    if expected["metadata"]["name"] != name or expected["metadata"]["namespace"] != namespace:
        raise NotVerified("NameMismatch", f"the alarm belongs in {expected['metadata']['namespace']}/"
                          f"{expected['metadata']['name']}, not {namespace}/{name}")
    changed = [k for k in ("job", "check", "step", "suspects", "reporter") if spec.get(k) != expected["spec"].get(k)]
    if changed:
        raise NotVerified("SpecChanged", f"spec.{', spec.'.join(changed)} differ from the signed alarm")
    return record


def _verify_suspect(spec: dict[str, Any], status: dict[str, Any], node: str, settings: Settings) -> str | None:
    """Why a suspect node may not be cordoned now, or None: at every reconcile the node must still run
    the job's pod the alarm named (same pod uid and owner uid), unless that pod is gone because
    sdcguard suspended the job."""
    from . import validate
    job = spec["job"]
    at = alarm_schema.rfc3339_seconds(spec["alarm"]["time"]) if isinstance(spec.get("alarm"), dict) else 0.0
    for identity in [s for s in spec["suspects"] if s.get("node") == node]:
        try:
            pod = kube.core().read_namespaced_pod(identity["pod"], job["namespace"])
        except Exception as exc:
            if not kube.not_found(exc):
                raise
            if kube.is_true(status, "JobSuspended"):
                continue  # the training operator deletes a suspended job's pods
            return f"pod {identity['pod']} no longer exists"
        try:
            validate.check_pod(pod, identity, job, spec["jobUid"], at, settings)
        except validate.Rejected as exc:
            return f"{exc.reason}: {exc.message}"
    return None


def recovery(spec: dict[str, Any]) -> dict[str, Any]:
    """The recovery plan of an incident, as status fields, from its spec (the alarm)."""
    alarm = spec.get("alarm") or {}
    window = spec.get("suspectWindow") or {}
    first, last = _step(window.get("firstStep")), _step(window.get("lastStep"))
    resume_step = _step(alarm.get("last_good_checkpoint_step"))
    # The library counts the steps at risk (``steps_at_risk``: the alarm step minus the resume
    # step, the whole run when no checkpoint is trusted) and the operator takes that number as it
    # is. Only a record of an older library lacks it: then, and only then, it is derived here from
    # the checkpoint step the record names (unknown, never guessed, when it names none).
    at_risk = _step(alarm.get("steps_at_risk"))
    if at_risk is None and resume_step is not None:
        at_risk = spec["step"] - resume_step
    return {
        "resumeFrom": spec.get("lastGoodCheckpoint"),
        "resumeFromStep": resume_step,
        "resumeFromSha256": spec.get("lastGoodCheckpointSha256"),
        "suspectWindow": {"firstStep": first, "lastStep": last, "range": window_range(first, last)},
        "stepsAtRisk": at_risk,
        "lastAuditedStep": _step(alarm.get("last_audited_step")),
        "lastWeightsVerifiedStep": _step(alarm.get("last_weights_verified_step")),
    }


def window_range(first: int | None, last: int | None) -> str:
    """``first-last`` as ``kubectl get`` shows it (``?`` for an unknown end)."""
    return f"{'?' if first is None else first}-{'?' if last is None else last}"


def resume_text(status: dict[str, Any]) -> str:
    """Where to resume, for messages: ``ckpt.pt (step 19)``, or that there is no verified checkpoint."""
    path, step = status.get("resumeFrom"), status.get("resumeFromStep")
    if not path:
        return "no verified checkpoint"
    return f"{path} (step {step})" if step is not None else str(path)


def _step(value: Any) -> int | None:
    """An optional step of the alarm record: an integer, else None (the CRD schema wants integers)."""
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def open_or_join(record: dict[str, Any], event_name: str, text: str, signature: str | None, job_uid: str,
                 settings: Settings) -> tuple[str, bool]:
    """Create the incident (sealed), or join the existing one; (name, created).

    A 409 to the create means "it exists" only when the incident is there to read: an overloaded
    API server also answers 409 to a create it did not do, and that alarm must still open its
    incident (read as "exists", it became a 404 on the join and the valid alarm a rejection)."""
    body = manifest(record, event_name, text=text, signature=signature, job_uid=job_uid, settings=settings)
    namespace, name = body["metadata"]["namespace"], body["metadata"]["name"]
    for attempt in range(kube.CREATE_TRIES):
        if attempt:
            kube.pause_before_retry(attempt)
        try:
            kube.custom().create_namespaced_custom_object(names.GROUP, names.VERSION, namespace, names.INCIDENTS,
                                                          body)
        except Exception as exc:
            if not kube.conflict(exc):
                raise
            found = find(namespace, name)
            if found is None:
                continue  # nothing there: the 409 was not "AlreadyExists"; create again
            if (found.get("spec") or {}).get("event") == event_name:
                return name, True  # this Event's own create (a 409 answered to a write that landed)
            join(namespace, name, record["id"], event_name)
            return name, False
        metrics.INCIDENTS.labels(record["check"]).inc()
        return name, True
    raise kopf.TemporaryError(f"{names.INCIDENTS}/{name}: create answered 409 {kube.CREATE_TRIES} times "
                              "and nothing is there", delay=1)


def join(namespace: str, name: str, alarm_id: str, event_name: str) -> None:
    """Record a duplicate alarm once (idempotent: the same Event seen again changes nothing)."""
    def change(status: dict[str, Any]) -> dict[str, Any]:
        duplicates = list(status.get("duplicates") or [])
        if any(d.get("event") == event_name for d in duplicates):
            return {}
        duplicates.append({"alarmId": alarm_id, "event": event_name, "time": kube.now()})
        timeline = list(status.get("timeline") or []) + [{
            "time": kube.now(), "event": "DuplicateAlarm", "message": f"alarm {alarm_id} (Event {event_name}) joined"}]
        return {"duplicates": duplicates, "alarmCount": len(duplicates) + 1, "timeline": timeline}
    kube.update_status(names.INCIDENTS, namespace, name, change)


def reconcile(body: dict[str, Any], settings: Settings) -> None:
    """Contain an incident: suspend, cordon (storm guard), localize, open NodeReplacements.

    Idempotent: every step checks the status (and the cluster) first, so on.create, on.resume and
    retries can all call it.  Raises kopf.TemporaryError while the storm guard holds a node back.
    """
    namespace, name = body["metadata"]["namespace"], body["metadata"]["name"]
    ref = f"{namespace}/{name}"
    replacement.install_seal(settings)
    body = kube.get_incident(namespace, name)
    spec = body["spec"]
    status = body.get("status") or {}
    try:
        verify(body, settings)
    except NotVerified as exc:
        metrics.INCIDENTS_REFUSED.labels(exc.reason).inc()
        _record(namespace, name, "NotVerified", f"not acted on: {exc.message}", only_if=_no_condition("Verified"),
                conditions=[kube.condition("Verified", False, exc.reason, exc.message)])
        return
    if not status.get("phase"):
        status = _open(namespace, name, spec)
    status = _suspend(namespace, name, spec, status, settings)
    held = _cordon_all(namespace, name, ref, spec, status, settings)
    status = kube.get_incident(namespace, name).get("status") or {}
    _open_replacements(namespace, name, ref, spec, status, settings)
    if held:
        limits = {"MaxConcurrentSuspectNodes": f"{settings.max_concurrent_suspect_nodes} suspect nodes already "
                  "cordoned (maxConcurrentSuspectNodes)",
                  "MaxSuspectNodesPerNamespace": f"namespace {namespace} already holds "
                  f"{settings.max_suspect_nodes_per_namespace} suspect nodes (maxSuspectNodesPerNamespace)",
                  "MaxSuspectNodesPerJob": f"job {spec['job']['name']} already holds "
                  f"{settings.max_suspect_nodes_per_job} suspect nodes (maxSuspectNodesPerJob)"}
        reason = held[0][1]
        held = [node for node, _ in held]
        if not kube.is_true(status, "StormGuard"):
            _record(namespace, name, "StormGuard", f"{held} not cordoned: {limits[reason]}",
                    only_if=lambda st: not kube.is_true(st, "StormGuard"),
                    conditions=[kube.condition("StormGuard", True, reason, f"held back: {', '.join(held)}")])
        raise kopf.TemporaryError(f"storm guard holds {held}", delay=settings.storm_guard_recheck_seconds)
    if "repeatOffenders" not in status:  # after containment, once no node is held back: it counts held slots
        _judge_history(namespace, name, ref, spec, settings)
    status = kube.get_incident(namespace, name).get("status") or {}
    if kube.is_true(status, "StormGuard"):
        _record(namespace, name, "StormGuardReleased", "every suspect node is now cordoned",
                only_if=lambda st: kube.is_true(st, "StormGuard"),
                conditions=[kube.condition("StormGuard", False, "SlotFree", "all suspect nodes cordoned")])
    if status.get("phase") == IncidentPhase.CONTAINING:
        waiting = bool(status.get("replacements"))
        _record(namespace, name, "Contained",
                "awaiting approval of node replacement" if waiting else "contained; no node to replace",
                phase=IncidentPhase.AWAITING_APPROVAL if waiting else IncidentPhase.CONTAINED,
                only_if=lambda st: st.get("phase") == IncidentPhase.CONTAINING,
                conditions=[kube.condition("Contained", True, "Contained", "job and suspect nodes contained")])
    sync(ref)


def sync(ref: str) -> None:
    """Re-read the incident's NodeReplacements (a watch event missed while the operator was down is
    made up for here)."""
    for replacement_name in (kube.get_incident(*ref.split("/", 1)).get("status") or {}).get("replacements") or {}:
        try:
            body = kube.get_replacement(replacement_name)
        except Exception as exc:
            if kube.not_found(exc):
                continue
            raise
        follow(ref, body)


def replacement_changed(body: dict[str, Any]) -> None:
    """A NodeReplacement changed: each incident it serves reads its phase (the replacement never
    writes an incident; the incident owns its own status)."""
    for ref in (body.get("spec") or {}).get("incidents") or []:
        if "/" in ref:
            follow(ref, body)


def follow(ref: str, replacement_body: dict[str, Any]) -> None:
    """Take a NodeReplacement's current phase into the incident ``ref``: its timeline entry
    (``Replacement<event>``), and the incident's resolution when every replacement is done."""
    status = replacement_body.get("status") or {}
    phase = status.get("phase")
    if not phase:
        return
    if not replacement.status_sealed(replacement_body):
        return  # a phase (and message) the operator did not write: never taken into an incident
    name = replacement_body["metadata"]["name"]
    entry = next((e for e in reversed(status.get("timeline") or []) if e.get("phase") == phase), None)
    event, message = (f"Replacement{entry['event']}", f"{name}: {entry.get('message', '')}") if entry else ("", "")
    note(ref, event, message, name, phase, denied_healthy=cost.denied_after_passed_check(status))


def _open(namespace: str, name: str, spec: dict[str, Any]) -> dict[str, Any]:
    """First record, with the recovery plan; duplicates may have joined already (their count is kept)."""
    plan = recovery(spec)
    taken = inventory.take(spec)  # before the job is suspended: its pods go then
    at_risk = f", {plan['stepsAtRisk']} steps at risk" if plan["stepsAtRisk"] is not None else ""
    message = (f"{'drill ' if spec.get('drill') else ''}{spec['check']} alarm at step {spec['step']} naming "
               f"{', '.join(str(s['node']) for s in spec['suspects']) or 'no rank'}; resume from "
               f"{resume_text(plan)}{at_risk}")

    waste = cost.rollback(plan["stepsAtRisk"], spec.get("alarm") or {})  # status.cost, what it knows
    opened: list[bool] = []

    def change(status: dict[str, Any]) -> dict[str, Any]:
        opened[:] = [not status.get("phase")]
        if status.get("phase"):
            return {}  # opened meanwhile (a retry whose first write landed)
        return {"phase": IncidentPhase.CONTAINING, **plan, "inventory": taken, **({"cost": waste} if waste else {}),
                "alarmCount": 1 + len(status.get("duplicates") or []),
                "timeline": [{"time": kube.now(), "event": "Opened", "message": message}]
                + list(status.get("timeline") or [])}
    status = kube.update_status(names.INCIDENTS, namespace, name, change).get("status") or {}
    if opened and opened[0] and "rollbackGpuSeconds" in waste:  # counted once: by the write that opened it
        metrics.ROLLBACK_GPU_SECONDS.labels(spec["check"]).inc(waste["rollbackGpuSeconds"])
    return status


def needs_history(status: dict[str, Any], **_: Any) -> bool:
    """Whether an incident's hardware is still to be judged (:func:`judge`, its own kopf timer): one
    the operator acted on (past Containing, not yet Resolved) without ``status.repeatOffenders``
    (the judgement failed, or an older operator opened it). Never the whole containment path again."""
    if any(c.get("type") == "Verified" and c.get("status") == "False" for c in status.get("conditions") or []):
        return False
    return "repeatOffenders" not in status and status.get("phase") in (IncidentPhase.AWAITING_APPROVAL,
                                                                     IncidentPhase.CONTAINED)


def _verified_again(body: dict[str, Any], settings: Settings) -> dict[str, Any] | None:
    """The incident read afresh, if the operator created it (its seal checked: the phase or field
    that selected it for a timer is unsealed status); None otherwise (containment marks it)."""
    fresh = kube.get_incident(body["metadata"]["namespace"], body["metadata"]["name"])
    try:
        verify(fresh, settings)
    except NotVerified:
        return None
    return fresh


def judge(body: dict[str, Any], settings: Settings) -> None:
    """Judge a contained incident's hardware (:func:`needs_history`): only one the operator created
    (its seal checked: the phase that selected it is unsealed status)."""
    namespace, name = body["metadata"]["namespace"], body["metadata"]["name"]
    body = _verified_again(body, settings)
    if body is not None and "repeatOffenders" not in (body.get("status") or {}):
        _judge_history(namespace, name, f"{namespace}/{name}", body["spec"], settings)


def _judge_history(namespace: str, name: str, ref: str, spec: dict[str, Any], settings: Settings) -> dict[str, Any]:
    """Layer 7: add this incident's hardware to the operator's record (:mod:`.offenders`); each
    instance or GPU with another incident of another job within the window is a repeat offender:
    recorded here (``status.repeatOffenders``, condition ``RepeatOffender``) and on its node (label,
    annotation). A failure is logged and left to the history timer (:func:`needs_history`): never
    containment's."""
    try:
        found = offenders.record(ref, spec, settings)
    except Exception as exc:  # noqa: BLE001 - evidence; the history timer tries again
        logging.getLogger("sdcguard_operator.incident").warning(f"{ref}: repeat-offender record not updated: {exc}")
        return {}
    if not found:
        return _record(namespace, name, None, "", repeatOffenders=[], only_if=lambda st: "repeatOffenders" not in st)
    text = "; ".join(offenders.describe(o, settings) for o in found)
    try:  # the nodes first: recorded, the finding is never judged again, so a label missed would stay missed
        offenders.flag_nodes(found, settings)
    except Exception as exc:  # noqa: BLE001 - the incident holds the finding; the node's mark is a courtesy
        logging.getLogger("sdcguard_operator.incident").warning(f"{ref}: repeat offenders' nodes not labelled: {exc}")
        if kube.transient(exc):
            return {}  # the history timer tries again (the record above is idempotent)
    return _record(namespace, name, "RepeatOffender", text[:4000], repeatOffenders=found,
                   only_if=lambda st: "repeatOffenders" not in st,
                   conditions=[kube.condition("RepeatOffender", True, "RepeatedAlarms", text[:1000])])


def _record(namespace: str, name: str, event: str | None, message: str, **fields: Any) -> dict[str, Any]:
    """One transition; ``only_if`` makes it happen once when handlers race (the timer and on.create)."""
    return kube.record(names.INCIDENTS, namespace, name, event, message, **fields).get("status") or {}


def _no_condition(type_: str) -> Any:
    return lambda status: not any(c.get("type") == type_ for c in status.get("conditions") or [])


def _node_unset(node: str, key: str) -> Any:
    return lambda status: not ((status.get("nodes") or {}).get(node) or {}).get(key)


def needs_work(status: dict[str, Any], **_: Any) -> bool:
    """Level-triggered safety net (a kopf timer): an incident not yet contained, or held by the
    storm guard, is reconciled again even if a lost progress patch left kopf nothing to retry."""
    if any(c.get("type") == "Verified" and c.get("status") == "False" for c in status.get("conditions") or []):
        return False  # not the operator's: never acted on
    return status.get("phase") in (None, IncidentPhase.CONTAINING) or kube.is_true(status, "StormGuard")


def needs_announcing(spec: dict[str, Any], status: dict[str, Any], **_: Any) -> bool:
    """A node this incident cordoned and could not localize, whose node condition is not yet known
    to be set (a kopf timer, :func:`announce_held`): with no NodeReplacement, whose timer would set
    it again, a lost write of the cordon's was never made again."""
    if any(c.get("type") == "Verified" and c.get("status") == "False" for c in status.get("conditions") or []):
        return False  # not the operator's: never acted on
    return status.get("phase") not in (None, IncidentPhase.CONTAINING) and bool(_unannounced(spec, status))


def _unannounced(spec: dict[str, Any], status: dict[str, Any]) -> list[str]:
    """The verified suspects' nodes that ``status.nodes`` records cordoned, not localized, and not
    yet announced (a status anyone with status rights may write: it only narrows what is tried;
    which node is announced for whom is the storm-guard ledger's, :func:`contain.reannounce`)."""
    recorded = status.get("nodes") or {}
    return [node for node in dict.fromkeys(s.get("node") for s in spec.get("suspects") or [] if s.get("node"))
            if (state := recorded.get(node) or {}).get("cordoned") and state.get("localizeError")
            and not state.get("replacement") and not state.get("announced")]


def announce_held(body: dict[str, Any], settings: Settings, retry: int = 0) -> None:
    """The node condition of each node held for this incident with no NodeReplacement, set again
    if the cordon's write was lost; recorded (``status.nodes.<node>.announced``) once it is there,
    or is no longer this incident's to set (the slot given back), so the timer stops. Only an
    incident the operator created (its seal checked)."""
    namespace, name = body["metadata"]["namespace"], body["metadata"]["name"]
    body = _verified_again(body, settings)
    if body is None:
        return
    ref = f"{namespace}/{name}"
    for node in _unannounced(body["spec"], body.get("status") or {}):
        if contain.reannounce(node, [ref], settings):
            _record(namespace, name, None, "", nodes={node: {"announced": True}}, only_if=_node_unset(node, "announced"))
        else:
            raise kopf.TemporaryError(f"node {node}: condition {names.NODE_CONDITION} not set yet for {ref}",
                                      delay=settings.backoff(retry + 1))


def _suspend(namespace: str, name: str, spec: dict[str, Any], status: dict[str, Any], settings: Settings) -> dict[str, Any]:
    if not settings.suspend_jobs or any(c.get("type") == "JobSuspended" for c in status.get("conditions") or []):
        return status
    job = spec["job"]
    if contain.suspend_job(job):
        return _record(namespace, name, "JobSuspended", f"PyTorchJob {job['name']}: spec.runPolicy.suspend=true",
                       only_if=_no_condition("JobSuspended"),
                       conditions=[kube.condition("JobSuspended", True, "Suspended", "suspended by sdcguard; "
                                                  "resume it yourself from status.resumeFrom")])
    return _record(namespace, name, "JobNotSuspended", f"PyTorchJob {job['name']} no longer exists",
                   only_if=_no_condition("JobSuspended"),
                   conditions=[kube.condition("JobSuspended", False, "JobNotFound", "the job no longer exists")])


def _cordon_all(namespace: str, name: str, ref: str, spec: dict[str, Any], status: dict[str, Any],
                settings: Settings) -> list[tuple[str, str]]:
    """Cordon every suspect node not yet recorded as cordoned; return those the storm guard holds."""
    held = []
    nodes = dict.fromkeys(s["node"] for s in spec["suspects"] if s.get("node"))
    recorded = status.get("nodes") or {}
    for node in nodes:
        if (recorded.get(node) or {}).get("cordoned") or (recorded.get(node) or {}).get("missing") \
                or (recorded.get(node) or {}).get("refused"):
            continue
        problem = _verify_suspect(spec, status, node, settings)
        if problem and contain.held_cordoned(node, ref, settings):
            problem = None  # cordoned for it on a pass whose record was lost: its pods are gone since
        if problem:
            contain.give_back_uncordoned(node, ref, settings)
            _record(namespace, name, "SuspectRefused", f"{node} is not cordoned: {problem}",
                    nodes={node: {"refused": problem[:500]}}, only_if=_node_unset(node, "refused"))
            continue
        if not settings.allow_shared_nodes:
            shared = contain.other_namespaces(node, namespace, settings)
            if shared and not contain.held_cordoned(node, ref, settings):
                text = (f"{node} is not cordoned: it also runs pods of {len(shared)} other namespace(s); one "
                        "tenant's alarm does not take a shared node out of service. A person decides (cordon it "
                        "yourself, or set SDCGUARD_ALLOW_SHARED_NODES on a single-tenant cluster)")
                metrics.INCIDENTS_REFUSED.labels("SharedNode").inc()
                contain.give_back_uncordoned(node, ref, settings)
                _record(namespace, name, "SharedNode", text, nodes={node: {"refused": "SharedNode"}},
                        only_if=_node_unset(node, "refused"),
                        conditions=[kube.condition("SharedNode", True, "OtherNamespaces", text)])
                continue
        outcome = contain.cordon(node, ref, spec["job"]["name"], settings)
        if outcome.startswith("Max"):
            held.append((node, outcome))
        elif outcome == "missing":
            _missing(namespace, name, ref, node, settings)
        else:
            text = f"cordoned and labelled {names.SUSPECT_LABEL}=true" if outcome == "cordoned" else \
                "already cordoned as suspect by another incident"
            _record(namespace, name, "NodeCordoned", f"{node}: {text}", only_if=_node_unset(node, "cordoned"),
                    nodes={node: {"cordoned": True, "cordonedAt": kube.now()}},
                    conditions=[kube.condition("NodesCordoned", True, "Cordoned", "suspect nodes cordoned")])
    return held


def _open_replacements(namespace: str, name: str, ref: str, spec: dict[str, Any], status: dict[str, Any],
                       settings: Settings) -> None:
    """A NodeReplacement for each node that the verified ``spec.suspects`` name and whose storm-guard
    slot sdcguard holds for this incident (it cordoned the node for it). ``status.nodes`` is a
    free-form map anyone with status rights can write: it only says what is already done (a
    replacement opened, a node that could not be localized), never which node to act on."""
    recorded = status.get("nodes") or {}
    for node in dict.fromkeys(s["node"] for s in spec["suspects"] if s.get("node")):
        state = recorded.get(node) or {}
        if state.get("replacement") or state.get("localizeError") or state.get("missing") or state.get("refused"):
            continue
        if contain.slot_holder(node, settings) != ref:
            continue  # not cordoned by sdcguard for this incident (held back, refused, or another incident's)
        try:
            found_node = kube.core().read_node(node)
        except Exception as exc:
            if not kube.not_found(exc):
                raise
            _missing(namespace, name, ref, node, settings)  # gone since its slot was taken
            continue
        if (found_node.metadata.labels or {}).get(names.SUSPECT_LABEL) != "true":
            # its suspect label removed by hand before a replacement was opened: a person took it
            # over; the slot is given back (nothing else would) and nothing is opened
            contain.give_back_uncordoned(node, ref, settings)
            _record(namespace, name, "SuspectLabelRemoved", f"{node}: the {names.SUSPECT_LABEL} label was removed; "
                    "no replacement is opened and its storm-guard slot is given back",
                    nodes={node: {"refused": "SuspectLabelRemoved"}}, only_if=_node_unset(node, "refused"))
            continue
        try:
            found = localize.localize(found_node, settings)
        except localize.NotLocalized as exc:
            _record(namespace, name, "NotLocalized", str(exc), nodes={node: {"localizeError": str(exc)}})
            continue
        except hyperpod.Transient as exc:
            raise kopf.TemporaryError(f"localizing {node}: {exc}", delay=settings.retry_seconds) from None
        except hyperpod.AwsError as exc:
            _record(namespace, name, "NotLocalized", str(exc), nodes={node: {"localizeError": str(exc)}})
            continue
        replacement_name = replacement.ensure(node, found, ref, settings)
        _record(namespace, name, "ReplacementCreated",
                f"{node} is instance {found.instance_id} of {found.cluster} (from {found.source}); "
                f"NodeReplacement {replacement_name}",
                nodes={node: {"instanceId": found.instance_id, "cluster": found.cluster,
                              "instanceGroup": found.instance_group, "replacement": replacement_name}},
                replacements={replacement_name: "Opened"}, only_if=_node_unset(node, "replacement"))


def _missing(namespace: str, name: str, ref: str, node: str, settings: Settings) -> None:
    """A suspect node that no longer exists: recorded, and a slot this incident holds for it given
    back (nothing else would: no NodeReplacement is opened for a node that is not there)."""
    contain.give_back_uncordoned(node, ref, settings)
    _record(namespace, name, "NodeMissing", f"node {node} no longer exists", nodes={node: {"missing": True}},
            only_if=_node_unset(node, "missing"))


def awaits_replacements(status: dict[str, Any], **_: Any) -> bool:
    """An incident waiting for its NodeReplacements (a kopf timer, :func:`follow_replacements`):
    their phases reach it from a watch event whose handler kopf does not retry, so a failed write
    there would leave it waiting for good."""
    if any(c.get("type") == "Verified" and c.get("status") == "False" for c in status.get("conditions") or []):
        return False  # not the operator's: never acted on
    return status.get("phase") == IncidentPhase.AWAITING_APPROVAL


def follow_replacements(body: dict[str, Any], settings: Settings) -> None:
    """Take each NodeReplacement's phase into the incident again (:func:`sync`); only an incident
    the operator created (its seal checked)."""
    if _verified_again(body, settings) is not None:
        sync(f"{body['metadata']['namespace']}/{body['metadata']['name']}")


def note(ref: str, event: str, message: str, replacement_name: str, phase: str, denied_healthy: bool = False) -> None:
    """Record a NodeReplacement's phase in the incident (once per phase: the timeline gets its entry
    when the recorded phase changes); the incident resolves when all are done. ``denied_healthy``:
    the replacement was denied after its deep health check passed (``status.cost``; an incident all
    of whose replacements were is a false-positive investigation, :mod:`.cost`)."""
    namespace, name = ref.split("/", 1)
    false_positive: list[bool] = []

    def change(status: dict[str, Any]) -> dict[str, Any]:
        false_positive[:] = [False]
        replacements = dict(status.get("replacements") or {})
        if replacement_name not in replacements:
            return {}  # not one this incident opened: a NodeReplacement naming it proves nothing
        patch: dict[str, Any] = {}
        denied = list((status.get("cost") or {}).get("deniedAfterPassedCheck") or [])
        if denied_healthy and replacement_name not in denied:
            denied.append(replacement_name)
            patch["cost"] = {"deniedAfterPassedCheck": denied}
        timeline = list(status.get("timeline") or [])
        if replacements.get(replacement_name) != phase:
            replacements[replacement_name] = phase
            patch["replacements"] = replacements
            if event:
                timeline.append({"time": kube.now(), "event": event, "message": message})
        if all(p in TERMINAL for p in replacements.values()) and status.get("phase") == IncidentPhase.AWAITING_APPROVAL:
            timeline.append({"time": kube.now(), "event": "Resolved",
                             "message": f"every node replacement is done; resume from {resume_text(status)}"})
            patch["phase"] = IncidentPhase.RESOLVED
            patch["conditions"] = kube.merge_conditions(status.get("conditions") or [], [kube.condition(
                "Resolved", True, "ReplacementsDone", f"resume the job from {resume_text(status)}")])
            false_positive[:] = [cost.false_positive(replacements, denied)]
            patch["cost"] = {**patch.get("cost", {}), "falsePositive": false_positive[0]}
        if len(timeline) != len(status.get("timeline") or []):
            patch["timeline"] = timeline
        return patch
    try:
        kube.update_status(names.INCIDENTS, namespace, name, change)
    except Exception as exc:
        if not kube.not_found(exc):
            raise
        return
    if false_positive and false_positive[0]:  # counted once: by the write that resolved it
        metrics.FALSE_POSITIVES.inc()
