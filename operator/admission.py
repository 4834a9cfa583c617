"""Admission of NodeReplacements (docs/design.md §6): who decided, whether they may, and a fixed target.

Modelled on cert-manager's CertificateRequest approval. The chart registers this handler as a
mutating webhook with ``failurePolicy: Fail`` for CREATE and UPDATE of ``nodereplacements``
(never ``/status``), so the rules hold for ``kubectl sdcguard``, ``kubectl patch`` and any client:

- the decider is the AdmissionRequest's authenticated ``userInfo``: setting ``spec.decision``
  writes ``spec.decidedBy`` (username) and ``spec.decidedByGroups``; whatever the client put there
  is overwritten, and writing them without deciding is refused;
- setting a decision needs the RBAC verb ``approve`` on ``nodereplacements.sdcguard.dev`` (the
  ``sdcguard-approver`` ClusterRole), asked of the API server with a SubjectAccessReview; the
  ``patch`` right that lets the request reach us is not enough;
- a decision, once made, never changes (nor does its reason or its decider);
- the target (node, instance, cluster, instance group) and the incident references are the
  operator's: nobody else may change them after creation;
- only the operator creates NodeReplacements (the operator also seals its own and never adopts one
  without its seal, which holds while this webhook is absent);
- ``spec.release`` (``kubectl sdcguard release NODE``: give a Failed replacement's storm-guard slot
  back) is treated like a decision: it needs ``approve``, records ``spec.releasedBy`` /
  ``releasedByGroups`` from the authenticated user, and is final.

The CRD repeats the immutability as CEL ``x-kubernetes-validations`` so that it holds while this
webhook is absent. :func:`judge` is pure and decides everything but the SubjectAccessReview;
:func:`admit` is the handler's work (registered by :mod:`.main`).
"""
from __future__ import annotations

import asyncio
import dataclasses
import logging
from collections.abc import Mapping
from typing import Any

import kopf

from sdcguard.contract import names

from . import approval, kube, metrics

HANDLER_ID = names.REPLACEMENT_WEBHOOK_ID  # also the URL path kopf serves it at
TARGET_FIELDS = approval.TARGET_FIELDS
OPERATOR_FIELDS = TARGET_FIELDS + ("incidents",)
DECIDER_FIELDS = ("decidedBy", "decidedByGroups")
RELEASER_FIELDS = ("releasedBy", "releasedByGroups")
APPROVE_VERB = "approve"
SAR_TIMEOUT = 3.0

log = logging.getLogger("sdcguard_operator.admission")


@dataclasses.dataclass(frozen=True, slots=True)
class Verdict:
    """``allowed``, else ``message`` and ``code``; ``deciding``: the decision this request sets
    (allowed only if the user may ``approve``)."""

    allowed: bool
    message: str = ""
    code: int = 200
    reason: str = "Allowed"
    deciding: str | None = None
    releasing: bool = False


def _refuse(reason: str, message: str, code: int = 403) -> Verdict:
    return Verdict(False, message, code, reason)


def judge(operation: str, old: Mapping[str, Any] | None, new: Mapping[str, Any] | None, username: str,
          operator_username: str | None) -> Verdict:
    """The rules above for ``spec`` before (``old``, None on CREATE) and after (``new``)."""
    old, new = dict(old or {}), dict(new or {})
    is_operator = bool(operator_username) and username == operator_username
    if operation == "CREATE" and operator_username and not is_operator:
        return _refuse("OperatorCreates", "NodeReplacements are created by the sdcguard operator only "
                       "(one it did not create is never acted on)")
    if operation == "UPDATE" and not is_operator:
        changed = [f for f in OPERATOR_FIELDS if old.get(f) != new.get(f)]
        target = [f for f in changed if f in TARGET_FIELDS]
        if target:
            return _refuse("TargetImmutable", f"spec.{', spec.'.join(target)}: the target of a NodeReplacement is "
                           "fixed when the sdcguard operator creates it; nobody may change it", 422)
        if changed:
            return _refuse("OperatorField", "spec.incidents is written by the sdcguard operator only")
    released, releasing = bool(old.get("release")), bool(new.get("release"))
    if released and (not releasing or any(old.get(f) != new.get(f) for f in RELEASER_FIELDS + ("releaseReason",))):
        return _refuse("ReleaseFinal", "spec.release and its record are final once requested", 422)
    if not releasing and any(old.get(f) != new.get(f) for f in RELEASER_FIELDS):
        return _refuse("ReleaserForged", f"spec.{', spec.'.join(RELEASER_FIELDS)}: who released is recorded from "
                       "the authenticated user when spec.release is set, never written by a client", 422)
    verdict = _judge_decision(old, new)
    if verdict.allowed and releasing and not released:
        return dataclasses.replace(verdict, releasing=True)
    return verdict


