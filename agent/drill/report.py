"""Judging a drill: which check should have caught each injected fault, and did it?

For every fault the drill works out, from the schedule alone, the check that must catch it and the
step it must fire on, then matches the alarms against that. A fault on a step where its check does
not run is an *escape* (reported, not an error); a fault its check should have caught but did not,
an alarm naming the wrong rank, or an alarm no fault explains makes the drill fail.
Standard library only.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ..contract.alarm import CHECK_REPLAY, CHECK_WEIGHTS
from ..faults.spec import FaultSpec

# Outcomes. The first three are what a healthy sdcguard produces; the rest fail the drill.
CAUGHT, AMBIGUOUS, ESCAPED, NOT_REACHED = "caught", "caught-ambiguous", "escaped", "not-reached"
MISSED, MISATTRIBUTED = "missed", "misattributed"
PASSING = {CAUGHT, AMBIGUOUS, ESCAPED, NOT_REACHED}


@dataclass(frozen=True, slots=True)
class Schedule:
    steps: int
    audit_every: int
    weight_check_every: int
    nodes: int

    def audits(self, step: int) -> bool:
        return self.audit_every > 0 and step % self.audit_every == 0

    def weight_checks(self, step: int) -> bool:
        return self.weight_check_every > 0 and step % self.weight_check_every == 0


def expectation(fault: FaultSpec, plan: Schedule) -> tuple[str | None, int | None, str]:
    """(check, step, why): what must catch ``fault`` and when; check None means it escapes."""
    check = fault.info.caught_by
    if check is None:
        return None, None, "corruption inside the all-reduce reaches every replica alike: the known blind spot"
    firings = [s for s in range(fault.step, plan.steps) if fault.fires_at(s)]
    if not firings:
        return None, None, "the run ends before the fault's step"
    if check == CHECK_REPLAY:
        audited = [s for s in firings if plan.audits(s)]
        if not audited:
            if fault.during == "replay":
                return None, None, "a replay-side fault needs an audit step: nothing is replayed elsewhere"
            return None, None, "no audit step among the fault's steps: check 2 does not run there"
        return check, audited[0], "ring replay on an audit step"
    if check == CHECK_WEIGHTS:
        seen = _first_weight_check(fault, plan)
        if seen is None:
            return None, None, "no weight check runs between the fault and the end of the run"
        return check, seen, "weight fingerprints differ from the majority"
    return check, firings[0], "non-finite values are checked on every step"


def judge(faults: list[FaultSpec], alarms: list[dict[str, Any]], plan: Schedule,
          stopped_at: int | None) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """Each fault with its expectation and outcome, and the alarms that no fault explains."""
    unexplained = list(alarms)
    rows = []
    for fault in faults:
        check, step, why = expectation(fault, plan)
        row = {**fault.as_dict(), "expected_check": check, "expected_step": step, "why": why,
               "alarm": None}
        match = next((a for a in unexplained if a["check"] == check and a["step"] == step), None)
        if check is None:
            row["outcome"] = ESCAPED
        elif match is None:
            reached = stopped_at is None or step <= stopped_at
            row["outcome"] = MISSED if reached else NOT_REACHED
        else:
            unexplained.remove(match)
            row["alarm"] = match["id"]
            row["outcome"] = _attribution(fault, match)
        rows.append(row)
    return rows, unexplained


def passed(rows: list[dict[str, Any]], unexplained: list[dict[str, Any]]) -> bool:
    return not unexplained and all(r["outcome"] in PASSING for r in rows)


def _attribution(fault: FaultSpec, alarm: dict[str, Any]) -> str:
    named = alarm["suspect_ranks"]
    if fault.info.corrupts == "reduce":
        return CAUGHT if not named else MISATTRIBUTED
    if alarm["ambiguous"]:
        return AMBIGUOUS if fault.rank in named else MISATTRIBUTED
    return CAUGHT if named == [fault.rank] else MISATTRIBUTED


def _first_weight_check(fault: FaultSpec, plan: Schedule) -> int | None:
    """First check 3 after the weights went bad: audit steps check before the update, weight-check
    steps after it; an optimizer fault lands between the two, a stored-weight fault before both."""
    after_update = fault.info.corrupts == "optimizer"
    for step in range(fault.step, plan.steps):
        pre = plan.audits(step) and not (after_update and step == fault.step)
        if pre or plan.weight_checks(step):
            return step
    return None
