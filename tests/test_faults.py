"""The --inject grammar and the drill's expectations of which check catches what."""
import pytest

from sdcguard.drill.report import Schedule, expectation, judge, passed
from sdcguard.faults.spec import KINDS, FaultSpec, FaultSpecError, parse_fault


def test_every_kind_parses():
    for kind in KINDS:
        spec = parse_fault(f"{kind}:rank=1:step=3", 6)
        assert (spec.kind, spec.rank, spec.step, spec.every) == (kind, 1, 3, None)


def test_optional_fields():
    spec = parse_fault("forward-scale:rank=0:step=5:magnitude=1e3:every=4", 6)
    assert spec.magnitude == 1000.0 and spec.every == 4 and spec.persistent
    assert [s for s in range(20) if spec.fires_at(s)] == [5, 9, 13, 17]
    assert parse_fault("reduce-nan:step=2", 6).rank is None
    assert parse_fault("grad-bitflip:step=2:rank=5", 6).rank == 5  # field order is free
    assert str(spec) == "forward-scale:rank=0:step=5:magnitude=1000:every=4"
    assert parse_fault("grad-bitflip:rank=1:step=2:during=replay", 6).during == "replay"


@pytest.mark.parametrize("text, message", [
    ("cosmic-ray:rank=0:step=1", "unknown fault kind"),
    ("grad-inf:rank=6:step=1", "out of range"),
    ("grad-inf:rank=-1:step=1", "rank must be >= 0"),
    ("grad-inf:step=1", "lacks rank"),
    ("grad-inf:rank=1", "lacks step"),
    ("grad-inf:rank=1:step", "expected key=value"),
    ("grad-inf:rank=1:step=x", "step must be an integer"),
    ("grad-inf:rank=1:step=2:every=0", "every must be >= 1"),
    ("grad-inf:rank=1:step=2:colour=red", "unknown field"),
    ("grad-inf:rank=1:step=2:step=3", "given twice"),
    ("grad-inf:rank=1:step=2:magnitude=3", "only to the \\*-scale kinds"),
    ("forward-scale:rank=1:step=2:magnitude=inf", "finite"),
    ("forward-scale:rank=1:step=2:during=later", "during must be"),
    ("weight-bitflip:rank=1:step=2:during=replay", "applies only to transient"),
    ("grad-bitflip:rank=1:step=2:every=3:during=replay", "applies only to transient"),
])
def test_malformed_specs(text, message):
    with pytest.raises(FaultSpecError, match=message):
        parse_fault(text, 6)


PLAN = Schedule(steps=20, audit_every=5, weight_check_every=3, nodes=3)


@pytest.mark.parametrize("text, check, step", [
    ("forward-nan:rank=1:step=7", "nonfinite-local", 7),
    ("grad-inf:rank=1:step=7", "nonfinite-local", 7),
    ("reduce-nan:step=7", "nonfinite-reduced", 7),
    ("reduce-scale:step=7", None, None),
    ("grad-bitflip:rank=1:step=10", "replay", 10),
    ("grad-bitflip:rank=1:step=7", None, None),             # not an audit step: an escape
    ("forward-scale:rank=1:step=7:every=4", "replay", 15),   # persistent: fires 7, 11, 15
    ("weight-bitflip:rank=1:step=7", "weights", 9),          # next weight check
    ("weight-swap:rank=1:step=10", "weights", 10),           # audit steps check before the update
    ("optimizer-scale:rank=1:step=10", "weights", 12),       # lands after the audit's check
    ("optimizer-scale:rank=1:step=9", "weights", 9),         # weight check runs after the update
    ("weight-bitflip:rank=1:step=19", None, None),           # nothing checks before the end
])
def test_expectations(text, check, step):
    assert expectation(parse_fault(text, 6), PLAN)[:2] == (check, step)


def _alarm(check, step, ranks, ambiguous=False):
    return {"id": f"{check}-{step}", "check": check, "step": step, "suspect_ranks": ranks, "ambiguous": ambiguous}


def test_judge_outcomes():
    faults = [parse_fault(t, 6) for t in (
        "grad-inf:rank=1:step=2", "weight-swap:rank=4:step=7", "forward-nan:rank=3:step=8",
        "reduce-scale:step=9", "grad-inf:rank=0:step=15")]
    alarms = [_alarm("nonfinite-local", 2, [1]), _alarm("weights", 9, [2]), _alarm("replay", 11, [5])]
    rows, unexplained = judge(faults, alarms, PLAN, stopped_at=12)
    assert [r["outcome"] for r in rows] == ["caught", "misattributed", "missed", "escaped", "not-reached"]
    assert [a["id"] for a in unexplained] == ["replay-11"]
    assert not passed(rows, unexplained)
    ok_rows, none = judge(faults[:1], alarms[:1], PLAN, stopped_at=None)
    assert passed(ok_rows, none)


def test_ambiguous_alarm_including_the_culprit():
    rows, _ = judge([FaultSpec("grad-bitflip", 2, 10)], [_alarm("replay", 10, [0, 2], ambiguous=True)],
                    PLAN, None)
    assert rows[0]["outcome"] == "caught-ambiguous"
