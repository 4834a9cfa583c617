"""The fault grammar and the judging of a run: which check catches what, and when (in-process)."""
import pytest

from sdcguard.faults import KINDS, FaultSpec, FaultSpecError, Schedule, expectation, judge_faults, parse_fault


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


def test_target_fields_round_trip():
    spec = parse_fault("grad-bitflip:rank=1:step=2:element=7:param=transformer.h.0.mlp.c_fc.weight", 6)
    assert (spec.element, spec.param, spec.site) == (7, "transformer.h.0.mlp.c_fc.weight", None)
    assert parse_fault(str(spec), 6) == spec
    site = parse_fault("forward-scale:rank=0:step=1:site=module._orig_mod.h.0", 2)
    assert site.site == "module._orig_mod.h.0" and site.param is None
    assert parse_fault("reduce-nan:step=4:param=lm_head.weight:element=3").rank is None  # world size unchecked
    assert parse_fault("grad-inf:rank=99:step=1").rank == 99


def test_a_target_error_is_a_spec_error():
    from sdcguard.faults import FaultTargetError
    assert issubclass(FaultTargetError, FaultSpecError)


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
    ("grad-inf:rank=1:step=2:element=-1", "element must be >= 0"),
    ("grad-inf:rank=1:step=2:element=x", "element must be an integer"),
    ("grad-inf:rank=1:step=2:site=h.0", "site= names a module for the forward"),
    ("forward-nan:rank=1:step=2:param=h.0.weight", "use site=PATH"),
    ("forward-nan:rank=1:step=2:site=", "expected key=value"),
])
def test_malformed_specs(text, message):
    with pytest.raises(FaultSpecError, match=message):
        parse_fault(text, 6)


PLAN = Schedule(steps=20, audit_every=5, weight_check_every=3, nodes=3)