def _judge_decision(old: dict[str, Any], new: dict[str, Any]) -> Verdict:
    before, after = old.get("decision") or "", new.get("decision") or ""
    if before:
        if after != before:
            return _refuse("DecisionFinal", f"spec.decision is final: {before} cannot become {after or 'empty'}", 422)
        frozen = [f for f in DECIDER_FIELDS + ("decisionReason",) if old.get(f) != new.get(f)]
        if frozen:
            return _refuse("DecisionFinal", f"spec.{', spec.'.join(frozen)}: the record of a decision is final", 422)
        return Verdict(True)
    if after:
        return Verdict(True, deciding=after)
    forged = [f for f in DECIDER_FIELDS if old.get(f) != new.get(f)]
    if forged:
        return _refuse("DeciderForged", f"spec.{', spec.'.join(forged)}: who decided is recorded from the "
                       "authenticated user when spec.decision is set, never written by a client", 422)
    return Verdict(True)


def access_review(userinfo: Mapping[str, Any], name: str) -> dict[str, Any]:
    """The SubjectAccessReview that asks whether this user may decide NodeReplacement ``name``."""
    spec: dict[str, Any] = {"user": userinfo.get("username", ""), "groups": list(userinfo.get("groups") or []),
                            "resourceAttributes": {"group": names.GROUP, "resource": names.REPLACEMENTS,
                                                   "verb": APPROVE_VERB, "name": name}}
    if userinfo.get("uid"):
        spec["uid"] = userinfo["uid"]
    if userinfo.get("extra"):
        spec["extra"] = {k: list(v) for k, v in userinfo["extra"].items()}
    return {"apiVersion": "authorization.k8s.io/v1", "kind": "SubjectAccessReview", "spec": spec}


def may_approve(userinfo: Mapping[str, Any], name: str) -> tuple[bool, str]:
    """(allowed, why) from the API server; any failure to ask is a refusal (fail closed)."""
    import kubernetes

    api = kubernetes.client.AuthorizationV1Api(kube.api_client())
    try:
        answer = api.create_subject_access_review(access_review(userinfo, name), _request_timeout=SAR_TIMEOUT)
    except Exception as exc:  # noqa: BLE001 — cannot ask: cannot allow
        return False, f"the SubjectAccessReview failed ({type(exc).__name__}: {str(exc)[:200]})"
    status = answer.status
    if status is not None and status.allowed:
        return True, status.reason or ""
    return False, (status.reason or status.evaluation_error or "") if status is not None else "no answer"


async def admit(name: str, operation: str, old_spec: Mapping[str, Any] | None, new_spec: Mapping[str, Any] | None,
                userinfo: Mapping[str, Any], patch: kopf.Patch, operator_username: str | None) -> None:
    """Refuse with a message (``kopf.AdmissionError``), or allow, recording the decider in ``patch``
    when deciding. ``operator_username``: ``SDCGUARD_OPERATOR_USERNAME``, read at start."""
    username = str(userinfo.get("username") or "")
    verdict = judge(operation, old_spec, new_spec, username, operator_username)
    if verdict.allowed and (verdict.deciding or verdict.releasing):
        allowed, why = await asyncio.to_thread(may_approve, userinfo, name)
        if not allowed:
            verdict = _refuse("NotApprover", f"{username or 'this user'} may not decide NodeReplacement {name}: "
                              f"that needs the RBAC verb {APPROVE_VERB} on {names.REPLACEMENTS}.{names.GROUP} "
                              f"(ClusterRole sdcguard-approver); patch rights do not suffice"
                              + (f" ({why})" if why else ""))
    if not verdict.allowed:
        metrics.ADMISSION.labels(verdict.reason).inc()
        log.warning(f"NodeReplacement {name}: {operation} by {username} refused: {verdict.message}")
        raise kopf.AdmissionError(verdict.message, code=verdict.code)
    if verdict.releasing:
        patch.spec["releasedBy"] = username
        patch.spec["releasedByGroups"] = [str(g) for g in userinfo.get("groups") or []]
        metrics.ADMISSION.labels("Released").inc()
        log.info(f"NodeReplacement {name}: storm-guard slot release requested by {username}")
    if verdict.deciding:
        patch.spec["decidedBy"] = username
        patch.spec["decidedByGroups"] = [str(g) for g in userinfo.get("groups") or []]
        metrics.ADMISSION.labels("Decided").inc()
        log.info(f"NodeReplacement {name}: {verdict.deciding} by {username}")
    else:
        metrics.ADMISSION.labels("Allowed").inc()
