"""The phases of sdcguard's objects and the decisions a person makes, spelled once.

``status.phase`` of a NodeReplacement and of an SDCIncident, and ``spec.decision`` of a
NodeReplacement, as the CRDs (deploy/crds/) enumerate them. The operator writes them, the kubectl
plugin and the sandbox read them. They are ``StrEnum``s: each member is the very string the API
stores (``ReplacementPhase.FAILED == "Failed"``), so comparing with what the API returns and
writing a member into a status both work as with the plain string. Standard library only.
"""
from __future__ import annotations

import enum


class ReplacementPhase(enum.StrEnum):
    """``NodeReplacement.status.phase``: HealthCheck -> PendingApproval -> Replacing -> Replaced,
    or Denied / Failed."""

    HEALTH_CHECK = "HealthCheck"
    PENDING_APPROVAL = "PendingApproval"
    REPLACING = "Replacing"
    REPLACED = "Replaced"
    FAILED = "Failed"
    DENIED = "Denied"


TERMINAL_REPLACEMENT_PHASES = (ReplacementPhase.REPLACED, ReplacementPhase.FAILED, ReplacementPhase.DENIED)
"""NodeReplacement phases after which nothing more happens to it."""


class IncidentPhase(enum.StrEnum):
    """``SDCIncident.status.phase``: Containing -> AwaitingApproval (a node to replace) or
    Contained (none) -> Resolved (every replacement done)."""

    CONTAINING = "Containing"
    CONTAINED = "Contained"
    AWAITING_APPROVAL = "AwaitingApproval"
    RESOLVED = "Resolved"


class Decision(enum.StrEnum):
    """``NodeReplacement.spec.decision``: separate, mutually exclusive, one-way (cert-manager's
    Approved / Denied)."""

    APPROVED = "Approved"
    DENIED = "Denied"