@pytest.mark.parametrize("text, check, step", [
    ("forward-nan:rank=1:step=7", "nonfinite-local", 7),
    ("grad-inf:rank=1:step=7", "nonfinite-local", 7),
    ("reduce-nan:step=7", "nonfinite-reduced", 7),
    ("reduce-scale:step=7", "reduce-checksum", 7),
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


def test_without_check_4_a_finite_reduce_fault_escapes():
    plan = Schedule(steps=20, audit_every=5, weight_check_every=3, nodes=3, checks_reduction=False)  # a compression hook
    check, step, why = expectation(parse_fault("reduce-scale:step=7", 6), plan)
    assert (check, step) == (None, None) and "check 4 is off" in why
    assert expectation(parse_fault("reduce-nan:step=7", 6), plan)[:2] == ("nonfinite-reduced", 7)  # 1b still runs


@pytest.mark.parametrize("text, step", [
    ("weight-bitflip:rank=1:step=13", 14),   # check 3 before the checkpoint at 14
    ("optimizer-scale:rank=1:step=12", 12),  # a checkpoint step checks after the update
    ("weight-swap:rank=1:step=15", 15),      # audit step: checked before the update
])
def test_check_3_before_a_checkpoint_counts(text, step):
    plan = Schedule(steps=20, audit_every=5, weight_check_every=0, nodes=3, checkpoint_every=2)
    assert expectation(parse_fault(text, 3), plan)[:2] == ("weights", step)
    assert expectation(parse_fault(text, 3), Schedule(20, 5, 0, 3))[1] == 15  # no checkpoints: the audit


def _alarm(check, step, ranks, ambiguous=False, window=None):
    alarm = {"id": f"{check}-{step}", "check": check, "step": step, "suspect_ranks": ranks, "ambiguous": ambiguous}
    if window is not None:
        alarm["suspect_window"] = {"first_step": window[0], "last_step": window[1]}
    return alarm


def test_judge_outcomes():
    faults = [parse_fault(t, 6) for t in (
        "grad-inf:rank=1:step=2", "weight-swap:rank=4:step=7", "forward-nan:rank=3:step=8",
        "grad-bitflip:rank=2:step=9", "grad-inf:rank=0:step=15")]
    alarms = [_alarm("nonfinite-local", 2, [1]), _alarm("weights", 9, [2]), _alarm("replay", 11, [5])]
    verdict = judge_faults(faults, alarms, PLAN, stopped_at=12)
    assert [r["outcome"] for r in verdict.rows] == ["caught", "misattributed", "missed", "escaped", "not-reached"]
    assert [a["id"] for a in verdict.unexplained] == ["replay-11"]
    assert not verdict.passed
    assert verdict.as_dict()["unexplained_alarms"] == ["replay-11"]
    assert judge_faults(faults[:1], alarms[:1], PLAN).passed


def test_ambiguous_alarm_including_the_culprit():
    verdict = judge_faults([FaultSpec("grad-bitflip", 2, 10)], [_alarm("replay", 10, [0, 2], ambiguous=True)], PLAN)
    assert verdict.rows[0]["outcome"] == "caught-ambiguous" and verdict.passed


def test_judging_your_own_run_from_spec_text_and_every_ranks_alarms():
    """The user collects ``exc.alarm`` on every rank: the same record counts once."""
    alarm = _alarm("replay", 10, [1])
    verdict = judge_faults(["grad-bitflip:rank=1:step=10", "grad-bitflip:rank=2:step=3"], [alarm, dict(alarm), alarm],
                           Schedule(steps=20, audit_every=5, weight_check_every=2, nodes=3))
    assert [r["outcome"] for r in verdict.rows] == ["caught", "escaped"] and verdict.unexplained == []
    assert verdict.rows[0]["named"] == [1] and verdict.rows[0]["alarm"] == "replay-10"
    text = verdict.to_text()
    assert "grad-bitflip:rank=1:step=10: CAUGHT (check replay at step 10, naming rank 1)" in text
    assert "grad-bitflip:rank=2:step=3: ESCAPED (no audit step among the fault's steps" in text
    assert text.splitlines()[-1] == "PASSED: 1 caught, 1 escaped"


def test_to_text_names_what_went_wrong():
    verdict = judge_faults(["weight-swap:rank=4:step=7", "forward-nan:rank=3:step=8"],
                           [_alarm("weights", 9, [2]), _alarm("replay", 11, [5])], PLAN)
    lines = verdict.to_text().splitlines()
    assert lines[0] == "weight-swap:rank=4:step=7: MISATTRIBUTED (check weights at step 9 named rank 2)"
    assert lines[1] == "forward-nan:rank=3:step=8: MISSED (expected check nonfinite-local at step 8: no such alarm)"
    assert lines[2] == "unexplained alarm replay-11: check replay at step 11 naming rank 5"
    assert lines[3] == "FAILED: 1 misattributed, 1 missed, 1 unexplained alarm(s)"


def test_schedule_of_a_guard():
    from types import SimpleNamespace as Obj

    def guard(world_size, checks_reduction=True, **config):
        return Obj(config=Obj(**{"audit_every": 50, "weight_check_every": 10, **config}),
                   topology=Obj(nodes=world_size // 2 or 1, world_size=world_size),
                   layout=Obj(checks_reduction=checks_reduction, checks_weights=world_size > 1))

    assert Schedule.of(guard(8), steps=1000, checkpoint_every=100) == Schedule(1000, 50, 10, 4, 100)
    assert not Schedule.of(guard(8, checks_reduction=False), steps=1000).checks_reduction
    audited = Schedule.of(guard(8, checkpoint_every=30, audit_checkpoints=True), steps=1000)
    assert audited == Schedule(1000, 50, 10, 4, 30, audit_checkpoints=True)
    assert audited.audits(60) and audited.audits(50) and not audited.audits(40)
    assert Schedule.of(guard(1), steps=10).audit_every == 0  # one replica never audits


PLAN_RESUME = Schedule(steps=20, audit_every=5, weight_check_every=0, nodes=3, checkpoint_every=2)


@pytest.mark.parametrize("text, alarm, resume, outcome", [
    # window {6,10} after the audit at 5: step-4 is safe, step-8 is inside the window
    ("grad-bitflip:rank=1:step=10", _alarm("replay", 10, [1], window=(6, 10)), 4, "caught"),
    ("grad-bitflip:rank=1:step=10", _alarm("replay", 10, [1], window=(6, 10)), 8, "resume-unsafe"),
    # a window that starts too late: the state after step 9 holds the fault that began at 9
    ("grad-bitflip:rank=1:step=9:every=1", _alarm("replay", 10, [1], window=(10, 10)), 9, "resume-unsafe"),
    ("weight-bitflip:rank=2:step=13", _alarm("weights", 14, [2], window=(13, 14)), 12, "caught"),
    ("weight-bitflip:rank=2:step=13", _alarm("weights", 14, [2], window=(13, 14)), 13, "resume-unsafe"),
    ("reduce-nan:step=7", _alarm("nonfinite-reduced", 7, [], window=(0, 7)), -1, "caught"),  # from the start
    # a replay-side fault never touches the model: only the alarm's window counts
    ("grad-bitflip:rank=1:step=10:during=replay", _alarm("replay", 10, [1], window=(6, 10)), 4, "caught"),
])
def test_resume_inside_the_window_is_unsafe(text, alarm, resume, outcome):
    verdict = judge_faults([text], [alarm], PLAN_RESUME, resumed_at={alarm["id"]: resume})
    [row] = verdict.rows
    assert (row["outcome"], row["resume_step"]) == (outcome, resume)
    assert verdict.passed == (outcome == "caught")
    if outcome == "resume-unsafe":
        assert f"resumed from step {resume}" in row["why"] and "RESUME-UNSAFE" in verdict.to_text()


def test_misattribution_is_not_hidden_by_a_safe_resume():
    alarm = _alarm("replay", 10, [2], window=(6, 10))
    [row] = judge_faults(["grad-bitflip:rank=1:step=10"], [alarm], PLAN_RESUME, resumed_at={alarm["id"]: 4}).rows
    assert row["outcome"] == "misattributed" and row["resume_step"] == 4
