"""Approval of a NodeReplacement, modelled on cert-manager's CertificateRequest approval.

Approved and Denied are separate, mutually exclusive, one-way decisions.  A person sets
``spec.decision`` (with ``kubectl sdcguard approve|deny`` or a plain ``kubectl patch``); the
admission webhook (:mod:`.admission`) lets only holders of the ``approve`` verb do so and records
who they are, as the API server authenticated them, in ``spec.decidedBy`` / ``decidedByGroups``.
The operator copies the first decision it sees into the status with who decided and why, and
ignores any later change of ``spec.decision``.  Denied is checked first and is terminal.
"""
from __future__ import annotations

from typing import Any

from sdcguard.contract import names
from sdcguard.contract.phases import TERMINAL_REPLACEMENT_PHASES, Decision

from . import kube

DECISIONS = tuple(Decision)
TERMINAL = TERMINAL_REPLACEMENT_PHASES
"""NodeReplacement phases after which nothing more happens to it."""
TARGET_FIELDS = ("nodeName", "instanceId", "clusterName", "instanceGroup")
"""What a NodeReplacement acts on: fixed at creation (admission, CEL rules, the recorded target)."""


def recorded(status: dict[str, Any]) -> str | None:
    """The decision already recorded in the status (the only one that counts), if any."""
    return (status.get("decision") or {}).get("decision")


def requested(spec: dict[str, Any]) -> str | None:
    value = spec.get("decision")
    return value if value in DECISIONS else None


UNATTRIBUTED = "unknown (no admission record: is the sdcguard NodeReplacement webhook installed?)"


def who(spec: dict[str, Any]) -> tuple[str, list[str]]:
    """Who decided, as admission recorded it (username, groups); never a client's own claim."""
    if spec.get("decidedBy"):
        return str(spec["decidedBy"]), [str(g) for g in spec.get("decidedByGroups") or []]
    return UNATTRIBUTED, []


def record(name: str, body: dict[str, Any], decision: str) -> dict[str, Any]:
    """Record the decision in status once (condition Approved or Denied, reason = how, message = who/why)."""
    spec = body.get("spec") or {}
    (by, groups), why = who(spec), spec.get("decisionReason") or ""
    message = f"{decision.lower()} by {by}" + (f": {why}" if why else "")
    return kube.record(names.REPLACEMENTS, None, name, decision, message, only_if=lambda st: not recorded(st),
                       decision={"decision": decision, "by": by, "groups": groups, "reason": why, "time": kube.now()},
                       conditions=[kube.condition(decision, True, "AdmissionUserInfo" if spec.get("decidedBy") else
                                                  "NotAttributed", message)]).get("status") or {}
