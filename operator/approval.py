"""Approval of a NodeReplacement, modelled on cert-manager's CertificateRequest approval.

Approved and Denied are separate, mutually exclusive, one-way decisions.  A person sets
``spec.decision`` (with ``kubectl sdcguard approve|deny`` or a plain ``kubectl patch``); the
operator copies the first decision it sees into the status with who decided and why, and ignores
any later change of ``spec.decision``.  Denied is checked first and is terminal.
"""
from __future__ import annotations

from typing import Any

from sdcguard.contract import names

from . import kube

DECISIONS = ("Approved", "Denied")


def recorded(status: dict[str, Any]) -> str | None:
    """The decision already recorded in the status (the only one that counts), if any."""
    return (status.get("decision") or {}).get("decision")


def requested(spec: dict[str, Any]) -> str | None:
    value = spec.get("decision")
    return value if value in DECISIONS else None


def who(spec: dict[str, Any], metadata: dict[str, Any]) -> str:
    """Who decided: spec.decidedBy (the plugin sets it), else the field manager that set spec.decision."""
    if spec.get("decidedBy"):
        return str(spec["decidedBy"])
    for entry in metadata.get("managedFields") or []:
        if "f:decision" in str(entry.get("fieldsV1", {})):
            return f"{entry.get('manager', 'unknown')} (field manager)"
    return "unknown (spec.decidedBy not set)"


def record(name: str, body: dict[str, Any], decision: str) -> dict[str, Any]:
    """Record the decision in status once (condition Approved or Denied, reason = how, message = who/why)."""
    spec, metadata = body.get("spec") or {}, body.get("metadata") or {}
    by, why = who(spec, metadata), spec.get("decisionReason") or ""
    message = f"{decision.lower()} by {by}" + (f": {why}" if why else "")
    return kube.record(names.REPLACEMENTS, None, name, decision, message,
                       decision={"decision": decision, "by": by, "reason": why, "time": kube.now()},
                       conditions=[kube.condition(decision, True, "KubectlSdcguard" if spec.get("decidedBy") else
                                                  "SpecDecision", message)]).get("status") or {}
